"""The files of a run directory (``output_dir``), and whether one already holds a run."""

from __future__ import annotations

from pathlib import Path

from densebatch.train.observe.monitor import METRICS_FILE

FINAL_DIR = "final"  # output_dir/final: model + tokenizer + config.yaml + densebatch_state.json
CHECKPOINT_DIR = "checkpoints"
FINAL_STATE = "densebatch_state.json"  # {"step": N}: which step the final weights are
RUN_OUTPUTS = (
    METRICS_FILE, CHECKPOINT_DIR, FINAL_DIR, "plots", "tensorboard", "csv", "config.yaml", "tracker-runs.json", "wandb", "mlruns",
)  # fmt: skip


def holds_a_run(out: Path) -> list[str]:
    """The outputs of an earlier run found in ``out`` (metrics, checkpoints, final model); empty when
    it is safe to start there."""
    found = []
    for name in RUN_OUTPUTS[:3]:
        p = out / name
        if p.is_file() or (p.is_dir() and any(p.iterdir())):
            found.append(name)
    return found

"""The files of a run directory (``output_dir``), whether one already holds a run, and the mark that ties a
checkpoint mirror (``checkpoint.mirror_dir``) to the one run it mirrors."""

from __future__ import annotations

import json
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
    return [name for name in RUN_OUTPUTS[:3] if _present(out / name)]


def _present(p: Path) -> bool:
    """A file, or a directory that holds something."""
    return p.is_file() or (p.is_dir() and any(p.iterdir()))


def foreign_outputs(out: Path) -> list[str]:
    """Files a run writes (its configuration, plots, trackers' files) found in ``out`` where ``holds_a_run``
    finds no run: the user's own (a config.yaml beside them) or another tool's, which a run would write over."""
    return [name for name in RUN_OUTPUTS[3:] if _present(out / name)]


MIRROR_MARK = "densebatch-mirror.json"  # in checkpoint.mirror_dir: {"output_dir": the run it mirrors}


def mirror_owner(mirror: Path) -> str | None:
    """The run directory ``mirror`` is the checkpoint mirror of (its mark), "" for a mark that does not read,
    None when it has no mark."""
    try:
        owner = json.loads((mirror / MIRROR_MARK).read_text(encoding="utf-8"))["output_dir"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    return owner if isinstance(owner, str) else ""

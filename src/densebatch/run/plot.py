"""The plot command: draw a finished (or running) run's PNGs from its metrics.jsonl into RUN_DIR/plots."""

from __future__ import annotations

from pathlib import Path

from densebatch.errors import UserError
from densebatch.train.observe.monitor import METRICS_FILE
from densebatch.train.observe.plots import PLOTS_DIR, plot_run


def plot_command(args) -> int:
    """``densebatch plot RUN_DIR``: write the plots and print where; exit 2 when there is nothing to draw."""
    run_dir = Path(args.run_dir)
    if not (run_dir / METRICS_FILE).is_file():
        what = "does not exist" if not run_dir.exists() else f"holds no {METRICS_FILE}"
        raise UserError(f"{run_dir} {what}: give the output_dir of a training run")
    paths = plot_run(run_dir)  # ConfigError naming the `plot` extra when matplotlib is missing
    if not paths:
        raise UserError(f"{run_dir / METRICS_FILE} holds no train or eval record to plot")
    print(f"plots: {run_dir / PLOTS_DIR}/ ({', '.join(p.name for p in paths)})", flush=True)
    return 0

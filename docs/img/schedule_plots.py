"""Draw the pictures of docs/schedules.md from the metrics.jsonl of real runs (the commands are on that page).

    python docs/img/schedule_plots.py batch  RUN_DIR OUT.png   # tokens per step and learning rate against steps
    python docs/img/schedule_plots.py groups RUN_DIR OUT.png   # learning rate of every optimizer group against steps

Only train records whose update was applied are drawn (a rollback's replayed steps supersede the old ones);
``batch_size`` events are marked with their reason.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from statistics import median

from matplotlib.figure import Figure


def records(run_dir: Path) -> list[dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def train_by_step(recs: list[dict]) -> list[dict]:
    by_step = {r["step"]: r for r in recs if r.get("kind") == "train"}  # a replayed step supersedes the first
    return [by_step[s] for s in sorted(by_step)]


def batch_figure(recs: list[dict], out: Path) -> None:
    train = train_by_step(recs)
    steps = [r["step"] for r in train]
    # tokens of a full step: the median of the steps at the target (else of tokens / fraction over all steps)
    full = median(
        [r["real_tokens"] for r in train if r["batch_fraction"] == 1.0] or [r["real_tokens"] / r["batch_fraction"] for r in train]
    )
    fig = Figure(figsize=(8, 5.5), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    top.bar(steps, [r["real_tokens"] for r in train], width=0.8, color="#9ecae1", label="real tokens of the step")
    top.step(steps, [r["batch_fraction"] * full for r in train], where="mid", color="#08519c", label="fraction x full step")
    evals = [r for r in recs if r.get("kind") == "eval" and "loss" in r]
    if len(evals) > 1:
        twin = top.twinx()
        twin.plot([r["step"] for r in evals], [r["loss"] for r in evals], "o-", color="#d95f02", ms=3, label="eval loss")
        twin.set_ylabel("eval loss", color="#d95f02")
    for e in (r for r in recs if r.get("kind") == "batch_size"):
        for ax in (top, bottom):
            ax.axvline(e["step"] + 0.5, color="gray", ls="--", lw=0.8)
        top.annotate(e["reason"], (e["step"] + 0.5, full * 1.3), fontsize=7, rotation=90, va="top", ha="left")
    top.set_ylabel("tokens per step")
    top.set_ylim(0, full * 1.35)
    fig.legend(loc="outside upper center", ncol=3, fontsize=8)  # above the panels: clear of the event labels
    bottom.plot(steps, [r["lr"] for r in train], color="#08519c")
    bottom.set_ylabel("learning rate")
    bottom.set_xlabel("step")
    fig.savefig(out, dpi=110)


def groups_figure(recs: list[dict], out: Path) -> None:
    train = train_by_step(recs)
    steps = [r["step"] for r in train]
    names = list(train[0]["lr_groups"])
    fig = Figure(figsize=(8, 4), layout="constrained")
    ax = fig.subplots()
    for name in names:
        ax.plot(steps, [r["lr_groups"][name] for r in train], label=name, lw=1.5 if "." in name else 2.5)
    ax.set_xlabel("step")
    ax.set_ylabel("learning rate")
    ax.legend(fontsize=8, ncol=2)
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    kind, run_dir, out = sys.argv[1:4]
    {"batch": batch_figure, "groups": groups_figure}[kind](records(Path(run_dir)), Path(out))

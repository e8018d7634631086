"""train.compile against eager on CPU: step time, compile cost, graphs compiled, losses.

    .venv/bin/python -m benchmarks.throughput.compile_bench [--steps 40] [--repeats 2] [--strategy token_budget]

Each run is ``densebatch train`` on the embedded default (the demo's model and data), ``--steps`` steps of
one batch each (``train.loss_tokens_per_step: null``), with ``--train.compile`` false or true, eager and
compiled alternating ``--repeats`` times so that the machine's drift falls on both. Reported: the median
step time over the steps after the first 5 (the first step of a compiled run includes compiling), the
first step's time, the graphs compiled (from the run's summary line) and the largest difference of the
train losses between eager and compiled runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import REPO


def run(compiled: bool, steps: int, strategy: str, threads: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="compile-") as tmp:
        cmd = [
            sys.executable, "-m", "densebatch.cli", "train", f"--output_dir={tmp}/run", f"--train.max_steps={steps}",
            "--train.loss_tokens_per_step=null", f"--batching.strategy={strategy}", "--eval.every_steps=0",
            "--eval.accuracy_samples=0", "--train.progress=false", "--train.plots=false", f"--train.compile={str(compiled).lower()}",
        ]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(REPO / "src"))
        r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(r.stderr[-3000:])
        recs = [json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [x for x in recs if x["kind"] == "train"]
    m = re.search(r"compile: (\d+) graphs \((\d+) at the first step, (\d+) after it\)", r.stdout)
    return {
        "compiled": compiled,
        "median_step_s": statistics.median(x["step_s"] for x in train[5:]),
        "first_step_s": train[0]["step_s"],
        "losses": [x["loss"] for x in train],
        "graphs": m.groups() if m else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--strategy", default="token_budget")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    runs = [run(c, a.steps, a.strategy, a.threads) for _ in range(a.repeats) for c in (False, True)]
    eager = [r for r in runs if not r["compiled"]]
    comp = [r for r in runs if r["compiled"]]
    e, c = statistics.median(r["median_step_s"] for r in eager), statistics.median(r["median_step_s"] for r in comp)
    diff = max(abs(x - y) for r in comp for x, y in zip(r["losses"], eager[0]["losses"]))
    print(f"strategy {a.strategy}, {a.steps} steps, {a.repeats} repeats each, {a.threads} threads")
    print(f"eager:    median step {e * 1e3:.1f} ms, first step {statistics.median(r['first_step_s'] for r in eager):.2f} s")
    print(
        f"compiled: median step {c * 1e3:.1f} ms, first step {statistics.median(r['first_step_s'] for r in comp):.2f} s; "
        f"graphs (total, first step, after) {comp[0]['graphs']}"
    )
    print(f"compiled / eager step time {c / e:.2f}; largest train-loss difference {diff:.2e}")


if __name__ == "__main__":
    main()

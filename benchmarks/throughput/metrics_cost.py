"""Cost of the per-step observability figures (memory, timing split, health checks) against the step they describe.

    .venv/bin/python -m benchmarks.throughput.metrics_cost [--steps 40 | --run RUN_DIR] [--repeats 2000] [--json FILE]

Trains the demo (`densebatch train` with no configuration) for ``--steps`` steps in this process (or
reads the records of an existing run, ``--run``), then times, on that run's own train records, what each step pays for its observability on top of the step:

- ``resource_usage``: reading the memory figures (/proc/self/statm, getrusage; CUDA peak counters);
- ``timing``: the clock reads and the timing dict of the step split;
- ``health``: ``HealthMonitor.observe`` on every record (the run's records replayed, several times);
- ``jsonl_extra``: writing the record to metrics.jsonl with the new fields minus without them;
- ``tensorboard`` / ``csv`` (only with ``train.report_to``): a sink's ``write`` of one record.

Each is the median over ``--repeats`` calls (five rounds; the median round), in microseconds, and is
reported as a share of the run's median ``step_s``: a per-step cost, not an A/B of two runs, which
the noise of a shared machine (step times varying by 10% from step to step) could not resolve.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from densebatch.cli import main as cli
from densebatch.train.observe.health import HealthMonitor
from densebatch.train.observe.monitor import METRICS_FILE, MetricsWriter, read_metrics, resource_usage
from densebatch.train.observe.sinks import CSVSink, TensorBoardSink

NEW_FIELDS = ("data_wait_s", "fwd_bwd_s", "optimizer_s", "step_s", "mem_rss_gb", "mem_peak_rss_gb")


def per_call_us(fn, repeats: int, rounds: int = 5) -> float:
    """Median over ``rounds`` of the mean time of ``repeats`` calls, in microseconds."""
    means = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(repeats):
            fn()
        means.append((time.perf_counter() - t) / repeats * 1e6)
    return statistics.median(means)


def timing_split() -> dict:
    t0 = time.perf_counter()
    t1 = time.perf_counter()
    t2 = time.perf_counter()
    t3 = time.perf_counter()
    return {"data_wait_s": t1 - t0, "fwd_bwd_s": t2 - t1, "optimizer_s": t3 - t2, "step_s": t3 - t0}


def measure(records: list[dict], repeats: int, work: Path) -> dict[str, float]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = {
        "resource_usage": per_call_us(lambda: resource_usage(device), repeats),
        "timing": per_call_us(timing_split, repeats),
    }
    # The demo clips its first steps (by design): below the limit here, so that no cause is given and
    # skipped, and every check runs to its end on every record.
    feed = [r | {"grad_norm": 0.5 * r["clip_limit"]} for r in records]
    feed = (feed * (repeats // len(feed) + 1))[:repeats]
    monitor = HealthMonitor(memory_limit_gb=1e6, clip_limit=1.0)
    it = iter(range(10**9))
    out["health"] = per_call_us(lambda: monitor.observe(feed[next(it) % len(feed)]), repeats)
    for w in monitor.warnings:  # a cause given once is not judged again: that check then costs less
        print(f"(replayed run warned: {w})")

    rec = records[len(records) // 2]
    bare = {k: v for k, v in rec.items() if k not in NEW_FIELDS}
    writer = MetricsWriter(work / "cost.jsonl", append=False)
    out["jsonl_extra"] = per_call_us(lambda: writer.write(rec), repeats) - per_call_us(lambda: writer.write(bare), repeats)
    writer.close()
    for name, make in (("tensorboard", TensorBoardSink), ("csv", CSVSink)):
        try:
            sink = make(work / name)
        except Exception as e:  # the tensorboard extra is optional
            print(f"{name}: not measured ({e})")
            continue
        steps = iter(range(1, 10**9))
        out[name] = per_call_us(lambda s=sink, n=steps: s.write(rec | {"step": next(n)}), max(1, repeats // 10))
        sink.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--run", metavar="RUN_DIR", help="use this run's metrics.jsonl instead of training")
    ap.add_argument("--repeats", type=int, default=2000)
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        run = Path(a.run) if a.run else work / "run"
        if not a.run:
            args = ["train", f"--output_dir={run}", f"--train.max_steps={a.steps}", "--train.progress=false"]
            args += ["--eval.accuracy_samples=0", "--eval.max_batches=1", "--train.plots=false"]
            with contextlib.redirect_stdout(io.StringIO()):
                assert cli(args) == 0
        records = [r for r in read_metrics(run / METRICS_FILE) if r["kind"] == "train"]
        step_s = statistics.median(r["step_s"] for r in records[len(records) // 4 :])  # past the first steps
        costs = measure(records, a.repeats, work)
    per_step = sum(v for k, v in costs.items() if k not in ("tensorboard", "csv"))
    print(f"step: median {step_s * 1e3:.1f} ms over the last {len(records) - len(records) // 4} of {len(records)} steps")
    print("| part | µs per step | share of the step |\n|---|---|---|")
    for name, us in costs.items():
        print(f"| {name} | {us:.1f} | {us / (step_s * 1e6):.4%} |")
    print(f"| **always on, total** | {per_step:.1f} | {per_step / (step_s * 1e6):.4%} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"step_s": step_s, "us": costs, "total_us": per_step}, indent=1))


if __name__ == "__main__":
    main()

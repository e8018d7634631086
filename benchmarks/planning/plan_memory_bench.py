"""Planning time and peak memory at 10M-100M documents: whole-corpus ``plan_epoch`` vs ``plan_epoch_sharded``.

    .venv/bin/python -m benchmarks.planning.plan_memory_bench --sizes 10000000,100000000 [--modes whole,sharded] [--strategies packed,...]
    .venv/bin/python -m benchmarks.planning.plan_memory_bench --sizes 10000000 --shard-docs 1048576,2097152,4194304 --modes sharded
    .venv/bin/python -m benchmarks.planning.plan_memory_bench --seq-len 1024 --max-tokens 8192 ...
    .venv/bin/python -m benchmarks.planning.plan_memory_bench --random-breakdown 100000000

Lognormal lengths (median 300, sigma 1, clipped to [1, 4096], seed 0; 100M of them hold 48.6B tokens),
written once to ``benchmarks/.cache/lognormal-N.npy`` (int64). Each (size, strategy, mode) runs in a
fresh process that loads the file, then plans one epoch and computes its stats (what ``densebatch
analyze`` times), by default with the settings of ``densebatch analyze``'s embedded config: seq_len
512, max_tokens_per_batch 4096, rows_per_batch 8, mega_batch_mult 50. Reported: wall and process-CPU
seconds of planning + stats, peak resident memory of the process (``ru_maxrss``: Python, numpy and
the lengths array included), memory after loading the lengths, and the fill rate.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import CACHE, REPO
from densebatch.data.plan.strategies import STRATEGIES  # numpy only: the parent measures nothing itself


def lengths_file(n: int) -> Path:
    path = CACHE / f"lognormal-{n}.npy"
    if not path.exists():  # generated in chunks: no 3x-size float temporaries
        CACHE.mkdir(exist_ok=True)
        rng = np.random.default_rng(0)
        out = np.lib.format.open_memmap(path.with_suffix(".tmp.npy"), mode="w+", dtype=np.int64, shape=(n,))
        for a in range(0, n, 1 << 22):
            m = min(n, a + (1 << 22)) - a
            out[a : a + m] = np.clip(rng.lognormal(np.log(300), 1.0, m).astype(np.int64), 1, 4096)
        out.flush()
        del out
        path.with_suffix(".tmp.npy").rename(path)
    return path


def child(path: str, strategy: str, mode: str, shard_docs: int, seq_len: int, max_tokens: int) -> None:
    from densebatch.data.plan.planner import PlanSettings, plan_epoch
    from densebatch.data.plan.shards import plan_epoch_sharded

    x = np.load(path)
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    s = PlanSettings(strategy=strategy, seq_len=seq_len, max_tokens_per_batch=max_tokens, rows_per_batch=8, shard_docs=shard_docs)
    w, c = time.perf_counter(), time.process_time()
    plan = plan_epoch(x, settings=s, seed=0, epoch=0) if mode == "whole" else plan_epoch_sharded(x, settings=s, seed=0, epoch=0)
    stats = plan.stats()
    wall, cpu = time.perf_counter() - w, time.process_time() - c
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(
        json.dumps(
            {"wall": wall, "cpu": cpu, "peak": peak, "loaded": loaded, "fill": stats["fill_rate"], "batches": stats["batches"]}
        )
    )


def random_breakdown(n: int) -> None:
    """CPU seconds of each step of the whole-corpus random planner (why it grows faster than n)."""
    from densebatch.data.plan.planner import PlanSettings
    from densebatch.data.plan.strategies import _one_item_per_row

    x = np.load(lengths_file(n))
    rng = np.random.default_rng(0)

    def step(name, fn):
        c = time.process_time()
        out = fn()
        print(f"| {name} | {time.process_time() - c:.2f} |", flush=True)
        return out

    print(f"| step ({n:,} documents) | CPU s |\n|---|---|")
    perm = step("rng.permutation(n)", lambda: rng.permutation(n))
    step("lengths[perm]", lambda: x[perm])
    plan = step("Plan arrays (_one_item_per_row)", lambda: _one_item_per_row(perm, x, PlanSettings(strategy="random")))
    step("plan.stats()", plan.stats)
    step("np.arange(n).sum() (fresh pages)", lambda: np.arange(n).sum())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="10000000")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--modes", default="whole,sharded")
    ap.add_argument("--shard-docs", default=str(1 << 20), help="comma-separated: one sharded run per value")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--random-breakdown", type=int, metavar="N", help="time the whole-corpus random planner's steps at N")
    ap.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.random_breakdown:
        random_breakdown(a.random_breakdown)
        return
    if a.child:
        child(a.child[0], a.child[1], a.child[2], *map(int, a.child[3:]))
        return
    print(
        "| documents | strategy | plan | shard_docs | wall s | CPU s | peak RSS GB | after load GB | peak bytes / doc | (peak - after load) / doc | fill | batches |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n in map(int, a.sizes.split(",")):
        path = lengths_file(n)
        for st in a.strategies.split(","):
            for mode in a.modes.split(","):
                for sd in a.shard_docs.split(",") if mode == "sharded" else ["-"]:
                    cmd = [
                        sys.executable,
                        "-m",
                        __spec__.name,  # this module, in a fresh process (its peak RSS is the cell's)
                        "--child",
                        str(path),
                        st,
                        mode,
                        sd if sd != "-" else str(1 << 20),
                        str(a.seq_len),
                        str(a.max_tokens),
                    ]
                    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
                    if out.returncode:
                        print(f"| {n:,} | {st} | {mode} | {sd} | failed: {out.stderr.strip().splitlines()[-1:]} |", flush=True)
                        continue
                    r = json.loads(out.stdout.strip().splitlines()[-1])
                    print(
                        f"| {n:,} | {st} | {mode} | {sd} | {r['wall']:.2f} | {r['cpu']:.2f} | {r['peak'] / 1e9:.2f} | "
                        f"{r['loaded'] / 1e9:.2f} | {r['peak'] / n:.1f} | {(r['peak'] - r['loaded']) / n:.1f} | {r['fill']:.5f} | {r['batches']:,} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()

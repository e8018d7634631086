"""Planning time from 1k to 10M documents (lognormal lengths, median 300, clipped to 4096), beside TRL.

    .venv/bin/python -m benchmarks.planning.plan_bench [--sizes 1000,10000,100000,1000000,10000000] [--trl-max 1000000]
    .venv/bin/python -m benchmarks.planning.plan_bench --bundles [--sizes 10000000]

``--bundles``: packed, token_budget and length_grouped with bundling (``bundle_tokens: auto``, the default) against the
length-sorted plans without it (``0``), interleaved in each repeat so that both see the same load.

Median of repeats (5 below 1M documents, 3 from 1M) of wall and process-CPU seconds per strategy,
seq_len 2048, max_tokens_per_batch 8192. TRL's ``pack_dataset(strategy="bfd")`` is timed when trl
is importable (optional; it needs the token values, so its dataset holds zeros of the same lengths).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from densebatch.data.plan.planner import PlanSettings, plan_epoch
from densebatch.data.plan.strategies import STRATEGIES


def lognormal(n: int, seed: int = 0) -> np.ndarray:
    return np.clip(np.random.default_rng(seed).lognormal(np.log(300), 1.0, n).astype(np.int64), 1, 4096)


def timed(fn, repeats: int) -> tuple[float, float]:
    wall, cpu = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
    return statistics.median(wall), statistics.median(cpu)


def trl_time(lengths: np.ndarray, seq_len: int) -> float | None:
    try:
        import pyarrow as pa
        from datasets import Dataset, disable_progress_bars
        from trl.data_utils import pack_dataset
    except ImportError:
        return None
    disable_progress_bars()
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    col = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(np.zeros(int(offsets[-1]), np.int32)))
    ds = Dataset(pa.table({"input_ids": col}))
    t = time.perf_counter()
    pack_dataset(ds, seq_length=seq_len, strategy="bfd")
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1000,10000,100000,1000000,10000000")
    ap.add_argument("--trl-max", type=int, default=1_000_000)
    ap.add_argument("--bundles", action="store_true", help="bundled vs unbundled packed, token_budget and length_grouped")
    a = ap.parse_args()
    if a.bundles:
        bundles(list(map(int, a.sizes.split(","))))
        return
    print("| documents | " + " | ".join(f"{s} wall / cpu s" for s in STRATEGIES) + " | TRL pack_dataset bfd wall s |")
    print("|" + "---|" * (len(STRATEGIES) + 2))
    for n in map(int, a.sizes.split(",")):
        x = lognormal(n)
        cells = []
        for st in STRATEGIES:
            s = PlanSettings(strategy=st, seq_len=2048, max_tokens_per_batch=8192)
            plan_epoch(x, settings=s, seed=0, epoch=0)  # warm-up (page faults of fresh buffers)
            w, c = timed(lambda x=x, s=s: plan_epoch(x, settings=s, seed=0, epoch=1), 5 if n < 1_000_000 else 3)
            cells.append(f"{w:.3f} / {c:.3f}")
        t = trl_time(x, 2048) if n <= a.trl_max else None
        cells.append("n/a" if t is None else f"{t:.2f}")
        print(f"| {n:,} | " + " | ".join(cells) + " |", flush=True)


def bundles(sizes: list[int]) -> None:
    print("| documents | strategy | bundle_tokens 0: wall / cpu s | auto: wall / cpu s | cpu ratio |")
    print("|---|---|---|---|---|")
    for n in sizes:
        x = lognormal(n)
        for st in ("packed", "token_budget", "length_grouped"):
            runs: dict[str, list[tuple[float, float]]] = {"0": [], "auto": []}
            for rep in range(3):
                for bt in ("0", "auto"):
                    s = PlanSettings(strategy=st, seq_len=2048, max_tokens_per_batch=8192, bundle_tokens=0 if bt == "0" else bt)
                    runs[bt].append(timed(lambda x=x, s=s, rep=rep: plan_epoch(x, settings=s, seed=rep, epoch=1), 1))
            med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in runs.items()}
            print(
                f"| {n:,} | {st} | {med['0'][0]:.2f} / {med['0'][1]:.2f} | {med['auto'][0]:.2f} / {med['auto'][1]:.2f} "
                f"| {med['auto'][1] / med['0'][1]:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()

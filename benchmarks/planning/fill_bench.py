"""Fill rate of every batching strategy on the shared data sets and on synthetic long tails.

    .venv/bin/python -m benchmarks.planning.fill_bench [--seq-len 2048] [--max-tokens 8192] [--rows 8]

Prints a markdown table. "pad-to-longest" pads every row to the longest document of the set;
"HF group_by_length @cap" is length-grouped batching whose rows-per-batch must fit the longest
document in the cap (rows = cap // longest), its fill measured against the cap (real / cap).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from benchmarks.common import SHARED_SETS, shared_lengths
from densebatch.data.plan.planner import PlanSettings, plan_epoch
from densebatch.data.plan.strategies import STRATEGIES


def synthetic(name: str, n: int = 20000, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if name == "lognormal":  # median 300, sigma 1: chat-like
        x = rng.lognormal(np.log(300), 1.0, n)
    elif name == "pareto":  # alpha 1.5 from 50 tokens: a heavy tail
        x = 50 * (1 + rng.pareto(1.5, n))
    else:
        raise ValueError(name)
    return np.clip(x.astype(np.int64), 2, 4096)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--rows", type=int, default=8)
    a = ap.parse_args()
    sets = {}
    for name in SHARED_SETS:
        try:
            sets[name] = shared_lengths(name)
        except FileNotFoundError:
            print(f"(skipping {name}: ../shared/data absent)", file=sys.stderr)
    sets["lognormal 20k"] = synthetic("lognormal")
    sets["pareto 20k"] = synthetic("pareto")
    base = PlanSettings(seq_len=a.seq_len, max_tokens_per_batch=a.max_tokens, rows_per_batch=a.rows)
    cols = ["pad-to-longest", *STRATEGIES, "HF group_by_length @cap"]
    print(f"seq_len {a.seq_len}, max_tokens_per_batch {a.max_tokens}, rows_per_batch {a.rows}; fill (batches)\n")
    print("| set | docs | tokens | " + " | ".join(cols) + " | packed rows / bound | token_budget real/batch ÷ cap |")
    print("|" + "---|" * (len(cols) + 5))
    for name, x in sets.items():
        cells = [f"{x.sum() / (len(x) * x.max()):.3f}"]
        stats = {}
        for st in STRATEGIES:
            p = plan_epoch(x, settings=PlanSettings(**{**base.__dict__, "strategy": st}), seed=0, epoch=0)
            stats[st] = (p, p.stats())
            cells.append(f"{stats[st][1]['fill_rate']:.3f} ({p.num_batches})")
        rows_hf = max(1, a.max_tokens // int(x.max()))
        hf = plan_epoch(x, settings=PlanSettings(strategy="length_grouped", rows_per_batch=rows_hf), seed=0, epoch=0)
        real, _ = hf.batch_stats()
        cells.append(f"{real.mean() / a.max_tokens:.3f} of cap ({hf.num_batches})")
        bound = -(-int(x.sum()) // a.seq_len)
        tb = stats["token_budget"][1]
        print(
            f"| {name} | {len(x):,} | {int(x.sum()):,} | "
            + " | ".join(cells)
            + f" | {stats['packed'][0].num_rows} / {bound} | {tb['mean_real_tokens'] / a.max_tokens:.3f} |"
        )


if __name__ == "__main__":
    main()

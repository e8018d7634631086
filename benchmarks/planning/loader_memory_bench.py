"""Peak resident memory of a training loader on a corpus of many documents: the plan read shard by shard
(``EpochRows``, what StepLoader does above ``batching.shard_docs``) against the same plan materialised.

Each mode runs in its own process (peak RSS is per process): build the loader on N lognormal lengths
(mean ~ 480 tokens, as `analyze --lengths` benchmarks), count one epoch's steps (the schedule's horizon),
then collate the first 20 steps. Token ids come from a stand-in store (every id 1), so only the plan
and the loader are measured.

    .venv/bin/python -m benchmarks.planning.loader_memory_bench --docs 10000000
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import numpy as np

from benchmarks.common import REPO


class Ones:
    """Token ids and loss mask of a corpus without storing them: every position reads 1."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, idx):
        return np.ones(np.shape(idx), np.int32)


def LengthsStore(lengths: np.ndarray):
    """A store in memory whose every token and mask entry reads 1: only its lengths are real."""
    from densebatch.data.store.store import DocumentStore

    offsets = np.concatenate([[0], np.cumsum(lengths)])
    ones = Ones(int(offsets[-1]))
    meta = {"eos_id": 0, "pad_id": 0, "vocab_size": 2, "mask_id": None, "special_ids": [0]}
    return DocumentStore(ones, offsets=offsets, loss_mask=ones, meta=meta)


def run_one(mode: str, n: int, strategy: str) -> dict:
    from densebatch.data.load.collate import CausalCollator
    from densebatch.data.load.loader import StepLoader
    from densebatch.data.plan.planner import PlanSettings
    from densebatch.data.plan.shards import EpochRows
    from densebatch.data.plan.store_epochs import materialise

    lengths = np.clip(np.random.default_rng(0).lognormal(5.8, 0.9, n), 1, 8192).astype(np.int64)
    store = LengthsStore(lengths)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    settings = PlanSettings(strategy=strategy, seq_len=2048, max_tokens_per_batch=16384, shard_docs=1 << 20)

    class Materialised(StepLoader):
        def plan(self, epoch):
            p = super().plan(epoch)
            if isinstance(p, EpochRows):
                p = self._plans[epoch] = materialise(p.sharded)
            return p

    cls = StepLoader if mode == "sharded" else Materialised
    t = time.perf_counter()
    loader = cls(store, settings=settings, collator=CausalCollator(pad_id=0), seed=0, prefetch=0)
    steps = loader.steps_per_epoch()
    it = iter(loader)
    real = sum(b.num_real_tokens for _ in range(20) for b in next(it).batches)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {
        "mode": mode, "strategy": strategy, "docs": n, "steps_per_epoch": steps, "real_tokens_20_steps": real,
        "seconds": round(time.perf_counter() - t, 1), "lengths_and_offsets_gb": round((lengths.nbytes * 2) / 2**30, 3),
        "peak_rss_gb_before_loader": round(base, 3), "peak_rss_gb": round(peak, 3),
        "loader_bytes_per_doc": round((peak - base) * 2**30 / n, 1),
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=10_000_000)
    ap.add_argument("--strategy", default="packed")
    ap.add_argument("--one", choices=["sharded", "materialised"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.docs, args.strategy)))
        return 0
    for mode in ("sharded", "materialised"):
        cmd = [sys.executable, "-m", __spec__.name, "--docs", str(args.docs), "--strategy", args.strategy, "--one", mode]
        print(subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=REPO).stdout.strip(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

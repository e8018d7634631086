"""Per-rank planning memory of training on a corpus of many documents, from a store on disk.

A store of N documents in the prepared format (shards of ``data.shard_tokens`` tokens with uint32
lengths and per-document loss counts, an index) is written once with lognormal lengths (mean about
480 tokens, as ``analyze --lengths`` benchmarks); its token and mask files are sparse (every id 0,
every mask entry 0), so only the lengths and counts take disk: what planning reads is real. Then,
in a fresh process per mode: open the store, build rank 0's ``StepLoader`` of a 2-rank run (packed
rows of 2,048, 16,384 slots a batch), count an epoch's steps (the schedule's horizon) and collate the
first 20 steps. Memory is the process's peak RSS after all that, less the peak RSS once the
interpreter, torch and densebatch are imported and the store opened, per document.

    .venv/bin/python -m benchmarks.scale.planning_memory --docs 100000000 --dir /tmp/planning-store
    .venv/bin/python -m benchmarks.scale.planning_memory --docs 100000000 --weights 1 3   # a weighted mixture of two
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

from benchmarks.common import REPO

SHARD_TOKENS = 1 << 27


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def write_store(directory: Path, n: int, seed: int = 0, sources: int = 1) -> None:
    """The store of ``n`` lognormal lengths, shard by shard (a million lengths in memory at a time); with
    ``sources`` > 1, the shards are split among that many sources, end to end (a mixture's layout)."""
    from densebatch.data.store.joined import FORMAT, write_index
    from densebatch.data.store.store_io import write_marker
    from densebatch.data.store.store_write import npy_header

    directory.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    shards: list[dict] = []

    def cuts():  # each shard's lengths: whole documents, at most SHARD_TOKENS tokens
        left, carry = n, np.zeros(0, np.int64)
        while left:
            fresh = np.clip(rng.lognormal(5.8, 0.9, min(left, 1 << 20)), 1, 8192).astype(np.int64)
            left -= len(fresh)
            carry = np.concatenate([carry, fresh])
            while True:
                k = int(np.searchsorted(np.cumsum(carry), SHARD_TOKENS, side="right"))
                if k == len(carry) and left:
                    break  # not full yet: draw more
                k = max(1, k)
                yield carry[:k]
                carry = carry[k:]
                if not len(carry):
                    break

    done = 0
    for here in cuts():
        source = min(sources - 1, done * sources // n)
        done += len(here)
        d = directory / f"shard-{len(shards):06d}"
        d.mkdir()
        tokens = int(here.sum())
        np.save(d / "lengths.npy", here.astype(np.uint32))
        np.save(d / "doc_loss.npy", (here - 1).astype(np.uint32))
        for name, dtype, size in (("tokens", np.dtype(np.uint16), 2), ("loss_mask", np.dtype(np.uint8), 1)):
            with open(d / f"{name}.npy", "wb") as f:
                f.write(npy_header(dtype, tokens))
                f.truncate(f.tell() + tokens * size)  # sparse: no disk for the ids
        shards.append({
            "path": d.name, "source": source, "documents": len(here), "tokens": tokens, "loss_tokens": int((here - 1).sum()),
            "max_length": int(here.max()), "sizes": {f"{x}.npy": (d / f"{x}.npy").stat().st_size for x in ("tokens", "loss_mask", "lengths", "doc_loss")},
        })  # fmt: skip
    meta = {"eos_id": 0, "pad_id": 0, "vocab_size": 50257, "mask_id": None, "special_ids": [0], "split": "train"}
    if sources > 1:
        meta["sources"] = [f"source{i}" for i in range(sources)]
    names = write_index(directory, shards, meta)
    write_marker(directory, {"format": FORMAT, "sizes": {x: (directory / x).stat().st_size for x in names}})


def run_one(directory: Path, mode: str, weights: tuple[float, ...] | None = None) -> dict:
    from densebatch.data.load.collate import CausalCollator
    from densebatch.data.load.loader import StepLoader
    from densebatch.data.plan.planner import PlanSettings
    from densebatch.data.plan.steps import StepSettings
    from densebatch.data.store.store import DocumentStore

    store = DocumentStore.open(directory)
    n = len(store)
    base = _rss_gb()
    settings = PlanSettings(strategy="packed", seq_len=2048, max_tokens_per_batch=16384)
    loss_tokens = 16384 * 2 if mode == "loss_tokens_per_step" else None
    steps = StepSettings(1, loss_tokens, 2, 0)  # rank 0 of 2
    t = time.perf_counter()
    loader = StepLoader(
        store, settings=settings, collator=CausalCollator(pad_id=0), seed=0, steps=steps, prefetch=0, weights=weights
    )
    per_epoch = loader.steps_per_epoch()
    it = iter(loader)
    real = sum(b.num_real_tokens for _ in range(20) for b in next(it).batches)
    peak = _rss_gb()
    return {
        "mode": mode, "weights": weights, "docs": n, "shards": len(json.loads((directory / "index.json").read_text())["shards"]),
        "steps_per_epoch": per_epoch, "real_tokens_20_steps": real, "seconds": round(time.perf_counter() - t, 1),
        "peak_rss_gb_after_open": round(base, 3), "peak_rss_gb": round(peak, 3),
        "planning_bytes_per_doc": round((peak - base) * 2**30 / n, 2),
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=100_000_000)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/densebatch-planning-store"))
    ap.add_argument("--weights", type=float, nargs="+", help="a weighted mixture: one weight a source (the store's "
                    "documents split among them, end to end)")  # fmt: skip
    ap.add_argument("--one", choices=["batches", "loss_tokens_per_step"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    k = len(args.weights or [1])
    store = args.dir / (f"docs-{args.docs}" + (f"-sources-{k}" if k > 1 else ""))
    if args.one:
        print(json.dumps(run_one(store, args.one, tuple(args.weights) if args.weights else None)))
        return 0
    if not (store / "COMPLETE").is_file():
        t = time.perf_counter()
        write_store(store, args.docs, sources=k)
        print(f"wrote {store} in {time.perf_counter() - t:.0f} s", flush=True)
    for mode in ("batches", "loss_tokens_per_step"):
        cmd = [sys.executable, "-m", __spec__.name, "--docs", str(args.docs), "--dir", str(args.dir), "--one", mode]
        cmd += ["--weights", *map(str, args.weights)] if args.weights else []
        print(subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=REPO).stdout.strip(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

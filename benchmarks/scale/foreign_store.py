"""A Megatron indexed corpus of N documents beside our own store of the same lengths: build, start-up, planning memory, read speed.

The corpus (``PREFIX.idx`` in the MMIDIDX layout, one sequence a document, uint16 ids; ``PREFIX.bin``
sparse: every id 0) and our own store (``planning_memory.write_store``'s sparse store) hold the
same lognormal lengths (the same generator, seed 0). Each measurement runs in a fresh process:

- ``build``: ``prepare`` of ``data.format: megatron`` with an empty cache (the index checked, every
  token scanned for the vocabulary, the eval split, the entry written): wall seconds and peak RSS;
- ``startup`` (3 times each, interleaved): the same ``prepare`` again (a cache hit: what every later run
  pays) for the megatron entry, and ``DocumentStore.open`` for our store, both timed after importing
  ``prepare``'s pipeline (which every run imports, whatever it reads: ``imports_s``, apart);
- ``plan``: rank 0 of 2's ``StepLoader`` (packed rows of 2,048, 16,384 slots a batch): steps of an
  epoch, then the first 20 steps collated; peak RSS over the RSS after importing the loader (torch)
  and opening, per document (as ``planning_memory`` measures our store);
- ``read``: 1,000 steps collated from each, tokens a second.

    .venv/bin/python -m benchmarks.scale.foreign_store --docs 10000000 --dir /tmp/foreign-store
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import REPO
from benchmarks.scale.planning_memory import write_store


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return round(r.ru_utime + r.ru_stime, 2)


def write_index(prefix: Path, n: int, seed: int = 0) -> None:
    """``prefix``.idx / .bin of ``n`` documents with ``write_store``'s lengths (a million at a time)."""
    rng = np.random.default_rng(seed)
    lengths = np.empty(n, np.int32)
    for a in range(0, n, 1 << 20):  # the draws write_store makes, in the same order
        k = min(n - a, 1 << 20)
        lengths[a : a + k] = np.clip(rng.lognormal(5.8, 0.9, k), 1, 8192).astype(np.int64)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, n, n + 1))
        f.write(lengths.tobytes())
        total = 0
        for a in range(0, n, 1 << 22):
            part = lengths[a : a + (1 << 22)].astype(np.int64)
            f.write(((total + np.cumsum(part) - part) * 2).tobytes())  # byte pointers of uint16 ids
            total += int(part.sum())
        f.write(np.arange(n + 1, dtype=np.int64).tobytes())
    with open(f"{prefix}.bin", "wb") as f:
        f.truncate(total * 2)


def _cfg(prefix: Path, cache: Path):
    from densebatch.config import DataConfig

    return DataConfig(
        path=str(prefix), format="megatron", tokenizer="default", cache_dir=str(cache), max_seq_len=8192, eval_fraction=0.0
    )


def _loader(store):
    from densebatch.data.load.collate import CausalCollator
    from densebatch.data.load.loader import StepLoader
    from densebatch.data.plan.planner import PlanSettings
    from densebatch.data.plan.steps import StepSettings

    settings = PlanSettings(strategy="packed", seq_len=2048, max_tokens_per_batch=16384)
    return StepLoader(
        store, settings=settings, collator=CausalCollator(pad_id=0), seed=0, steps=StepSettings(1, None, 2, 0), prefetch=0
    )


def _open(which: str, d: Path):
    if which == "ours":
        from densebatch.data.store.store import DocumentStore

        return DocumentStore.open(d / "ours")
    from densebatch.data.prepare.pipeline import prepare

    return prepare(_cfg(d / "megatron" / "corpus", d / "cache")).train


def run_one(which: str, phase: str, d: Path) -> dict:
    t = time.perf_counter()
    import densebatch.data.prepare.pipeline  # noqa: F401  (what every run imports, whichever store it reads)

    imports = time.perf_counter() - t
    if phase == "plan":
        import densebatch.data.load.loader  # noqa: F401  (torch: not planning memory)
    t = time.perf_counter()
    store = _open(which, d)
    out: dict = {"store": which, "phase": phase, "docs": len(store)}
    if phase in ("build", "startup"):
        return dict(out, seconds=round(time.perf_counter() - t, 3), imports_s=round(imports, 3), process_cpu_s=_cpu_s(),
                    peak_rss_gb=round(_rss_gb(), 3))  # fmt: skip
    base = _rss_gb()
    t = time.perf_counter()
    loader = _loader(store)
    if phase == "plan":
        per_epoch = loader.steps_per_epoch()
        it = iter(loader)
        real = sum(b.num_real_tokens for _ in range(20) for b in next(it).batches)
        peak = _rss_gb()
        return dict(out, steps_per_epoch=per_epoch, real_tokens_20_steps=real, seconds=round(time.perf_counter() - t, 1),
                    process_cpu_s=_cpu_s(), planning_bytes_per_doc=round((peak - base) * 2**30 / len(store), 2))  # fmt: skip
    it = iter(loader)
    next(it)  # the epoch's plan: not reading
    t = time.perf_counter()
    real = sum(b.num_real_tokens for _ in range(1000) for b in next(it).batches)
    return dict(out, tokens=real, tokens_per_s=round(real / (time.perf_counter() - t)))


def _written(d: Path) -> bool:
    return (d / "ours" / "COMPLETE").is_file() and Path(f"{d / 'megatron' / 'corpus'}.bin").is_file()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=10_000_000)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/densebatch-foreign-store"))
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    d = args.dir / f"docs-{args.docs}"
    if args.one == ["corpora", "write"]:
        write_store(d / "ours", args.docs)
        write_index(d / "megatron" / "corpus", args.docs)
        return 0
    if args.one:
        print(json.dumps(run_one(args.one[0], args.one[1], d)))
        return 0
    me = [sys.executable, "-m", __spec__.name, "--docs", str(args.docs), "--dir", str(args.dir), "--one"]
    if not _written(d):  # in a process of its own: a child's peak RSS (ru_maxrss) starts from its parent's at fork
        subprocess.run([*me, "corpora", "write"], check=True, cwd=REPO)
    shutil.rmtree(d / "cache", ignore_errors=True)  # the build is measured from an empty cache
    runs = [("megatron", "build")] + [("megatron", "startup"), ("ours", "startup")] * 3
    runs += [(w, p) for p in ("plan", "read") for w in ("ours", "megatron")]
    for which, phase in runs:
        print(
            subprocess.run([*me, which, phase], check=True, capture_output=True, text=True, cwd=REPO).stdout.strip(), flush=True
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

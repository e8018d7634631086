"""Reading speed in the training loop: the same documents as a Megatron corpus and as our own store, trained by ``densebatch train`` in turn.

The documents (random byte ids, each ending in the default tokenizer's end-of-text, 256) are written
twice: as a Megatron indexed dataset by megatron-core's own ``IndexedDatasetBuilder`` (uint16), and as
JSONL records of pre-tokenised ``input_ids`` that ``prepare`` stores as they are (no end-of-text added:
the last id is one), so both stores hold the same token ids and the same loss mask (every token a
target). Before timing, the first steps of both loaders are collated and compared tensor for tensor:
the plan and the batches are the same. Then each repeat trains a tiny model (1 layer, width 32, the
259 ids of the default tokenizer, CPU, fp32) for ``--steps`` steps of packed rows (8 rows of 1,024) on
each store in turn, the order alternating, each a fresh ``densebatch train`` process on the caches
already built. Tokens/s of a run: its real tokens over its steps' seconds (``metrics.jsonl``: data
wait, forward/backward and update; the first ``--warmup`` steps left out); the ratio is the Megatron
run's over the run beside it; medians over repeats. ``--prefetch 0`` reads each step's batches inside
the step (``batching.prefetch``; by default a thread reads 2 steps ahead): reading then weighs fully.

Lengths (``--lengths``): ``lognormal`` (``planning_memory``'s generator), ``oasst`` (the GPT-2 lengths
of ``../shared/data``'s oasst threads, drawn with replacement) or ``uniform`` (2 .. 1,024).

    .venv/bin/python -m benchmarks.scale.foreign_train --lengths lognormal --prefetch 0 --docs 50000   # needs densebatch[megatron]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

from benchmarks.common import REPO, shared_lengths

EOS = 256  # the default tokenizer's end-of-text (ids 0..255 are bytes)
MAX_LEN = 4096
SEQ_LEN, ROWS = 1024, 8


def draw_lengths(kind: str, n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "lognormal":
        x = rng.lognormal(5.8, 0.9, n)
    elif kind == "oasst":
        x = rng.choice(shared_lengths("oasst"), n)
    elif kind == "uniform":
        x = rng.integers(2, 1025, n)
    else:
        raise SystemExit(f"--lengths: lognormal, oasst or uniform; got {kind}")
    return np.clip(x, 2, MAX_LEN).astype(np.int64)


def write_corpora(d: Path, lengths: np.ndarray, seed: int = 0) -> None:
    """``d/megatron/corpus.{bin,idx}`` (megatron-core's builder) and ``d/records.jsonl``, the same documents."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(seed + 1)
    (d / "megatron").mkdir(parents=True)
    builder = IndexedDatasetBuilder(str(d / "megatron" / "corpus.bin"), dtype=np.uint16)
    with open(d / "records.jsonl", "w", encoding="utf-8") as f:
        for k in lengths.tolist():
            ids = np.append(rng.integers(0, EOS, k - 1), EOS)
            builder.add_item(torch.from_numpy(ids))
            builder.end_document()
            f.write(json.dumps({"input_ids": ids.tolist()}) + "\n")
    builder.finalize(str(d / "megatron" / "corpus.idx"))


def overrides(d: Path, which: str, steps: int, prefetch: int = 2) -> list[str]:
    path, fmt = (d / "megatron" / "corpus", "megatron") if which == "megatron" else (d / "records.jsonl", "jsonl")
    return [
        f"--data.path={path}", f"--data.format={fmt}", "--data.tokenizer=default", f"--data.cache_dir={d / 'cache'}",
        "--data.eval_fraction=0", f"--data.max_seq_len={MAX_LEN}", "--batching.strategy=packed",
        f"--batching.seq_len={SEQ_LEN}", f"--batching.max_tokens_per_batch={SEQ_LEN * ROWS}", f"--batching.rows_per_batch={ROWS}",
        f"--batching.prefetch={prefetch}",
        "--model.n_layer=1", "--model.n_head=1", "--model.n_embd=32", f"--model.block_size={SEQ_LEN}",
        f"--train.max_steps={steps}", "--train.loss_tokens_per_step=null", "--train.warmup_steps=0", "--train.device=cpu",
        "--train.progress=false", "--train.plots=false", "--train.health.enabled=false", "--eval.every_steps=0",
        "--checkpoint.every_steps=0", f"--output_dir={d / 'runs' / which}",
    ]  # fmt: skip


def same_batches(d: Path, steps: int) -> int:
    """Both stores prepared (cache entries built, untimed); the first ``steps`` steps of their loaders
    collated and compared: AssertionError unless every tensor is equal. Returns the documents."""
    from densebatch.data.load.collate import CausalCollator
    from densebatch.data.load.loader import StepLoader
    from densebatch.data.plan.planner import PlanSettings
    from densebatch.data.plan.steps import StepSettings
    from densebatch.data.prepare.pipeline import prepare
    from densebatch.run.configure import resolve_config

    stores = {}
    for which in ("megatron", "ours"):
        stores[which] = prepare(resolve_config(None, overrides(d, which, 1)).data).train
    assert len(stores["megatron"]) == len(stores["ours"]), {k: len(s) for k, s in stores.items()}
    settings = PlanSettings(strategy="packed", seq_len=SEQ_LEN, max_tokens_per_batch=SEQ_LEN * ROWS)
    its = [
        iter(StepLoader(s, settings=settings, collator=CausalCollator(pad_id=EOS), seed=0, steps=StepSettings(), prefetch=0))
        for s in stores.values()
    ]
    for _ in range(steps):
        a, b = (next(it).batches for it in its)
        for x, y in zip(a, b, strict=True):
            for name in ("input_ids", "labels", "positions"):
                assert (getattr(x, name) == getattr(y, name)).all(), name
    return len(stores["ours"])


def train_once(d: Path, which: str, *, steps: int, warmup: int, prefetch: int) -> dict:
    out = d / "runs" / which
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "densebatch", "train", *overrides(d, which, steps, prefetch)]
    subprocess.run(cmd, check=True, cwd=REPO, env=env, stdout=subprocess.DEVNULL)
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    recs = [r for r in recs if r.get("kind") == "train"][warmup:]
    seconds = sum(r["step_s"] for r in recs)
    return {
        "store": which, "steps": len(recs), "real_tokens": sum(r["real_tokens"] for r in recs),
        "tokens_per_s": round(sum(r["real_tokens"] for r in recs) / seconds),
        "data_wait_share": round(sum(r["data_wait_s"] for r in recs) / seconds, 4),
        "data_wait_ms_median": round(1000 * statistics.median(r["data_wait_s"] for r in recs), 3),
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="lognormal")
    ap.add_argument("--docs", type=int, default=50_000)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prefetch", type=int, default=2, help="batching.prefetch (0: reading inside the step)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/densebatch-foreign-train"))
    args = ap.parse_args()
    d = args.dir / f"{args.lengths}-{args.docs}"
    if not (d / "records.jsonl").is_file():
        shutil.rmtree(d, ignore_errors=True)
        lengths = draw_lengths(args.lengths, args.docs)
        write_corpora(d, lengths)
        print(json.dumps({"lengths": args.lengths, "docs": len(lengths), "tokens": int(lengths.sum()),
                          "mean": round(float(lengths.mean()), 1), "p50": int(np.median(lengths)), "max": int(lengths.max())}))  # fmt: skip
    print(json.dumps({"same_batches_steps": 20, "documents": same_batches(d, 20)}), flush=True)
    runs: dict[str, list[dict]] = {"megatron": [], "ours": []}
    for r in range(args.repeats):
        for which in ("megatron", "ours") if r % 2 == 0 else ("ours", "megatron"):
            runs[which].append(train_once(d, which, steps=args.steps, warmup=args.warmup, prefetch=args.prefetch))
            print(json.dumps(dict(runs[which][-1], repeat=r)), flush=True)
    ratios = [m["tokens_per_s"] / o["tokens_per_s"] for m, o in zip(runs["megatron"], runs["ours"])]
    print(json.dumps({
        "lengths": args.lengths, "prefetch": args.prefetch, "median_tokens_per_s": {k: statistics.median(x["tokens_per_s"] for x in v) for k, v in runs.items()},
        "ratios_megatron_over_ours": [round(x, 3) for x in ratios], "median_ratio": round(statistics.median(ratios), 3),
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

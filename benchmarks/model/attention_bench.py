"""Attention backends of the reference GPT, side by side: forward+backward time on packed rows.

One process, one model per width (4 layers, 4 heads, vocabulary 259, fp32, dropout 0, random init),
packed batches of rows x 1024 built from long-tailed document lengths (log-normal, median ~210,
p90 ~470, clipped to [8, 1000]; rows filled first-fit from a shuffled pool, the rest padding).
Backends: ``masked`` (boolean block-diagonal mask), ``segmented`` (length buckets + causal SDPA) and
``causal`` (plain ``is_causal``: leaks across documents, the speed reference). Each repeat runs every
backend once in a rotating order (so load from other processes does not favour one); the table shows
medians of the repeats, in seconds per forward+backward (token losses summed, as training does).

    .venv/bin/python -m benchmarks.model.attention_bench                      # the documented table
    .venv/bin/python -m benchmarks.model.attention_bench --widths 128 --rows 4 --repeats 3 --ratios 1.25,1.5
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

import densebatch.model.attention as attention
import densebatch.model.segmented as segmented
from densebatch.batch import IGNORE_INDEX, Batch
from densebatch.model import GPT, GPTConfig

VOCAB = 259
T = 1024


def document_lengths(n: int, rng: np.random.Generator) -> np.ndarray:
    """Long-tailed lengths: log-normal with median 210 and p90 ~470, clipped to [8, 1000]."""
    sigma = np.log(470 / 210) / 1.2816  # z of the 90th percentile
    return np.clip(np.round(rng.lognormal(np.log(210), sigma, n)), 8, 1000).astype(np.int64)


def packed_batch(num_rows: int, seed: int) -> Batch:
    """Rows of T tokens filled first-fit from a pool of documents; positions per ``batch.py``."""
    rng = np.random.default_rng(seed)
    pool = list(document_lengths(num_rows * 12, rng))
    ids = torch.randint(1, VOCAB, (num_rows, T), generator=torch.Generator().manual_seed(seed))
    labels = torch.full((num_rows, T), IGNORE_INDEX, dtype=torch.int64)
    pos = torch.zeros((num_rows, T), dtype=torch.int64)
    real = 0
    for r in range(num_rows):
        t, i = 0, 0
        while i < len(pool):
            n = int(pool[i])
            if t + n <= T:
                pos[r, t : t + n] = torch.arange(n)
                labels[r, t : t + n - 1] = ids[r, t + 1 : t + n]
                t += n
                pool.pop(i)
            else:
                i += 1
        pos[r, t:] = torch.arange(T - t)  # the padding run is one more segment
        ids[r, t:] = 0
        real += t
    return Batch(ids, labels, pos, int((labels != IGNORE_INDEX).sum()), real)


def step(model: GPT, batch: Batch, causal: bool) -> None:
    """Forward + backward as ``token_losses`` does it, with the causal path forced when asked."""
    h = model.hidden_states(batch.input_ids, positions=batch.positions, single_doc_rows=causal)  # (rows, T, C)
    keep = batch.labels != IGNORE_INDEX
    F.cross_entropy(model.lm_head(h[keep]).float(), batch.labels[keep], reduction="sum").backward()
    model.zero_grad(set_to_none=True)


def describe(batch: Batch) -> str:
    seg = attention.segment_plan(batch.positions)
    slots = int(seg.gather.numel())
    return (
        f"{batch.num_rows}x{T}: fill {batch.fill_rate:.2f}, {sum(n for n, _ in seg.buckets)} segments, "
        f"{len(seg.buckets)} buckets, bucket padding {1 - batch.num_slots / slots:.1%} of slots"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", default="128,256")
    ap.add_argument("--rows", default="4,8")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--ratios", default="", help="also time segmented with these BUCKET_RATIO values")
    ap.add_argument("--backends", default="masked,segmented,causal")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, 4 layers, 4 heads, vocab {VOCAB}")
    variants = [(b, None) for b in args.backends.split(",")]
    variants += [("segmented", float(r)) for r in args.ratios.split(",") if r]
    name = lambda b, r: b if r is None else f"seg@{r:g}"  # noqa: E731
    header = "| width | batch | " + " | ".join(name(b, r) for b, r in variants) + " | masked / segmented |"
    table = [header, "|" + "---|" * (header.count("|") - 1)]
    default_ratio = segmented.BUCKET_RATIO
    for width in (int(w) for w in args.widths.split(",")):
        cfg = GPTConfig(vocab_size=VOCAB, n_layer=4, n_head=4, n_embd=width, block_size=T)
        model = GPT(cfg).train()
        for rows in (int(r) for r in args.rows.split(",")):
            batch = packed_batch(rows, seed=rows)
            print(describe(batch))
            times: dict[int, list[float]] = {i: [] for i in range(len(variants))}
            for rep in range(args.warmup + args.repeats):
                shift = rep % len(variants)
                for i in list(range(len(variants)))[shift:] + list(range(len(variants)))[:shift]:
                    backend, ratio = variants[i]
                    model.cfg.attention = "masked" if backend == "causal" else backend
                    segmented.BUCKET_RATIO = ratio or default_ratio
                    t0 = time.perf_counter()
                    step(model, batch, causal=backend == "causal")
                    if rep >= args.warmup:
                        times[i].append(time.perf_counter() - t0)
            med = [statistics.median(times[i]) for i in range(len(variants))]
            cells = [f"{m:.3f}" for m in med]
            names = [name(b, r) for b, r in variants]
            ratio = (
                f"{med[names.index('masked')] / med[names.index('segmented')]:.2f}x"
                if {"masked", "segmented"} <= set(names)
                else "-"
            )
            table.append(f"| {width} | {rows}x{T} | " + " | ".join(cells) + f" | {ratio} |")
            print(table[-1], flush=True)
    segmented.BUCKET_RATIO = default_ratio
    print(f"\nseconds per forward+backward, median of {args.repeats} (after {args.warmup} warm-up)\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()

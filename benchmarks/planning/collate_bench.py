"""Collate time per batch: densebatch's CausalCollator beside Hugging Face's collators and the book's.

    .venv/bin/python -m benchmarks.planning.collate_bench [--docs 8] [--repeats 300]

The same 8 oasst-threads documents (GPT-2 tokens, ~3,800 tokens) for every collator; median of
``--repeats`` calls, one thread. Each collator gets its natural input: ours reads the flat token
array of a store (what the loader hands it), Hugging Face's and the book's get lists of ids.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch

from benchmarks.common import shared_data_dir, texts
from densebatch.data.load.collate import CausalCollator
from densebatch.data.plan.planner import PlanSettings, plan_epoch
from densebatch.data.store.store import DocumentStore
from densebatch.testing.book import book_collate, gpt2_tokenizer

EOS = 50256


def median_ms(fn, repeats: int) -> float:
    for _ in range(5):
        fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=300)
    a = ap.parse_args()
    torch.set_num_threads(1)
    shared = shared_data_dir()
    if shared is None:
        sys.exit("../shared/data is absent")
    docs = [e.ids + [EOS] for e in gpt2_tokenizer(shared / "gpt2").encode_batch(texts("oasst", shared))]
    store = DocumentStore.from_documents((d, [1] * len(d)) for d in docs)
    pick = np.random.default_rng(0).choice(len(docs), a.docs, replace=False).tolist()
    items = [docs[i] for i in pick]
    print(f"{a.docs} documents, {sum(map(len, items))} tokens (longest {max(map(len, items))}); median ms per batch\n")
    results = {}
    ours = CausalCollator(pad_id=EOS)
    rows = [[(i, 0, len(docs[i]))] for i in pick]
    results["densebatch CausalCollator (padded rows)"] = median_ms(lambda: ours(store, rows), a.repeats)
    packed = plan_epoch(
        store.lengths[pick], settings=PlanSettings(strategy="packed", seq_len=4096, max_tokens_per_batch=1 << 20), seed=0, epoch=0
    )
    prow = [[(pick[d], s, e) for d, s, e in row] for row in packed.batch(0)]
    results[f"densebatch CausalCollator (packed, {len(prow)} row)"] = median_ms(lambda: ours(store, prow), a.repeats)
    results["book custom_collate_fn"] = median_ms(lambda: book_collate([d[:-1] for d in items]), a.repeats)
    try:
        from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening, PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast(
            tokenizer_object=gpt2_tokenizer(shared / "gpt2")._tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
        )
        s2s = DataCollatorForSeq2Seq(tok, padding=True, label_pad_token_id=-100, return_tensors="pt")
        feats = lambda: [{"input_ids": list(d), "labels": list(d)} for d in items]
        f = feats()
        results["HF DataCollatorForSeq2Seq"] = median_ms(lambda: s2s([dict(x) for x in f]), a.repeats)
        flat = DataCollatorWithFlattening(return_tensors="pt")
        results["HF DataCollatorWithFlattening"] = median_ms(lambda: flat([dict(x) for x in f]), a.repeats)
    except ImportError as e:
        print(f"(transformers collators skipped: {e})")
    base = results["densebatch CausalCollator (padded rows)"]
    print("| collator | ms / batch | × densebatch (padded) |")
    print("|---|---|---|")
    for k, v in results.items():
        print(f"| {k} | {v:.3f} | {v / base:.1f} |")


if __name__ == "__main__":
    main()

"""Length sets for the full-loss throughput benchmark, written as pre-tokenised JSONL records.

Every record is ``{"input_ids": [...]}`` with no ``labels``: every token carries loss (continued
pre-training, or ``loss_on: all``). Documents are cut at ``MAX_LEN`` tokens (the model's context).

- ``tune``: the set the speed work was tuned on, shaped like issue 10's code-instruction set
  (2,017 documents, lognormal lengths, mean ~139, long tail); random token ids.
- held out (never tuned on): ``instruction`` (instruction-data.json, Alpaca template, whole text),
  ``oasst`` (oasst-threads.jsonl rendered chatml-style), ``shakespeare`` (tinyshakespeare.txt split
  on blank lines), ``lognormal`` (median 300, sigma 1) and ``pareto`` (alpha 1.5 from 50 tokens: the
  heaviest tail), GPT-2 ids for the shared sets (``../shared/data``), random ids for the synthetic
  ones. HF group_by_length batches of 8 fill 0.88 (shakespeare) to 0.99 (instruction) of their slots
  over a whole epoch (pareto 0.94; docs/benchmarks.md lists every set).

    .venv/bin/python -m benchmarks.throughput.fullloss_sets     # summary of every set
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from benchmarks.common import shared_data_dir, texts
from densebatch.testing.book import gpt2_tokenizer

MAX_LEN = 1024
EOS = 50256
SETS = ("tune", "instruction", "oasst", "shakespeare", "lognormal", "pareto")
HELD_OUT = SETS[1:]
SYNTHETIC = {  # name -> (documents, sampler of lengths)
    "tune": (2017, lambda g, n: g.lognormal(np.log(135), 0.8, n)),
    "lognormal": (2000, lambda g, n: g.lognormal(np.log(300), 1.0, n)),
    "pareto": (2000, lambda g, n: 50 * (1 + g.pareto(1.5, n))),
}


def documents(name: str, seed: int = 0) -> list[np.ndarray]:
    """Token ids of every document of ``name`` (end-of-text last, at most MAX_LEN tokens)."""
    if name in SYNTHETIC:
        n, sample = SYNTHETIC[name]
        g = np.random.default_rng(seed)
        lengths = np.clip(sample(g, n).round().astype(np.int64), 8, MAX_LEN)
        return [np.append(g.integers(0, EOS, k - 1), EOS) for k in lengths]
    shared = shared_data_dir()
    if shared is None:
        raise FileNotFoundError("../shared/data is absent (set DENSEBATCH_SHARED)")
    enc = gpt2_tokenizer(shared / "gpt2").encode_batch(texts(name, shared))
    return [np.asarray(e.ids[: MAX_LEN - 1] + [EOS], np.int64) for e in enc]


def write_set(name: str, path: Path, seed: int = 0) -> Path:
    """Write ``name`` as JSONL records ``{"input_ids": [...]}`` to ``path``."""
    with open(path, "w", encoding="utf-8") as f:
        for ids in documents(name, seed):
            f.write(json.dumps({"input_ids": ids.tolist()}) + "\n")
    return path


if __name__ == "__main__":
    for name in SETS:
        lengths = np.array([len(d) for d in documents(name)])
        print(
            f"{name:12s} docs={len(lengths):5d} mean={lengths.mean():6.1f} p50={np.percentile(lengths, 50):5.0f} "
            f"p90={np.percentile(lengths, 90):5.0f} max={lengths.max():5d} tokens/step (8 x mean)={8 * lengths.mean():6.0f}"
        )

"""The GPU benchmark's workload: oasst-threads lengths (GPT-2 BPE, or a lognormal fit) and random-token documents."""

from __future__ import annotations

import math

import numpy as np

from benchmarks.common import gpt2_lengths, shared_data_dir

OASST_FIT = {"p50": 317, "p90": 807, "max": 3031}


def oasst_lengths(arg: str | None) -> tuple[np.ndarray, str]:
    """GPT-2 BPE lengths of oasst-threads.jsonl (chatml + end-of-text), or the lognormal fallback."""
    shared = shared_data_dir(arg)
    if shared is not None:
        try:
            return gpt2_lengths("oasst", shared), f"oasst-threads.jsonl with the GPT-2 BPE ({shared})"
        except Exception as e:  # tokenizers missing or data unreadable: fall back, say why
            print(f"note: could not tokenize {shared} ({type(e).__name__}: {e}); using the lognormal fit", flush=True)
    mu = math.log(OASST_FIT["p50"])
    sigma = (math.log(OASST_FIT["p90"]) - mu) / 1.2815515655446004  # z of the 90th percentile
    rng = np.random.default_rng(0)
    lengths = np.clip(np.rint(rng.lognormal(mu, sigma, 400)), 8, OASST_FIT["max"]).astype(np.int64)
    return lengths, f"lognormal fit (p50 {OASST_FIT['p50']}, p90 {OASST_FIT['p90']}, max {OASST_FIT['max']}), 400 documents"


def make_documents(lengths: np.ndarray, seq_len: int, vocab: int, total_tokens: int, seed: int):
    """Resampled lengths (truncated to seq_len) and random token ids with an end-of-text at the end."""
    rng = np.random.default_rng(seed)
    base = np.minimum(lengths, seq_len)
    n = max(len(base), int(math.ceil(total_tokens / base.mean())))
    lens = rng.choice(base, size=n, replace=True)
    tokens = rng.integers(0, vocab - 1, size=int(lens.sum()), dtype=np.int64).astype(np.int32)
    ends = np.cumsum(lens) - 1
    tokens[ends] = vocab - 1  # end-of-text = the last id, as GPT-2's 50256
    return lens, tokens


def long_lengths(seq_len: int, n: int = 400, seed: int = 0) -> tuple[np.ndarray, str]:
    """The long-document set of the long context: lengths log-uniform between seq_len / 32 and seq_len (8k
    context: 256 to 8,192 tokens), so a row holds documents up to the whole context, not only oasst's ~3k."""
    rng = np.random.default_rng(seed)
    low = max(8, seq_len // 32)
    lengths = np.rint(np.exp(rng.uniform(math.log(low), math.log(seq_len), n))).astype(np.int64)
    return lengths, f"long documents: log-uniform {low}..{seq_len} tokens (median {int(np.median(lengths))}), {n} documents"

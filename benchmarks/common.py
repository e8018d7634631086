"""What several benchmark groups share: where ../shared/data is, its sets as texts and GPT-2 lengths, the GPT-2 config.

Lengths count one appended end-of-text per document, as prepare stores documents, and are cached as
``benchmarks/.cache/<name>.npy`` (git-ignored; the planning benchmarks write their synthetic lengths
there too).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

from densebatch.testing.book import alpaca_text, gpt2_tokenizer

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / "benchmarks" / ".cache"
SHARED_SETS = ("instruction", "oasst", "shakespeare")


def shared_data_dir(arg: str | None = None) -> Path | None:
    """``arg``, else $DENSEBATCH_SHARED/data (or $DENSEBATCH_SHARED), else ../shared/data beside the
    checkout or ./shared/data inside it: the first that holds gpt2/vocab.json; None when none does."""
    env = os.environ.get("DENSEBATCH_SHARED")
    cands = ([Path(arg)] if arg else []) + ([Path(env) / "data", Path(env)] if env else [])
    for cand in [*cands, REPO.parent / "shared" / "data", REPO / "shared" / "data"]:
        if (cand / "gpt2" / "vocab.json").is_file():
            return cand
    return None


def require_shared_data(arg: str | None = None) -> Path:
    """``shared_data_dir(arg)``, or exit saying how to point at it."""
    found = shared_data_dir(arg)
    if found is None:
        sys.exit("shared data not found: pass --data-dir DIR or set DENSEBATCH_SHARED (a folder with gpt2/vocab.json, ...)")
    return found


def chatml_text(rec: dict) -> str:
    """An oasst thread rendered chatml-style, ``<|im_start|>role\\ncontent<|im_end|>\\n`` per message."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in rec["messages"])


def texts(name: str, shared: Path) -> list[str]:
    """The documents of one shared set as text: instruction (Alpaca template), oasst (chatml) or
    shakespeare (split on blank lines)."""
    if name == "instruction":
        return [alpaca_text(r) for r in json.loads((shared / "instruction-data.json").read_text(encoding="utf-8"))]
    if name == "oasst":
        lines = (shared / "oasst-threads.jsonl").read_text(encoding="utf-8").splitlines()
        return [chatml_text(json.loads(line)) for line in lines if line.strip()]
    if name == "shakespeare":
        raw = (shared / "tinyshakespeare.txt").read_text(encoding="utf-8")
        return [p for p in raw.split("\n\n") if p.strip()]
    raise ValueError(f"unknown shared set {name!r}; expected one of {', '.join(SHARED_SETS)}")


def gpt2_lengths(name: str, shared: Path) -> np.ndarray:
    """int64 GPT-2 lengths (end-of-text included) of one shared set, computed (not cached)."""
    tok = gpt2_tokenizer(shared / "gpt2")
    return np.array([len(e.ids) + 1 for e in tok.encode_batch(texts(name, shared))], dtype=np.int64)


def shared_lengths(name: str) -> np.ndarray:
    """``gpt2_lengths`` of one shared set, cached in ``CACHE``; FileNotFoundError when ../shared/data is absent."""
    path = CACHE / f"{name}.npy"
    if path.is_file():
        return np.load(path)
    shared = shared_data_dir()
    if shared is None:
        raise FileNotFoundError("../shared/data is absent (set DENSEBATCH_SHARED)")
    lengths = gpt2_lengths(name, shared)
    CACHE.mkdir(exist_ok=True)
    np.save(path, lengths)
    return lengths


def write_gpt2_config(path: Path, n_positions: int, vocab_size: int = 50257) -> None:
    """The Hugging Face GPT-2 config of the CPU benchmarks (4 layers, width 256, 4 heads, dropout 0;
    GPT-2's 50,257 ids unless ``vocab_size`` says more) as ``path/config.json``: no weights, so a model
    built from it is random."""
    from transformers import GPT2Config

    cfg = GPT2Config(
        vocab_size=vocab_size,
        n_positions=n_positions,
        n_embd=256,
        n_layer=4,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=50256,
        eos_token_id=50256,
    )
    cfg.save_pretrained(path)

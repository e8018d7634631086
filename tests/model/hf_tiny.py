"""Tiny random Hugging Face configurations, one per architecture densebatch supports or refuses.

Shared by tests/model/test_hf_architectures.py and benchmarks/hf_isolation_table.py. Each config is
small enough to build and run in milliseconds (1-2 layers, width 32, vocabulary ``VOCAB``); where an
architecture has a sliding window it is set to ``WINDOW`` tokens, shorter than the documents, so
that a mask which forgot the window shows up as a difference. ``packed_vs_alone`` is the measure
both report: each packed document against itself alone, through the adapter's own paths.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 100
WIDTH = 32
WINDOW = 6  # sliding-window attention span, shorter than the longer test documents
# Rows of documents (lengths) packed for the comparison: several longer than WINDOW, so a forgotten window shows.
LENGTHS = [[9, 14, 5], [20], [3, 11, 1, 7]]
SEQ_LEN = 32
# (model_type, attn_implementation): what the isolation table and test cover.
ARCHITECTURES = [
    ("gpt2", "sdpa"),
    ("llama", "sdpa"),
    ("qwen2", "sdpa"),
    ("qwen3", "sdpa"),
    ("mistral", "sdpa"),
    ("gemma", "sdpa"),
    ("gemma2", "eager"),
    ("phi3", "sdpa"),
    ("gpt_neox", "sdpa"),
    ("olmo", "sdpa"),
    ("stablelm", "sdpa"),
    ("starcoder2", "sdpa"),
    ("opt", "sdpa"),
    ("gpt_bigcode", "sdpa"),
    ("falcon", "sdpa"),
    ("bloom", "sdpa"),
]


def tiny_config(model_type: str, **overrides):
    """A ``transformers`` config of ``model_type``: 1 layer (2 where layers differ), width ``WIDTH``."""
    import transformers

    ids = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    rotary = dict(
        num_hidden_layers=1,
        hidden_size=WIDTH,
        intermediate_size=2 * WIDTH,
        num_attention_heads=4,
        max_position_embeddings=64,
        **ids,
    )
    kv = dict(num_key_value_heads=2)
    make = {
        "gpt2": lambda: transformers.GPT2Config(n_layer=1, n_embd=WIDTH, n_head=4, n_positions=64, **ids),
        "llama": lambda: transformers.LlamaConfig(**rotary, **kv),
        # one full-attention and one sliding layer (max_window_layers: the first layers are full)
        "qwen2": lambda: transformers.Qwen2Config(
            **(rotary | {"num_hidden_layers": 2}), **kv, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
        ),
        "qwen3": lambda: transformers.Qwen3Config(**rotary, **kv, head_dim=8),
        "mistral": lambda: transformers.MistralConfig(**rotary, **kv, sliding_window=WINDOW),
        "gemma": lambda: transformers.GemmaConfig(**rotary, **kv, head_dim=8),
        # layer 0 sliding, layer 1 global; attention and final logits soft-capped (eager only)
        "gemma2": lambda: transformers.Gemma2Config(
            **(rotary | {"num_hidden_layers": 2}), **kv, head_dim=8, sliding_window=WINDOW, query_pre_attn_scalar=8
        ),
        "phi3": lambda: transformers.Phi3Config(**rotary, **kv, sliding_window=WINDOW),
        "gpt_neox": lambda: transformers.GPTNeoXConfig(**rotary),
        "olmo": lambda: transformers.OlmoConfig(**rotary),
        "stablelm": lambda: transformers.StableLmConfig(**rotary, **kv),
        "starcoder2": lambda: transformers.Starcoder2Config(**rotary, **kv, sliding_window=WINDOW),
        "opt": lambda: transformers.OPTConfig(
            num_hidden_layers=1, hidden_size=WIDTH, ffn_dim=2 * WIDTH, num_attention_heads=4, max_position_embeddings=64, **ids
        ),
        "gpt_bigcode": lambda: transformers.GPTBigCodeConfig(n_layer=1, n_embd=WIDTH, n_head=4, n_positions=64, **ids),
        "falcon": lambda: transformers.FalconConfig(
            num_hidden_layers=1, hidden_size=WIDTH, num_attention_heads=4, max_position_embeddings=64, **ids
        ),
        "bloom": lambda: transformers.BloomConfig(n_layer=1, hidden_size=WIDTH, n_head=4, **ids),
    }
    config = make[model_type]()
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def write_config_dir(root: Path, model_type: str, **overrides) -> Path:
    """``root/model_type/config.json`` (no weights: the adapter initialises them at random)."""
    out = Path(root) / model_type
    tiny_config(model_type, **overrides).save_pretrained(out)
    return out


def packed_vs_alone(model, docs_by_row: list[list[list[int]]], pack) -> tuple[float, float]:
    """(max |loss difference|, max |logit difference|) between each document packed in its row (the
    4-D document mask) and the same document alone in a row (no mask: the model's causal attention).
    ``pack``: tests/model/conftest.py's (passed in: a bare ``import conftest`` here could find another
    directory's conftest once the whole suite is collected)."""
    packed = pack(docs_by_row, seq_len=SEQ_LEN)
    worst_loss = worst_logit = 0.0
    with torch.no_grad():
        losses = model.token_losses(packed)  # (rows, T)
        logits = model(packed.input_ids, packed.positions)  # (rows, T, vocab)
        for r, docs in enumerate(docs_by_row):
            t = 0
            for d in docs:
                alone = pack([[d]])
                worst_loss = max(worst_loss, (losses[r, t : t + len(d)] - model.token_losses(alone)[0]).abs().max().item())
                alone_logits = model(alone.input_ids, alone.positions, single_doc_rows=True)[0]  # (len(d), vocab)
                worst_logit = max(worst_logit, (logits[r, t : t + len(d)] - alone_logits).abs().max().item())
                t += len(d)
    return worst_loss, worst_logit

"""Tiny models for tests and benchmarks: a reference GPT, and random Hugging Face configurations.

- ``tiny_gpt``: the reference GPT the model tests run (2 layers, width 32, 4 heads, 64 positions).
- ``two_layer_config``: the Hugging Face models of the adapter's own tests (GPT-2 and four Llama-family
  models, 2 layers, width 32, untied heads), also measured by benchmarks/model/hf_bf16_tolerance.py
  for the bound one of those tests uses.
- ``tiny_config`` / ``write_config_dir``: one configuration per architecture densebatch supports or
  refuses (``ARCHITECTURES``: the table of docs/hf-models.md, checked by
  tests/model/hf/test_hf_architectures.py and printed by benchmarks/model/hf_isolation_table.py), small
  enough to build and run in milliseconds (1-2 layers, width ``WIDTH``, vocabulary ``VOCAB``); where an
  architecture has a sliding window it is ``WINDOW`` tokens, shorter than the documents of ``LENGTHS``,
  so that a mask which forgot the window shows up as a difference.
- ``packed_vs_alone``: the measure both report, each packed document against itself alone, through
  the adapter's own paths.

transformers is imported only by the functions that build its configurations.
"""

from __future__ import annotations

from pathlib import Path

import torch

from densebatch.model import GPT, GPTConfig
from densebatch.testing.batches import pack


def tiny_gpt(vocab_size: int, **config) -> GPT:
    """The reference GPT at 2 layers x width 32 (4 heads, 64 positions), weights drawn from seed 0
    (the global RNG, as ``torch.manual_seed(0)``); ``config``: further ``GPTConfig`` fields."""
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=vocab_size, n_layer=2, n_head=4, n_embd=32, block_size=64, **config))


# ------------------------------------------------------------------ the adapter's two-layer models
TWO_LAYER_VOCAB = 300


def two_layer_config(kind: str, vocab_size: int = TWO_LAYER_VOCAB):
    """A ``transformers`` config of ``kind`` (gpt2, llama, mistral, qwen2 or qwen3): 2 layers, width 32,
    4 heads (2 key-value heads and an untied head for the Llama family), 64 positions."""
    import transformers

    common = dict(vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kind == "gpt2":
        return transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, **common)
    llama_like = dict(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **common,
    )
    cls = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}[kind]
    if kind == "qwen3":
        llama_like["head_dim"] = 8
    return getattr(transformers, cls)(tie_word_embeddings=False, **llama_like)


# ------------------------------------------------------------------ one configuration per architecture
VOCAB = 100
WIDTH = 32
WINDOW = 6  # sliding-window attention span, shorter than the longer documents of LENGTHS
# Rows of documents (lengths) packed for the comparison: several longer than WINDOW, so a forgotten window shows.
LENGTHS = [[9, 14, 5], [20], [3, 11, 1, 7]]
SEQ_LEN = 32
# (model_type, transformers' own attn_implementation for it): what the isolation table and test cover,
# each also under attn_implementation densebatch (Falcon < 5.25 through its own table: model/hf/falcon.py).
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
    """A ``transformers`` config of ``model_type``: 1 layer (2 where layers differ), width ``WIDTH``;
    ``overrides`` are set on it afterwards."""
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


def packed_vs_alone(model, docs_by_row: list[list[list[int]]], reference=None) -> tuple[float, float]:
    """(max |loss difference|, max |logit difference|) between each document packed in its row (the
    model's document attention) and the same document alone in a row through ``reference`` (the same
    weights under another attention implementation, e.g. transformers' own kernel; default: ``model``
    itself, plain causal attention over one document)."""
    reference = model if reference is None else reference
    packed = pack(docs_by_row, seq_len=SEQ_LEN)
    worst_loss = worst_logit = 0.0
    with torch.no_grad():
        losses = model.token_losses(packed)  # (rows, T)
        logits = model(packed.input_ids, packed.positions)  # (rows, T, vocab)
        for r, docs in enumerate(docs_by_row):
            t = 0
            for d in docs:
                alone = pack([[d]])
                worst_loss = max(worst_loss, (losses[r, t : t + len(d)] - reference.token_losses(alone)[0]).abs().max().item())
                alone_logits = reference(alone.input_ids, alone.positions, single_doc_rows=True)[0]  # (len(d), vocab)
                worst_logit = max(worst_logit, (logits[r, t : t + len(d)] - alone_logits).abs().max().item())
                t += len(d)
    return worst_loss, worst_logit


# ------------------------------------------------------------------ encoder masked LMs (batching.mode mlm)
ENCODERS = ("bert", "roberta", "xlm-roberta", "camembert", "distilbert", "modernbert")


def encoder_config(kind: str, vocab_size: int = TWO_LAYER_VOCAB):
    """A ``transformers`` encoder config of ``kind`` (``ENCODERS``): 2 layers, width 32, 4 heads, 64
    positions, padding id 0; ModernBERT alternates global and local (sliding window 8) attention."""
    import transformers

    if kind == "distilbert":
        return transformers.DistilBertConfig(
            vocab_size=vocab_size, n_layers=2, dim=32, n_heads=4, hidden_dim=64, max_position_embeddings=64, pad_token_id=0
        )
    if kind == "modernbert":
        return transformers.ModernBertConfig(
            vocab_size=vocab_size, num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
            max_position_embeddings=64, local_attention=8, global_attn_every_n_layers=2, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
        )  # fmt: skip
    cls = {"bert": transformers.BertConfig, "roberta": transformers.RobertaConfig, "xlm-roberta": transformers.XLMRobertaConfig,
           "camembert": transformers.CamembertConfig}[kind]  # fmt: skip
    return cls(
        vocab_size=vocab_size, num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        max_position_embeddings=66, pad_token_id=0,
    )  # fmt: skip


def save_encoder(kind: str, path, vocab_size: int = TWO_LAYER_VOCAB, seed: int = 0) -> None:
    """A randomly initialised ``...ForMaskedLM`` of ``encoder_config(kind)`` saved to ``path`` (weights and
    config, whose ``architectures`` name the class)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    transformers.AutoModelForMaskedLM.from_config(encoder_config(kind, vocab_size)).save_pretrained(path)

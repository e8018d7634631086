"""Models that map a Batch to per-token losses, with attention that never crosses documents.

Public API: ``build_model(cfg, vocab_size, base_vocab_size)``, ``load_model(dir)``, ``save_model(model, dir)``,
``load_adapter(dir, cfg, vocab_size)`` (a LoRA run's final model), ``generate(model, prompt_ids, ...)``,
``generate_batch(model, prompts, ...)``, and the classes ``GPT`` / ``GPTConfig`` (reference decoder)
and ``HFCausalLM`` (Hugging Face adapter; it imports transformers only when it loads a model, so that
transformers is needed only for ``model.kind: hf``, and peft only for ``model.lora``).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch.nn as nn

from densebatch.config import ModelConfig
from densebatch.errors import ConfigError
from densebatch.model.attention import resolve_backend
from densebatch.model.generate import generate, generate_batch
from densebatch.model.gpt import GPT, GPTConfig, SelfAttention
from densebatch.model.hf.adapter import HFCausalLM
from densebatch.model.hf.checks import attention_heads as hf_attention_heads
from densebatch.model.hf.checks import read_hf_config
from densebatch.model.hf.lora import apply_lora, load_adapter
from densebatch.model.io import load_model, save_model

__all__ = [
    "GPT", "GPTConfig", "HFCausalLM", "build_model", "generate", "generate_batch", "load_adapter", "load_model", "save_model",
]  # fmt: skip


def check_hf_attention(cfg: ModelConfig) -> None:
    """model.attention picks densebatch's kernel, which only ``attn_implementation: densebatch`` runs;
    under sdpa / eager transformers' own kernel takes a 4-D document mask (auto or masked)."""
    if cfg.attn_implementation == "densebatch":
        resolve_backend(cfg.attention, "cpu", training=False)
    elif cfg.attention not in ("auto", "masked"):
        raise ConfigError(
            f"model.attention: {cfg.attention!r} applies to model.attn_implementation densebatch; under "
            f"{cfg.attn_implementation} transformers' kernel takes a 4-D document mask (use auto or masked)"
        )


def saved_gpt(cfg: ModelConfig, vocab_size: int, label_smoothing: float = 0.0) -> GPT:
    """The reference GPT saved in ``cfg.path`` (``GPT.save``: a run's ``final/``) to train on from its weights: its
    shape is the saved one (a ``model.`` shape key that differs is a ``ConfigError`` naming both), the
    run's own settings (attention, dropout, checkpointing) apply."""
    model = load_model(cfg.path)
    if not isinstance(model, GPT):
        raise ConfigError(f"model.path: {cfg.path} holds a Hugging Face model: set model.kind: hf to train it")
    saved = model.cfg
    for key in ("n_layer", "n_head", "n_embd", "block_size"):
        if getattr(cfg, key) != getattr(saved, key):
            raise ConfigError(
                f"model.{key}: {getattr(cfg, key)}, but the GPT at {cfg.path} has {getattr(saved, key)}: set it to "
                f"{getattr(saved, key)}"
            )
    if saved.vocab_size < vocab_size:
        raise ConfigError(
            f"data.tokenizer: {vocab_size} ids, but the GPT at {cfg.path} has {saved.vocab_size}: use the tokenizer it "
            f"was trained with (data.tokenizer: {cfg.path})"
        )
    model.cfg.attention, model.cfg.dropout = cfg.attention, cfg.dropout
    model.cfg.gradient_checkpointing = cfg.gradient_checkpointing
    model.label_smoothing = label_smoothing
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = cfg.dropout
        elif isinstance(m, SelfAttention):
            m.dropout = cfg.dropout
    return model


def attention_heads(cfg: ModelConfig) -> tuple[int, int]:
    """(query heads, key/value heads) of the model ``cfg`` describes, from its configuration alone (a Hugging
    Face model's config.json), before anything is built: what splitting heads over context ranks needs."""
    if cfg.kind == "hf":
        return hf_attention_heads(read_hf_config(Path(cfg.path)))
    return cfg.n_head, cfg.n_head


def build_model(
    cfg: ModelConfig,
    vocab_size: int,
    base_vocab_size: int | None = None,
    *,
    empty_weights: bool = False,
    after_load: contextlib.AbstractContextManager | None = None,
    task: str = "causal",
    label_smoothing: float = 0.0,
) -> nn.Module:
    """The model ``cfg`` describes, for a tokenizer of ``vocab_size`` ids (random init for gpt).

    ``base_vocab_size``: the tokenizer's size before the tokens densebatch added (``tok.base_vocab_size``);
    a Hugging Face model gives those new ids rows set to the mean of the rows it had
    (``HFCausalLM.resize_vocab``), and under LoRA trains them. None: only rows past the model's own
    table are new. The reference GPT is built for the whole vocabulary at random, so it needs none.
    ``empty_weights`` (Hugging Face): parameters on the meta device, to be read from the weight files
    shard by shard (``model/hf/weights.py``); ``after_load`` is entered around what follows the load
    (the vocabulary grown, LoRA adapters added), for ``train/meta_init.recording``. ``task``:
    ``batching.mode`` (``mlm``: a Hugging Face encoder masked LM; the reference GPT is causal only).
    ``label_smoothing``: ``train.label_smoothing``, which the model's training passes apply.
    """
    if cfg.kind == "gpt":
        resolve_backend(cfg.attention, "cpu", training=False)  # a ModelConfig built by hand: name check
        if cfg.path:  # a saved reference GPT (a run's final/, e.g. an SFT run before dpo): its weights
            return saved_gpt(cfg, vocab_size, label_smoothing)
        vocab = cfg.vocab_size or vocab_size
        if vocab < vocab_size:
            raise ConfigError(f"model.vocab_size: expected at least the tokenizer's {vocab_size} ids; got {vocab}")
        return GPT(
            GPTConfig(
                vocab_size=vocab,
                n_layer=cfg.n_layer,
                n_head=cfg.n_head,
                n_embd=cfg.n_embd,
                block_size=cfg.block_size,
                dropout=cfg.dropout,
                attention=cfg.attention,
                gradient_checkpointing=cfg.gradient_checkpointing,
            ),
            label_smoothing=label_smoothing,
        )
    if cfg.kind == "hf":
        if not cfg.path:
            raise ConfigError("model.path: required when model.kind is hf (a local directory with config.json)")
        check_hf_attention(cfg)
        model = HFCausalLM(
            cfg.path,
            attn_implementation=cfg.attn_implementation,
            attention=cfg.attention,
            gradient_checkpointing=cfg.gradient_checkpointing,
            dtype=cfg.dtype,
            empty_weights=empty_weights,
            task=task,
            label_smoothing=label_smoothing,
        )
        known = base_vocab_size or 0
        if known > model.vocab_size:  # ids the model has never seen would get rows of nothing it learned
            raise ConfigError(
                f"data.tokenizer: the tokenizer has {known} ids but the model at {cfg.path} has {model.vocab_size} "
                f"embedding rows, so ids {model.vocab_size}..{known - 1} mean nothing to it; use the model's own tokenizer "
                "(data.tokenizer: auto); tokens of your own go in data.add_tokens, which grows the model for them"
            )
        with after_load or contextlib.nullcontext():
            new_ids = model.resize_vocab(vocab_size, base_vocab_size)
            if cfg.lora.r:
                apply_lora(model, cfg.lora, new_ids)
        return model
    raise ConfigError(f"model.kind: expected gpt or hf; got {cfg.kind!r}")

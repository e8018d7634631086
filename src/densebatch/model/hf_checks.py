"""What the Hugging Face adapter checks before it builds a model: that the directory holds a decoder-only
causal LM, that the architecture can keep packed documents apart under the chosen attention, and which
sliding window each layer type has (``model/hf.py`` draws it into a mask or passes it to the kernel)."""

from __future__ import annotations

import json
from pathlib import Path

from densebatch.errors import ConfigError
from densebatch.model.hf_attention import NAME as DENSEBATCH

# Architectures that cannot keep packed documents apart, and why (refused when built).
_ALIBI = (
    "uses ALiBi position biases, which it derives from a 2-D padding mask and not from position_ids, and accepts "
    "no 4-D document mask: packed documents cannot be isolated"
)
REFUSED = {"bloom": _ALIBI, "mpt": _ALIBI}
# Architectures whose attention classes are chosen by their own table of eager / sdpa / flash, so that
# transformers' attention interface (and densebatch's kernel through it) never reaches them.
_OWN_ATTENTION_CLASSES = {"falcon"}


def layer_windows(config) -> dict[str, int | None]:
    """Layer type -> sliding window (None: full causal attention), the types of the model's layers.

    ``config.layer_types`` names each layer's type when they differ (Gemma 2, Qwen2 with
    ``use_sliding_window``); without it a ``sliding_window`` applies to every layer (Mistral, Phi-3,
    Starcoder2). Only these two types are known; another (e.g. chunked attention) is refused.
    """
    window = getattr(config, "sliding_window", None) or None
    types = set(getattr(config, "layer_types", None) or ())
    unknown = types - {"full_attention", "sliding_attention"}
    if unknown:
        raise ConfigError(
            f"model.path: {config.model_type} has layers of type {sorted(unknown)[0]!r}, whose mask densebatch "
            "cannot draw: packed documents would not be isolated"
        )
    if window is None or types == {"full_attention"}:
        return {"full_attention": None}
    if not types or types == {"sliding_attention"}:
        return {"sliding_attention": window}
    return {"full_attention": None, "sliding_attention": window}


def check_architecture(config, attn_implementation: str) -> None:
    """``ConfigError`` for an architecture that cannot keep packed documents apart under this
    attention implementation (see ``REFUSED``; soft-capped attention logits need eager)."""
    kind = getattr(config, "model_type", "?")
    if kind in REFUSED or (kind == "falcon" and getattr(config, "alibi", False)):
        raise ConfigError(f"model.path: {kind} is not supported: it {REFUSED.get(kind, _ALIBI)}")
    if getattr(config, "attn_logit_softcapping", None) and attn_implementation == "sdpa":
        raise ConfigError(
            f"model.attn_implementation: {kind} soft-caps its attention scores, which SDPA cannot compute "
            f"(it would give other logits); set model.attn_implementation: {DENSEBATCH} (or eager)"
        )
    if kind in _OWN_ATTENTION_CLASSES and attn_implementation == DENSEBATCH:
        raise ConfigError(
            f"model.attn_implementation: {kind} picks its attention classes itself (eager, sdpa or flash), so "
            f"densebatch's document attention cannot reach it; set model.attn_implementation: sdpa (a T x T document mask)"
        )


CAUSAL_HEADS = ("ForCausalLM", "LMHeadModel")  # the class names of decoder-only language models
_ENCODERS = {"bert", "roberta", "xlm-roberta", "camembert", "electra", "ernie", "megatron-bert", "roberta-prelayernorm", "xmod"}


def check_causal_lm_dir(path: str | Path) -> None:
    """``ConfigError`` in one line, before anything is loaded, when ``path`` does not hold a decoder-only causal
    LM: no ``config.json``, an encoder-decoder, a saved class that is not a causal LM head (``BertForMaskedLM``:
    ``AutoModelForCausalLM`` would load it as ``BertLMHeadModel``, which reads the future unless it was
    built as a decoder), or a model type transformers has no causal LM for."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.path: '{path}' has no config.json (expected a local Hugging Face model directory)")
    try:
        meta = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"model.path: {path / 'config.json'} is not valid JSON ({e})") from None
    kind, saved = meta.get("model_type", "?"), list(meta.get("architectures") or [])
    supported = "densebatch trains decoder-only causal LMs (a class ending in ForCausalLM or LMHeadModel)"
    if meta.get("is_encoder_decoder"):
        raise ConfigError(f"model.path: {path} holds an encoder-decoder ({', '.join(saved) or kind}); {supported}")
    if saved and not any(a.endswith(CAUSAL_HEADS) for a in saved):
        raise ConfigError(
            f"model.path: {path} holds {', '.join(saved)}, not a causal LM (AutoModelForCausalLM would load "
            f"{_causal_class(kind)} with its own head); {supported}"
        )
    if kind in _ENCODERS and not meta.get("is_decoder"):
        raise ConfigError(
            f"model.path: {path} holds a {kind} encoder (is_decoder false: it attends to later tokens); {supported}"
        )
    if _causal_class(kind) is None:
        raise ConfigError(f"model.path: transformers has no causal LM for model type {kind!r} ({path}); {supported}")


def _causal_class(model_type: str) -> str | None:
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        raise ConfigError("model.kind hf needs transformers: pip install 'densebatch[hf]'") from None
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)

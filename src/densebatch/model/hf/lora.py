"""LoRA adapters on a Hugging Face model through ``peft``: only the adapters (and added tokens' rows) train.

``apply_lora(model, settings, new_ids)`` wraps ``HFCausalLM.hf`` in a ``PeftModel``: low-rank
adapters on ``settings.target_modules`` (or the architecture's attention projections), every other
weight frozen (``requires_grad`` False, so the optimizer's groups leave it out). Tokens the
tokenizer added (``new_ids``) would otherwise keep their initial rows forever, so their rows of the
input and output embeddings train too, through PEFT's trainable tokens (only those rows: the rest of
each table stays frozen); a tied head shares the input's rows.

The wrapped model computes exactly what the unwrapped one computes with the adapters in its layers:
``HFCausalLM`` calls the transformers model itself (``HFCausalLM.lm``), whose layers PEFT replaced
in place, so the document mask, the hidden-state path and the fused loss head work unchanged.
A final model is the adapter (PEFT's ``save_pretrained``: adapter_config.json,
adapter_model.safetensors); ``load_adapter`` rebuilds the trained model from it and the base;
``densebatch export`` merges the adapters into a plain model (``HFCausalLM.save_merged``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch.nn as nn

from densebatch.errors import ConfigError
from densebatch.model.hf.adapter import HFCausalLM
from densebatch.model.hf.loading import has_weights
from densebatch.model.quiet import quiet_peft

ADAPTER_CONFIG = "adapter_config.json"
# Attention projections to adapt where peft has no default for the architecture (its default, the
# query and value projections, for the others: TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING).
_DEFAULT_TARGETS = {"phi3": ["qkv_proj"], "olmo": ["q_proj", "v_proj"], "starcoder2": ["q_proj", "v_proj"]}


def _peft():
    try:
        import peft
    except ImportError:
        raise ConfigError("model.lora needs peft: pip install 'densebatch[lora]'") from None
    return peft


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters of ``model``, each tensor once (tied ones are one tensor)."""
    params = list(model.parameters())  # nn.Module.parameters() yields a shared tensor once
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def lora_summary(model: nn.Module) -> str | None:
    """``LoRA: 12,288 trainable of 1,234,567 parameters (1.00%)`` for a model with LoRA adapters, else None;
    printed once when a run builds its model. Trainable: the adapters and the added tokens' rows."""
    if not getattr(model, "lora", False):
        return None
    trainable, total = parameter_counts(model)
    return f"LoRA: {trainable:,} trainable of {total:,} parameters ({100 * trainable / max(total, 1):.2f}%)"


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def target_modules(model_type: str, requested: list[str]) -> list[str] | str:
    """What ``model.lora.target_modules`` asks for: names, ``all-linear``, or (empty) the default."""
    if requested == ["all-linear"] or requested == "all-linear":
        return "all-linear"
    if requested:
        return list(requested)
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as defaults

    found = _DEFAULT_TARGETS.get(model_type) or defaults.get(model_type)
    if not found:
        raise ConfigError(
            f"model.lora.target_modules: no default for {model_type}; name its modules (e.g. q_proj,v_proj) or all-linear"
        )
    return list(found)


def trainable_tokens(lm, new_ids: list[int]) -> list[int] | dict[str, list[int]] | None:
    """PEFT's ``trainable_token_indices`` for the added ids: a list (the input embedding; a tied
    head follows it) or, with an untied head, the ids for both tables by module name."""
    if not new_ids:
        return None
    emb, head = lm.get_input_embeddings(), lm.get_output_embeddings()
    if head is None or head.weight is emb.weight:
        return list(new_ids)
    names = {m: n for n, m in lm.named_modules()}
    return {names[emb]: list(new_ids), names[head]: list(new_ids)}


def apply_lora(model, settings, new_ids: list[int] = ()) -> None:
    """Wrap ``model.hf`` (an ``HFCausalLM``) in LoRA adapters per ``settings`` (``config.LoraConfig``)."""
    peft = _peft()
    if model.lora:
        raise AssertionError("LoRA adapters are already applied")
    if not has_weights(model.path):
        # The frozen base would be random, and load_adapter could not rebuild it: the adapter alone is saved.
        raise ConfigError(
            f"model.lora: {model.path} holds no weights (config.json only); LoRA adapts a trained model: "
            "give model.path a directory with its weights, or set model.lora.r: 0"
        )
    lm = model.hf
    kind = getattr(lm.config, "model_type", "?")
    config = peft.LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=target_modules(kind, settings.target_modules),
        trainable_token_indices=trainable_tokens(lm, list(new_ids)),
        task_type="CAUSAL_LM",
    )
    try:
        # autocast_adapter_dtype (default): adapters in float32 even on bfloat16 / float16 weights
        with quiet_peft():
            model.hf = peft.get_peft_model(lm, config)
    except ValueError as e:  # e.g. "Target modules {'x'} not found in the base model"
        raise ConfigError(f"model.lora.target_modules: {str(e).splitlines()[0][:200]}") from None
    model.lora = True


def load_adapter(path: str | Path, model_cfg, vocab_size: int):
    """The model a LoRA run saved in ``path`` (its final/): the base model (``adapter_config.json``'s
    ``base_model_name_or_path``, else ``model_cfg.path``) in the run's dtype and attention, its
    vocabulary grown to ``vocab_size`` (the saved tokenizer's), the adapter loaded on top."""
    peft = _peft()
    path = Path(path)
    saved = json.loads((path / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    # The path the adapter names first; the run's model.path when the base was moved and the config says where.
    tried = [b for b in (saved.get("base_model_name_or_path"), model_cfg.path) if b]
    base = next((b for b in tried if (Path(b) / "config.json").is_file()), None)
    if base is None:
        raise ConfigError(
            f"{path}: a LoRA adapter whose base model is not found (tried {', '.join(map(repr, tried)) or 'nothing'}); "
            "put the base model back there or set model.path to it"
        )
    model = HFCausalLM(base, attn_implementation=model_cfg.attn_implementation, dtype=model_cfg.dtype)
    model.resize_vocab(vocab_size)  # the added tokens' rows come from the adapter
    with quiet_peft():
        model.hf = peft.PeftModel.from_pretrained(model.hf, str(path))
    model.lora = True
    return model

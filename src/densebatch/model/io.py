"""Saving and loading models: the reference GPT as config.json + safetensors, HF via save_pretrained."""

from __future__ import annotations

from pathlib import Path

import torch.nn as nn

from densebatch.errors import ConfigError, read_json_object
from densebatch.model.gpt import GPT, KIND
from densebatch.model.hf.adapter import HFCausalLM
from densebatch.model.hf.checks import MASKED_HEADS


def save_model(model: nn.Module, path: str | Path) -> None:
    """Write ``model`` to the directory ``path`` so that ``load_model(path)`` rebuilds it."""
    model.save(path)


def check_saved_gpt(path: str | Path) -> None:
    """``ConfigError`` naming ``model.path`` and ``model.kind`` unless ``path`` holds a reference GPT ``save_model``
    wrote, which ``model.kind: gpt`` trains from (a run's ``final/``): checked before any data is prepared, so an
    empty directory or a Hugging Face model's, given without ``model.kind: hf``, is one line, not a run."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(
            f"model.path: {path} holds no saved reference GPT (no config.json), which model.kind gpt trains from (a "
            "run's final/); for a Hugging Face model directory set model.kind: hf"
        )
    if read_json_object(cfg_file, "a model configuration").get("densebatch_kind") != KIND:
        raise ConfigError(f"model.path: {path} holds a Hugging Face model, and model.kind is gpt: set model.kind: hf to train it")


def load_model(path: str | Path, attn_implementation: str = "sdpa") -> nn.Module:
    """Rebuild a model saved by ``save_model``: the kind is read from ``config.json``.

    A ``config.json`` marked ``densebatch_kind: densebatch-gpt`` is the reference GPT; any other is
    a Hugging Face model directory (weights optional, see ``HFCausalLM``): an encoder masked LM when saved as
    one (a class ending in ``ForMaskedLM``), else a causal LM.
    """
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"'{path}' is not a saved model: no config.json there")
    meta = read_json_object(cfg_file, "a model configuration")
    if meta.get("densebatch_kind") == KIND:
        return GPT.load(path)
    saved = meta.get("architectures")  # a list of class names (or one); check_model_dir refuses anything else
    saved = [saved] if isinstance(saved, str) else saved if isinstance(saved, list) else []
    masked = any(str(a).endswith(MASKED_HEADS) for a in saved)
    return HFCausalLM(path, attn_implementation=attn_implementation, task="mlm" if masked else "causal")

"""A Hugging Face model built from a local directory for the adapter: checks, densebatch's attention, dtype, weights.

``load_hf_model`` refuses what cannot keep packed documents apart before anything loads (the attention
implementation, the architecture, the transformers release), registers densebatch's attention with
transformers when it is the one asked for, and builds ``AutoModelForCausalLM`` (or ``AutoModelForMaskedLM``)
from the weights in the directory, from ``config.json`` alone (random init), or with ``empty_weights`` as
the structure on the meta device (``model/hf/weights.py`` reads each rank's rows later). A directory
transformers cannot build from is one line naming it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from densebatch.errors import ConfigError
from densebatch.model.hf.attention import NAME as DENSEBATCH
from densebatch.model.hf.attention import register
from densebatch.model.hf.checks import (
    TASKS,
    check_architecture,
    check_model_dir,
    check_transformers,
    load_errors,
    read_hf_config,
    unbuildable,
)
from densebatch.model.hf.falcon import install as install_falcon_attention
from densebatch.model.hf.weights import empty_parameters
from densebatch.model.quiet import quiet_progress

# attn_implementation -> how the document mask is expressed (model/hf/adapter.py's table); densebatch needs none.
ALLOWED = {DENSEBATCH: None, "sdpa": "bool", "eager": "additive"}
# model.dtype -> the dtype weights are loaded in (and trained in: see docs/hf-models.md).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def has_weights(path: str | Path) -> bool:
    return any((Path(path) / f).is_file() for f in _WEIGHT_FILES)


def load_hf_model(path: Path, *, attn_implementation: str, dtype: str, empty_weights: bool, task: str) -> nn.Module:
    """The transformers model in ``path`` under ``attn_implementation`` (one of ``ALLOWED``), its weights in
    ``dtype`` (a ``DTYPES`` name); ``task``: ``causal`` or ``mlm``. ``ConfigError`` for what it cannot build."""
    if attn_implementation not in ALLOWED:
        raise ConfigError(
            f"model.attn_implementation: {attn_implementation!r} cannot keep packed documents "
            f"isolated (tests show it leaks or crashes); use one of: {', '.join(ALLOWED)}"
        )
    check_model_dir(path, task)
    if dtype not in DTYPES:
        raise ConfigError(f"model.dtype: expected one of {', '.join(DTYPES)}; got {dtype!r}")
    try:
        import transformers
    except ImportError:
        raise ConfigError("model.kind hf needs transformers: pip install 'densebatch[hf]'") from None
    check_transformers()
    config = read_hf_config(path)
    check_architecture(config, attn_implementation)
    if attn_implementation == DENSEBATCH:
        register()
        if config.model_type == "falcon":  # < 5.25 picks its attention class from its own table
            install_falcon_attention()
    # model.dtype: the weights as loaded and trained (float32 master weights by default, whatever
    # the checkpoint's dtype; autocast does the low precision). See docs/hf-models.md.
    kw = dict(attn_implementation=attn_implementation, dtype=DTYPES[dtype])
    auto = getattr(transformers, TASKS[task][0])  # AutoModelForCausalLM or AutoModelForMaskedLM
    try:
        with quiet_progress():
            if empty_weights:
                with empty_parameters():
                    hf = auto.from_config(config, **kw)
                if (path / "generation_config.json").is_file():  # what from_pretrained would have read
                    from transformers import GenerationConfig

                    hf.generation_config = GenerationConfig.from_pretrained(path)
            elif has_weights(path):
                hf = auto.from_pretrained(path, **kw)
            else:
                hf = auto.from_config(config, **kw)
    except load_errors() as e:  # the directory's files, unless "X does not support an attention implementation ..."
        if not isinstance(e, ValueError) or "attention implementation" not in str(e):
            raise unbuildable(e, path, "build the model from its config.json") from None
        raise ConfigError(
            f"model.attn_implementation: {config.model_type} cannot run {attn_implementation!r} "
            f"(transformers: {str(e).splitlines()[0][:120]}); try the other of {', '.join(ALLOWED)}"
        ) from None
    actual = getattr(hf.config, "_attn_implementation", attn_implementation)
    if actual != attn_implementation:
        raise ConfigError(
            f"model.attn_implementation: transformers chose {actual!r} instead of {attn_implementation!r} "
            f"for {config.model_type}; set one of {', '.join(ALLOWED)} that it supports"
        )
    return hf

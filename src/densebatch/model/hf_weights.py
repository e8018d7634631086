"""A Hugging Face model's weights read row range by row range from its safetensors files, never whole.

For a sharded build (``model.kind: hf`` under FSDP): ``empty_parameters()`` makes every parameter a
module creates a meta tensor (buffers, such as rotary frequencies, stay real: they are computed, not
loaded), so ``HFCausalLM(path, empty_weights=True)`` has the model's structure and no weights. Once it
is sharded, ``fill_from_files`` gives each rank's rows of each parameter from the files
(``model.safetensors`` or the shards that ``model.safetensors.index.json`` names), read by positioned
reads straight into the rank's shard (no memory map: the pages are not the process's), cast to the
model's dtype: the values ``from_pretrained`` would give. Rows of
tokens added to the vocabulary get the mean of the rows before them, computed as
``HFCausalLM.resize_vocab`` computes it (from the whole table: one tensor, not the model).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from densebatch.errors import ConfigError
from densebatch.tensor_files import RowReader

INDEX = "model.safetensors.index.json"


@contextlib.contextmanager
def empty_parameters() -> Iterator[None]:
    """Parameters registered inside are moved to the meta device as they are registered (no memory kept)."""
    original = nn.Module.register_parameter

    def register(module, name, param):
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def weight_files(path: str | Path) -> dict[str, str] | None:
    """Weight name -> the safetensors file that holds it, from the index or the single file; None without
    safetensors weights (``pytorch_model.bin``: a pickle, which densebatch does not stream)."""
    path = Path(path)
    if (path / INDEX).is_file():
        return {k: v for k, v in json.loads((path / INDEX).read_text(encoding="utf-8"))["weight_map"].items()}
    if (path / "model.safetensors").is_file():
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            return {k: "model.safetensors" for k in f.keys()}
    return None


def missing_weights(model, names: list[str]) -> list[str]:
    """Which of the parameter ``names`` (of ``HFCausalLM``) its files do not hold."""
    files = weight_files(model.path) or {}
    return [n for n in names if n.removeprefix("hf.") not in files]


def fill_from_files(model, shards: dict[str, tuple[torch.Tensor, int]]) -> None:
    """Copy into each ``local`` tensor (``name -> (local, first row)``, names as ``model.named_parameters``)
    its rows from the files (positioned reads, straight into ``local`` when the dtypes agree), and the
    mean rows of added tokens (``model.new_rows``)."""
    files = weight_files(model.path)
    if files is None:
        raise ConfigError(f"{model.path}: no safetensors weights to read")
    start, stop = getattr(model, "new_rows", None) or (0, 0)
    tables = model.vocab_table_names() if stop > start else set()
    with RowReader(model.path) as reader, torch.no_grad():
        for name, (local, first) in shards.items():
            key = name.removeprefix("hf.")
            file = files[key]
            shape = reader.shape(file, key)
            if not local.dim():
                local.copy_(reader.rows(file, key).to(local.dtype))
                continue
            lo, hi = first, min(first + local.shape[0], shape[0])
            if lo < hi:
                target = local[: hi - lo]
                read = reader.rows(file, key, lo, hi, out=target if target.dtype == reader.dtype(file, key) else None)
                if read is not target:
                    target.copy_(read.to(local.dtype))
            if name in tables:
                base = reader.rows(file, key, 0, start).to(local.dtype)  # one table: as resize_vocab computes it
                mean = base.float().mean(0).to(local.dtype)
                a, b = max(first, start), min(first + local.shape[0], stop)
                if a < b:
                    local[a - first : b - first] = mean

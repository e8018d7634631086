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


_PEFT_WRAPPERS = (".base_layer.", ".token_adapter.")  # the module PEFT wraps a layer in, between two names
_TOKEN_ROWS = (".trainable_tokens_delta.", ".trainable_tokens_original.")  # PEFT's trainable rows of added tokens


def file_key(model, name: str) -> str:
    """The weight files' name of ``HFCausalLM`` parameter ``name`` (under LoRA, of the layer PEFT wrapped)."""
    key = name.removeprefix("hf.")
    if getattr(model, "lora", False):
        key = key.removeprefix("base_model.model.")
        for part in _PEFT_WRAPPERS:
            key = key.replace(part, ".")
    return key


def token_rows_table(key: str) -> str | None:
    """For PEFT's trainable rows of the added tokens (a file key), the weight of the table they start from."""
    part = next((p for p in _TOKEN_ROWS if p in key), None)
    return key.split(part)[0] + ".weight" if part else None


def missing_weights(model, names: list[str]) -> list[str]:
    """Which of the parameter ``names`` (of ``HFCausalLM``, not LoRA adapters) its files do not hold."""
    files = weight_files(model.path) or {}
    return [n for n in names if (k := file_key(model, n)) not in files and token_rows_table(k) not in files]


def fill_from_files(model, shards: dict[str, tuple[torch.Tensor, int]]) -> None:
    """Copy into each ``local`` tensor (``name -> (local, first row)``, names as ``model.named_parameters``
    or ``named_buffers``) its rows from the files (positioned reads, straight into ``local`` when the
    dtypes agree), and the mean rows of added tokens (``model.new_rows``), in their tables and (LoRA) in
    PEFT's trainable rows for them."""
    files = weight_files(model.path)
    if files is None:
        raise ConfigError(f"{model.path}: no safetensors weights to read")
    start, stop = getattr(model, "new_rows", None) or (0, 0)
    tables = set()  # the tables added tokens grow (under LoRA: those PEFT's trainable tokens wrap, and a head bias)
    if stop > start and getattr(model, "lora", False):
        tables = {file_key(model, n) for n in shards if ".token_adapter.base_layer." in n}
        tables |= {k.removesuffix(".weight") + ".bias" for k in tables}
    elif stop > start:
        tables = {file_key(model, n) for n in model.vocab_table_names()}
    with RowReader(model.path) as reader, torch.no_grad():
        for name, (local, first) in shards.items():
            key = file_key(model, name)
            if (table := token_rows_table(key)) is not None:  # every row is an added token's (new_rows)
                local.copy_(_mean_row(reader, file=files[table], key=table, start=start, dtype=local.dtype).expand_as(local))
                continue
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
            if key in tables:
                a, b = max(first, start), min(first + local.shape[0], stop)
                if a < b:
                    local[a - first : b - first] = _mean_row(reader, file=file, key=key, start=start, dtype=local.dtype)


def _mean_row(reader: RowReader, *, file: str, key: str, start: int, dtype: torch.dtype) -> torch.Tensor:
    """The mean of a table's first ``start`` rows, as ``HFCausalLM.resize_vocab`` computes it (one table)."""
    return reader.rows(file, key, 0, start).to(dtype).float().mean(0).to(dtype)

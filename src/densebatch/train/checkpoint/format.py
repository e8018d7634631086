"""How training state is laid out in a checkpoint: a JSON tree with every tensor split out by its path, each
stored once (tied weights become aliases), so a checkpoint is safetensors + JSON and is never unpickled."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from densebatch.errors import UserError

_TAGS = ("__tensor__", "__ndarray__", "__tuple__", "__items__")


class CheckpointError(UserError):
    """A checkpoint cannot be written or read (corrupt, incomplete, or not a checkpoint at all)."""


def encode_tree(obj: Any, path: list[str], tensors: dict[str, Any]) -> Any:
    """JSON-able tree of ``obj``; tensors / arrays go to ``tensors`` under their dotted path."""
    if isinstance(obj, (torch.Tensor, np.ndarray)) or hasattr(obj, "to_local"):  # to_local: a shard (DTensor, staged)
        key = ".".join(path) or "tensor"
        while key in tensors:  # "a.b" as a key and as a nested path: keep both apart
            key += "_"
        tensors[key] = obj
        return {"__ndarray__" if isinstance(obj, np.ndarray) else "__tensor__": key}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, np.generic):  # numpy scalars sneak into loader states; stored as Python numbers
        return obj.item()
    if isinstance(obj, tuple):
        return {"__tuple__": [encode_tree(v, path + [str(i)], tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode_tree(v, path + [str(i)], tensors) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not (len(obj) == 1 and next(iter(obj)) in _TAGS):
            return {k: encode_tree(v, path + [k], tensors) for k, v in obj.items()}
        # int keys (optimizer "state"), tuple keys, or a key that looks like a tag: keep exact types
        return {"__items__": [[encode_tree(k, path, {}), encode_tree(v, path + [str(k)], tensors)] for k, v in obj.items()]}
    raise CheckpointError(
        f"cannot store {'.'.join(path) or 'value'} of type {type(obj).__name__}: only tensors, numpy arrays and JSON data"
    )


def decode_tree(node: Any, tensors: dict[str, torch.Tensor], aliases: dict[str, str]) -> Any:
    if isinstance(node, list):
        return [decode_tree(v, tensors, aliases) for v in node]
    if not isinstance(node, dict):
        return node
    if len(node) == 1:
        ((tag, value),) = node.items()
        if tag in ("__tensor__", "__ndarray__"):
            key = aliases.get(value, value)
            if key not in tensors:
                raise CheckpointError(f"state.json refers to tensor '{value}' that no tensor file holds")
            return tensors[key] if tag == "__tensor__" else tensors[key].numpy()
        if tag == "__tuple__":
            return tuple(decode_tree(v, tensors, aliases) for v in value)
        if tag == "__items__":  # keys were encoded like values: tuples come back as tuples (hashable)
            return {decode_tree(k, tensors, aliases): decode_tree(v, tensors, aliases) for k, v in value}
    return {k: decode_tree(v, tensors, aliases) for k, v in node.items()}


def dedupe_tensors(tensors: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Store each tensor once: identical views (tied weights) become aliases of the first key;
    distinct views of one storage are cloned, since safetensors refuses shared memory."""
    unique, aliases, first_of_view, views_of = {}, {}, {}, {}
    as_tensor = {
        k: torch.from_numpy(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v.detach() for k, v in tensors.items()
    }
    storage = {k: (t.device, t.untyped_storage().data_ptr()) for k, t in as_tensor.items() if t.numel()}  # empty: no memory
    for key, where in storage.items():
        t = as_tensor[key]
        view = (*where, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        views_of.setdefault(where, set()).add(view)
        if view in first_of_view:
            aliases[key] = first_of_view[view]
        else:
            first_of_view[view] = key
    for key, t in as_tensor.items():
        if key not in aliases:
            shared = key in storage and len(views_of[storage[key]]) > 1
            unique[key] = t.to("cpu", copy=True).contiguous() if shared else t.cpu().contiguous()
    return unique, aliases

"""A model built without any process holding it: constructed on the meta device, sharded, then each rank's rows.

``record_init(build)`` runs ``build()`` under ``torch.device("meta")`` (no memory) while a dispatch mode
records every in-place operation the constructor applies to a parameter (``normal_``, ``uniform_``,
``zero_``, ``fill_``, ...: how ``nn.Linear``, ``nn.Embedding`` and a model's own ``_init_weights``
initialise). On the meta device those draw nothing from the random generator. After ``fully_shard``,
``materialise`` allocates each rank's shards and replays the record, from the same seed, in the same
order, on the CPU's default generator: each operation runs on a full-size scratch copy of its one
tensor (so the generator advances exactly as in a build of the whole model), and a parameter's rows
are kept once its last operation ran; the scratch is then dropped. The weights are therefore bit for
bit those of the one-process build, and peak memory is one tensor, never the model.

What cannot be replayed is refused (``MetaInitError``) before anything is allocated, and the caller
builds the whole model instead: an operation that reads another tensor (``copy_`` from a loaded
weight), one on part of a parameter (a view), or buffers (their values come from factory calls, not
in-place operations).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from densebatch.train.checkpoint_shards import first_row

FULL_WRITES = ("normal_", "uniform_", "zero_", "fill_")  # overwrite every element: earlier values do not matter


class MetaInitError(Exception):
    """The model's initialisation cannot be recorded and replayed shard by shard."""


@dataclass
class InitRecord:
    ops: list = field(default_factory=list)  # (storage key, aten op, args after the tensor, kwargs, shape, dtype)
    names: dict = field(default_factory=dict)  # storage key -> parameter name (tied parameters: the first)
    problem: str | None = None
    # Instead of replaying ops: fill(shards) gives every rank's rows ({name: (local tensor, first row)}),
    # e.g. read from weight files; the model's buffers are real already and kept
    fill: Callable[[dict], None] | None = None


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _Recorder(TorchDispatchMode):
    def __init__(self, record: InitRecord):
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else None
        schema = func._schema
        in_place = (
            bool(schema.arguments) and schema.arguments[0].alias_info is not None and schema.arguments[0].alias_info.is_write
        )
        if in_place and isinstance(target, torch.Tensor) and target.is_meta:
            others = [a for a in list(args[1:]) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
            if others and self.record.problem is None:
                self.record.problem = f"{func} reads another tensor"
            if (target.storage_offset() or not target.is_contiguous()) and self.record.problem is None:
                self.record.problem = f"{func} writes part of a tensor"
            self.record.ops.append((_key(target), func, args[1:], dict(kwargs), tuple(target.shape), target.dtype))
        return func(*args, **kwargs)


def record_init(build: Callable[[], nn.Module]) -> tuple[nn.Module, InitRecord]:
    """``build()`` on the meta device, and the record of how its parameters were initialised."""
    record = InitRecord()
    with torch.device("meta"), _Recorder(record):
        model = build()
    if record.problem is None and any(True for _ in model.buffers()):
        record.problem = "the model has buffers"
    if record.problem is not None:
        raise MetaInitError(record.problem)
    for name, p in model.named_parameters():
        record.names.setdefault(_key(p), name)
    return model, record


def _rows_of(param) -> tuple[torch.Tensor, int]:
    """(this rank's local tensor of a parameter, its first row's global index)."""
    if not hasattr(param, "to_local"):
        return param.data, 0
    return param.to_local(), first_row(param)


def materialise(model: nn.Module, record: InitRecord, device: torch.device | str) -> None:
    """Allocate ``model``'s (sharded) parameters on ``device`` and give each rank its rows of the recorded
    initialisation (see the module docstring). The caller seeds the generators as the whole build was."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers() if not b.is_meta}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name in buffers:  # computed at construction (rotary frequencies): to_empty left them undefined
                b.copy_(buffers[name])
    params = dict(model.named_parameters())
    if record.fill is not None:
        record.fill({name: _rows_of(p) for name, p in params.items()})
        return
    last = {key: i for i, (key, *_) in enumerate(record.ops)}
    full_write = {}  # storage -> index of the last op from which its value is rebuilt
    for i, (key, func, *_rest) in enumerate(record.ops):
        if func.overloadpacket.__name__ in FULL_WRITES:
            full_write[key] = i
    live: dict[int, torch.Tensor] = {}
    for i, (key, func, args, kwargs, shape, dtype) in enumerate(record.ops):
        if i < full_write.get(key, 0) or key not in record.names:
            func(torch.empty(shape, dtype=dtype), *args, **kwargs)  # only its draws matter
            continue
        t = live.setdefault(key, torch.empty(shape, dtype=dtype))
        func(t, *args, **kwargs)
        if i == last[key]:
            local, start = _rows_of(params[record.names[key]])
            with torch.no_grad():
                local.copy_(t[start : start + local.shape[0]] if t.dim() else t)
            del live[key]

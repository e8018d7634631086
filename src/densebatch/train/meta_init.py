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

A model whose weights come from files (``InitRecord.fill``) records only what a whole build does
after loading (``recording``: growing the vocabulary, adding LoRA adapters). The record's ``names``
then holds only the parameters whose values it makes (the adapters); every other recorded operation
is replayed for its random draws alone, so the generator reaches each adapter's initialisation in
the state the whole build left it in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from densebatch.train.dtensors import first_row

FULL_WRITES = ("normal_", "uniform_", "zero_", "fill_")  # overwrite every element: earlier values do not matter


class MetaInitError(Exception):
    """The model's initialisation cannot be recorded and replayed shard by shard."""


@dataclass
class InitRecord:
    ops: list = field(default_factory=list)  # (storage key, aten op, args after the tensor, kwargs, shape, dtype)
    names: dict = field(default_factory=dict)  # storage key -> name of a parameter whose value the ops make
    problems: dict = field(default_factory=dict)  # storage key -> why its ops cannot be replayed
    # Before the ops are replayed: fill(shards) gives every rank's rows of the parameters the ops do not
    # make, and of buffers left on the meta device ({name: (local tensor, first row)}), e.g. read from
    # weight files; the model's real buffers are kept
    fill: Callable[[dict], None] | None = None

    def problem_of(self, keys) -> str | None:
        """Why the values of the storages ``keys`` cannot be replayed (the first reason), or None."""
        return next((self.problems[k] for k in keys if k in self.problems), None)


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
            key, problems = _key(target), self.record.problems
            if any(isinstance(a, torch.Tensor) for a in list(args[1:]) + list(kwargs.values())):
                problems.setdefault(key, f"{func} reads another tensor")
            if target.storage_offset() or not target.is_contiguous():
                problems.setdefault(key, f"{func} writes part of a tensor")
            self.record.ops.append((_key(target), func, args[1:], dict(kwargs), tuple(target.shape), target.dtype))
        return func(*args, **kwargs)


@contextlib.contextmanager
def recording(record: InitRecord) -> Iterator[None]:
    """Tensors made inside go on the meta device, and every in-place operation on one joins ``record``."""
    with torch.device("meta"), _Recorder(record):
        yield


def storage_key(t: torch.Tensor) -> int:
    """The key of ``t``'s storage in a record (tied parameters share one)."""
    return _key(t)


def record_init(build: Callable[[], nn.Module]) -> tuple[nn.Module, InitRecord]:
    """``build()`` on the meta device, and the record of how its parameters were initialised."""
    record = InitRecord()
    with recording(record):
        model = build()
    problem = record.problem_of(_key(p) for p in model.parameters())
    if problem is None and any(True for _ in model.buffers()):
        problem = "the model has buffers"
    if problem is not None:
        raise MetaInitError(problem)
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
        made = set(record.names.values())
        shards = {name: _rows_of(p) for name, p in params.items() if name not in made}
        record.fill(shards | {name: (b, 0) for name, b in model.named_buffers() if name not in buffers})
    last = {key: i for i, (key, *_) in enumerate(record.ops)}
    full_write = {}  # storage -> index of the last op from which its value is rebuilt
    for i, (key, func, *_rest) in enumerate(record.ops):
        if func.overloadpacket.__name__ in FULL_WRITES:
            full_write[key] = i
    live: dict[int, torch.Tensor] = {}
    for i, (key, func, args, kwargs, shape, dtype) in enumerate(record.ops):
        if i < full_write.get(key, 0) or key not in record.names:
            if not any(isinstance(a, torch.Tensor) for a in list(args) + list(kwargs.values())):  # a copy draws nothing
                func(torch.empty(shape, dtype=dtype), *args, **kwargs)  # only its draws matter
            continue
        t = live.setdefault(key, torch.empty(shape, dtype=dtype))
        func(t, *args, **kwargs)
        if i == last[key]:
            local, start = _rows_of(params[record.names[key]])
            with torch.no_grad():
                local.copy_(t[start : start + local.shape[0]] if t.dim() else t)
            del live[key]

"""Checkpoint saves off the critical path: stage this rank's share in host memory, write it in the background.

``CheckpointWriter.save`` copies the state's tensors (each rank its own shards) to host memory, pinned
when a GPU is there, and returns: training goes on while a background thread writes, hashes and
publishes the checkpoint (``save_checkpoint``, unchanged: manifest last, atomic rename). What can change
the answer is ordered around it:

- the next save first waits for the previous one (one write in flight, so at most one staged copy);
- a rollback, the end of the run and a stop by signal wait too (``wait``): nothing reads, prunes or
  exits past a checkpoint being written;
- the background threads of all ranks coordinate on a process group of their own (``side_channel``):
  its collectives never interleave with the training loop's;
- a write that fails raises at the next ``save`` or ``wait``, on every rank, with the same one-line
  ``CheckpointError`` as a synchronous save; a process killed mid-write leaves only a ``.tmp-step-*``
  directory, so the previous checkpoint stays the newest valid one.

``blocked_s`` of each save is what training waited (staging, plus any wait for the previous write); the
metrics record it beside the write's own seconds. With ``background=False`` every save is synchronous
(``blocked_s`` is then the whole save).
"""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path
from typing import Any

import torch

from densebatch.train.checkpoint.manager import CheckpointManager
from densebatch.train.dtensors import is_dtensor


class HostShard:
    """A staged copy of one rank's rows of a DTensor: what ``split_for_rank`` reads of it, in host memory."""

    def __init__(self, t, local: torch.Tensor):
        self.shape, self.placements, self.device_mesh, self._local = t.shape, t.placements, t.device_mesh, local

    def to_local(self) -> torch.Tensor:
        return self._local

    def dim(self) -> int:
        return len(self.shape)


def _host_copy(t: torch.Tensor, memo: dict) -> torch.Tensor:
    """``t`` copied to host memory (pinned when CUDA is there); views of one storage stay one copy's views."""
    key = (t.untyped_storage()._cdata, t.device)
    if key not in memo:
        base = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage())
        pin = t.device.type == "cuda"
        memo[key] = torch.empty(base.shape, dtype=t.dtype, pin_memory=pin).copy_(base, non_blocking=pin)
    return memo[key].as_strided(t.shape, t.stride(), t.storage_offset())


def stage(tree: Any, memo: dict | None = None) -> Any:
    """A copy of a state tree whose tensors live in host memory and no longer change with training."""
    memo = {} if memo is None else memo
    if is_dtensor(tree):
        return HostShard(tree, _host_copy(tree.to_local().detach(), memo))
    if isinstance(tree, torch.Tensor):
        return _host_copy(tree.detach(), memo)
    if isinstance(tree, dict):
        out = {k: stage(v, memo) for k, v in tree.items()}
        if hasattr(tree, "_metadata"):  # a module state dict's version metadata
            out = type(tree)(out) if type(tree) is not dict else out
            out._metadata = copy.deepcopy(tree._metadata)
        return out
    if isinstance(tree, (list, tuple)):
        return type(tree)(stage(v, memo) for v in tree)
    return copy.deepcopy(tree)


class CheckpointWriter:
    """Saves through ``manager``, in the background when ``background`` (see the module docstring)."""

    def __init__(self, manager: CheckpointManager, dist, background: bool = False):
        self.manager, self.dist, self.background = manager, dist, background
        self.side = dist.side_channel() if background else dist  # every rank, in the same order
        self._thread: threading.Thread | None = None
        self._result: Path | BaseException | None = None
        self.last_write_s: float | None = None  # the last finished write's own seconds
        self.previous_write_s: float | None = None  # a synchronous save's seconds; in the background, the write before

    def save(self, step: int, model_state, optimizer_state, extra_state) -> tuple[Path | None, float]:
        """(the checkpoint's path when written synchronously on rank 0, else None; seconds training was blocked)."""
        t0 = time.perf_counter()
        self.wait()
        if not self.background:
            path = self.manager.save(
                step, model_state=model_state, optimizer_state=optimizer_state, extra_state=extra_state, dist=self.dist
            )
            self.last_write_s = self.previous_write_s = time.perf_counter() - t0
            return (path if self.dist.is_main else None), self.last_write_s
        self.previous_write_s = self.last_write_s
        memo: dict = {}
        states = (stage(model_state, memo), stage(optimizer_state, memo), stage(extra_state, memo))
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the pinned copies are complete before anything reads them
        self._thread = threading.Thread(target=self._write, args=(step, states), name=f"checkpoint-{step}", daemon=True)
        self._thread.start()
        return None, time.perf_counter() - t0

    def _write(self, step: int, states: tuple) -> None:
        t0 = time.perf_counter()
        model_state, optimizer_state, extra_state = states
        try:
            self._result = self.manager.save(
                step, model_state=model_state, optimizer_state=optimizer_state, extra_state=extra_state, dist=self.side
            )
        except BaseException as e:  # handed to the training thread at its next save or wait
            self._result = e
        self.last_write_s = time.perf_counter() - t0

    @property
    def pending(self) -> bool:
        return self._thread is not None

    def wait(self) -> Path | None:
        """Block until the write in flight (if any) is complete; raise its failure (every rank fails alike)."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        result, self._result = self._result, None
        if isinstance(result, BaseException):
            raise result
        return result if self.dist.is_main else None

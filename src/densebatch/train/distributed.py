"""Processes working together: rank, world size and the collectives the training loop needs.

One process is the special case N = 1: ``Distributed()`` is a no-op context (sums are the value
itself, barriers return at once). Under ``torchrun`` (``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` in the
environment) ``Distributed.from_environment`` joins the process group (gloo on CPU, nccl on CUDA) on
PyTorch's own engine; every decision that ends a step, an epoch or the run is then taken from
all-reduced values, so all ranks agree without one of them deciding alone.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as tdist
from torch import Tensor, nn

from densebatch import torch_features
from densebatch.batch import Batch
from densebatch.errors import ConfigError
from densebatch.train.precision import AUTOCAST_DTYPES, resolve_precision


def check_device(name: str) -> None:
    """``ConfigError`` in one line when ``train.device`` names cuda on a machine or a torch build without it."""
    if name == "cuda" and not torch.cuda.is_available():
        why = (
            "no CUDA device is visible" if torch.backends.cuda.is_built() else f"torch {torch.__version__} is built without CUDA"
        )
        raise ConfigError(f"train.device: cuda is not available here ({why}); use auto or cpu")


@dataclass
class Distributed:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    initialized_here: bool = False  # this object started the process group (and tears it down)
    group: object = None  # the process group of the collectives below (None: the default one)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    # ---------------------------------------------------------------------- collectives
    def all_reduce(self, t: Tensor, op: str = "sum") -> Tensor:
        """``t`` reduced over ranks (a new tensor on ``t``'s device; the value itself for one process)."""
        if not self.enabled:
            return t
        out = t.detach().clone()
        op_ = {"sum": tdist.ReduceOp.SUM, "max": tdist.ReduceOp.MAX, "min": tdist.ReduceOp.MIN}[op]
        tdist.all_reduce(out, op=op_, group=self.group)
        return out

    def all_reduce_sum(self, t: Tensor) -> Tensor:
        return self.all_reduce(t, "sum")

    def barrier(self) -> None:
        if self.enabled:
            tdist.barrier(group=self.group)

    def broadcast_object(self, obj, src: int = 0):
        """``obj`` as rank ``src`` has it (a JSON-able value), on every rank."""
        if not self.enabled:
            return obj
        box = [obj]
        tdist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def gather_object(self, obj) -> list:
        """Every rank's ``obj`` (JSON-able), in rank order, on every rank."""
        if not self.enabled:
            return [obj]
        out: list = [None] * self.world_size
        tdist.all_gather_object(out, obj, group=self.group)
        return out

    def agree(self, flag: bool) -> bool:
        """True on every rank when any rank says True (e.g. a stop request that reached one rank)."""
        if not self.enabled:
            return flag
        return bool(self.all_reduce(torch.tensor([int(flag)], device=self.device), "max").item())

    def side_channel(self) -> Distributed:
        """The same ranks on a process group of their own (gloo, host objects only), for collectives run by
        a background thread (checkpoint writes) beside the training loop's: the order of collectives must
        match on every rank within each group, never across them. Every rank calls this, in the same order."""
        if not self.enabled:
            return self
        return replace(self, group=tdist.new_group(backend="gloo"), device=torch.device("cpu"), initialized_here=False)

    def close(self) -> None:
        if self.initialized_here and tdist.is_initialized():
            # What the run built (FSDP2's modules, a background writer's side channel) can outlive it in
            # reference cycles, holding process groups and Gloo work objects: destroyed only at interpreter
            # exit, their worker threads abort the process (SIGABRT, "terminate called without an active
            # exception", seen on one rank of a 3-process FSDP resume). Freed now, the groups go here.
            gc.collect()
            tdist.destroy_process_group()
            self.initialized_here = False

    # ---------------------------------------------------------------------------- set-up
    @staticmethod
    def launched() -> bool:
        """True when this process was started by torchrun (or another launcher setting the env)."""
        return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ

    @classmethod
    def from_environment(cls, device: str = "auto") -> Distributed:
        """Join the torchrun process group (or a one-process context when not launched)."""
        check_device(device)  # every rank, before any CUDA call: one line, not torch's traceback on each
        if not cls.launched():
            dev = torch.device(
                "cuda" if device == "auto" and torch.cuda.is_available() else "cpu" if device == "auto" else device
            )
            return cls(device=dev)
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", "0"))
        use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
        dev = torch.device("cuda", local) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(dev)
        here = False
        if not tdist.is_initialized():
            tdist.init_process_group(backend="nccl" if use_cuda else "gloo", device_id=dev if use_cuda else None)
            here = True
        return cls(rank=rank, world_size=world, local_rank=local, device=dev, initialized_here=here)


class TokenLosses(nn.Module):
    """``forward(batch) -> model.token_losses(batch)`` as a module call, so that wrappers whose work
    hangs on ``forward`` (DDP's gradient all-reduce, FSDP's all-gathers) see every training pass."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, batch: Batch) -> Tensor:
        return self.model.token_losses(batch)


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: the children of the largest ``nn.ModuleList`` (by parameter count)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        return []
    return list(max(lists, key=lambda m: sum(p.numel() for p in m.parameters())))


def wrap_model(model: nn.Module, mode: str, dist: Distributed, precision: str = "fp32") -> nn.Module:
    """The module every training pass goes through: ``TokenLosses(model)``, replicated with DDP or
    sharded with FSDP2 (``fully_shard`` on each block, then on the root) when there are several
    ranks. ``model`` must already be on ``dist.device`` (or, for FSDP, on the meta device, to be
    materialised shard by shard afterwards: ``train/meta_init.py``); build the optimizer afterwards
    (FSDP turns parameters into DTensor shards in place).

    ``precision`` (``train.precision``, ``auto`` resolved for the device): under FSDP2 in bf16 / fp16 the
    shards are all-gathered in that dtype (``MixedPrecisionPolicy(param_dtype=...)``: half the bytes of
    fp32) and gradients reduce-scattered in fp32 (``reduce_dtype``); the fp32 shards stay the master
    weights the optimizer updates."""
    forward = TokenLosses(model)
    if not dist.enabled:
        return forward
    if mode in ("auto", "ddp"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [dist.device.index] if dist.device.type == "cuda" else None
        return DDP(forward, device_ids=ids)
    if mode == "fsdp":
        torch_features.require(torch_features.fully_shard(), "FSDP2's fully_shard(mp_policy=)", "train.distributed: fsdp")
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        low = resolve_precision(dist.device, precision)
        # cast_forward_inputs off: the batch's only float tensor is loss_weights (train.source_balance), which must
        # reach the loss as the host's exact weights, not rounded to bf16 (the others are integer ids)
        policy = (
            MixedPrecisionPolicy(param_dtype=AUTOCAST_DTYPES[low], reduce_dtype=torch.float32, cast_forward_inputs=False)
            if low != "fp32"
            else None
        )
        kw = {"mp_policy": policy} if policy is not None else {}
        for block in repeated_blocks(model):
            fully_shard(block, **kw)
        fully_shard(forward, **kw)
        return forward
    raise ValueError(f"train.distributed: expected auto, ddp or fsdp; got {mode!r}")


@contextlib.contextmanager
def gradient_sync(forward: nn.Module, last: bool) -> Iterator[None]:
    """Gradients reduced over ranks on a step's last backward only: DDP's ``no_sync`` for the others;
    under FSDP2, ``set_requires_gradient_sync(False)`` for the others (unsharded gradients accumulate
    locally and are reduce-scattered once, at the last backward, instead of after every micro-batch)."""
    if last:
        yield
        return
    no_sync = getattr(forward, "no_sync", None)
    if no_sync is not None:
        with no_sync():
            yield
        return
    set_sync = getattr(forward, "set_requires_gradient_sync", None)
    if set_sync is None:
        yield
        return
    set_sync(False)
    try:
        yield
    finally:
        set_sync(True)

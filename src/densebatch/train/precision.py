"""Mixed precision and device moves, shared by training, evaluation, wrapping and the finders: autocast dtypes,
``train.precision`` resolved and checked for a device, TF32, and batches moved to the device.
"""

from __future__ import annotations

import contextlib

import torch

from densebatch import torch_features
from densebatch.batch import Batch
from densebatch.errors import ConfigError

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_precision(device: torch.device, precision: str) -> str:
    """``train.precision`` as this device runs it: ``auto`` is bf16 autocast on a CUDA device that
    supports it, fp32 elsewhere (CPU autocast is slower than fp32 there, and a GPU without bf16 would
    need fp16's loss scaling, a choice left to the user). Other values are checked and returned."""
    if precision == "auto":
        cuda_bf16 = device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return "bf16" if cuda_bf16 else "fp32"
    check_precision(device, precision)
    return precision


def allow_tf32(device: torch.device) -> bool:
    """On CUDA, let fp32 matrix products use TF32 tensor cores (what bf16 autocast leaves in fp32:
    the optimizer's and the loss head's own products); True when switched on."""
    if device.type != "cuda":
        return False
    torch_features.allow_tf32()  # the fp32_precision API where the release has it, never mixed with the legacy flags
    return True


def check_precision(device: torch.device, precision: str) -> None:
    """Refuse precisions the device cannot run, with a message saying what to use instead."""
    if precision not in ("fp32", "bf16", "fp16"):
        raise ConfigError(f"train.precision: expected auto, fp32, bf16 or fp16; got {precision!r}")
    # fp16 autocast on CPU is either unsupported or far slower than fp32, and loss scaling exists for
    # GPU tensor cores: refusing it is clearer than a silent slowdown.
    if precision == "fp16" and device.type != "cuda":
        raise ConfigError(f"train.precision: fp16 needs a CUDA device (this run uses {device.type}); use bf16 or fp32")
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("train.precision: this GPU has no bf16 support; use fp16 or fp32")


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """Mixed-precision context for the forward pass (a no-op in fp32; ``auto`` resolved for ``device``)."""
    precision = resolve_precision(device, precision)
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=AUTOCAST_DTYPES[precision])


def to_device(batch: Batch, device: torch.device) -> Batch:
    """Move a batch; asynchronous only when it can be (CUDA target, pinned source)."""
    if batch.input_ids.device == device:
        return batch
    non_blocking = device.type == "cuda" and batch.input_ids.is_pinned()
    return batch.to(device, non_blocking=non_blocking)

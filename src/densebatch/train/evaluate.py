"""Token-weighted evaluation loss and perplexity of a model over an iterable of ``Batch``.

The loss is ``sum(per-token cross-entropy) / (loss tokens)`` over the whole split, summed in float64,
so it does not depend on how documents were grouped into rows and batches (random, length-grouped,
token-budget or packed give the same number to ~1e-7 relative). Also home of the precision context
shared by training and evaluation (the lowest module that runs the model).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from densebatch.batch import Batch
from densebatch.errors import ConfigError

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_precision(device: torch.device, precision: str) -> None:
    """Refuse precisions the device cannot run, with a message saying what to use instead."""
    if precision not in ("fp32", "bf16", "fp16"):
        raise ConfigError(f"train.precision: expected fp32, bf16 or fp16; got {precision!r}")
    # fp16 autocast on CPU is either unsupported or far slower than fp32, and loss scaling exists for
    # GPU tensor cores: refusing it is clearer than a silent slowdown.
    if precision == "fp16" and device.type != "cuda":
        raise ConfigError(f"train.precision: fp16 needs a CUDA device (this run uses {device.type}); use bf16 or fp32")
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("train.precision: this GPU has no bf16 support; use fp16 or fp32")


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """Mixed-precision context for the forward pass (a no-op in fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=AUTOCAST_DTYPES[precision])


def to_device(batch: Batch, device: torch.device) -> Batch:
    """Move a batch; asynchronous only when it can be (CUDA target, pinned source)."""
    if batch.input_ids.device == device:
        return batch
    non_blocking = device.type == "cuda" and batch.input_ids.is_pinned()
    return batch.to(device, non_blocking=non_blocking)


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf  # exp overflows a float beyond ~709


@dataclass
class EvalResult:
    loss: float  # summed CE / tokens
    ppl: float
    tokens: int  # loss tokens
    real_tokens: int
    batches: int

    def as_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[Batch],
    *,
    device: torch.device | str | None = None,
    precision: str = "fp32",
    max_batches: int | None = None,
    all_reduce_sum: Callable[[Tensor], Tensor] | None = None,
    forward: Callable[[Batch], Tensor] | None = None,
) -> EvalResult:
    """Evaluate ``model.token_losses`` over ``batches`` (at most ``max_batches``) in eval mode.

    ``all_reduce_sum`` (identity by default) sums the (loss, tokens) totals over ranks, each rank
    evaluating its own shard (every rank must pass the same number of batches: FSDP gathers weights
    in each forward). ``forward`` replaces ``model.token_losses`` (the trainer passes its DDP / FSDP
    wrapper). The model's train/eval mode is restored afterwards.
    """
    forward = forward or model.token_losses
    if device is None:
        device = next(model.parameters()).device
    device = torch.device(device)
    was_training = model.training
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, loss tokens, real tokens
    n = 0
    try:
        for batch in batches:
            if max_batches is not None and n >= max_batches:
                break
            batch = to_device(batch, device)
            with autocast(device, precision):
                losses = forward(batch)  # (rows, T) float32, 0 where label == -100
            totals[0] += losses.double().sum()
            totals[1] += batch.num_loss_tokens
            totals[2] += batch.num_real_tokens
            n += 1
    finally:
        model.train(was_training)
    if all_reduce_sum is not None:
        totals = all_reduce_sum(totals)
    loss_sum, tokens, real = totals.tolist()
    loss = loss_sum / tokens if tokens > 0 else math.nan
    return EvalResult(
        loss=loss, ppl=perplexity(loss) if tokens > 0 else math.nan, tokens=int(tokens), real_tokens=int(real), batches=n
    )

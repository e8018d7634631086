"""The optimizer update of one step, the same for the training loop and the learning-rate range test.

``forward_backward`` has left the step's gradient in ``.grad`` (carrying the fp16 loss scale when it
is on). The update unscales it, clips it (the norm before clipping is returned for the guard and the
logs), lets the guard judge the step when there is one, and steps the optimizer or discards the
gradient. A step without loss tokens is empty: no update and no verdict.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from densebatch.train.guard import AnomalyGuard, Verdict, clip_gradients
from densebatch.train.state import StepOutcome


def apply_update(
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    params: Iterable[torch.Tensor],
    stats: dict,
    clipper,
    guard: AnomalyGuard | None,
) -> tuple[StepOutcome, float, float]:
    """(outcome, gradient norm before clipping, clip limit); ``guard`` None: every finite step is applied."""
    if stats["loss_tokens"] == 0:
        optimizer.zero_grad(set_to_none=True)
        return StepOutcome.EMPTY, math.nan, math.nan  # nothing to learn from: no update, no verdict
    scaler.unscale_(optimizer)  # clip and judge the true gradient, not the fp16-scaled one
    grad_norm, limit = clip_gradients(params, clipper=clipper)
    if scaler.is_enabled() and math.isfinite(stats["loss"]) and not math.isfinite(grad_norm):
        outcome = StepOutcome.OVERFLOW
    elif guard is None:
        outcome = StepOutcome.APPLIED
    else:
        verdict = guard.check(stats["loss"], grad_norm)
        outcome = {Verdict.OK: StepOutcome.APPLIED, Verdict.SKIP: StepOutcome.SKIPPED}.get(verdict, StepOutcome.ROLLBACK)
    if outcome in (StepOutcome.APPLIED, StepOutcome.OVERFLOW):
        scaler.step(optimizer)  # with fp16 it skips an update whose gradient overflowed
    else:
        optimizer.zero_grad(set_to_none=True)
    scaler.update()
    return outcome, grad_norm, limit

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

from densebatch.batch import Batch
from densebatch.train.guard import AnomalyGuard, Verdict, clip_gradients, gradient_norm
from densebatch.train.per_source import SourceLosses, by_source
from densebatch.train.state import StepOutcome


class StepStats(dict):
    """A step's loss and token counts over all ranks, read from the device at one point: ``read``.

    What only the device knows (the loss sum, the real and slot counts after the all-reduce, the sums per
    source, and under DDP / FSDP the step's loss tokens over ranks) is read back by ``read(norm)`` in one
    transfer, with the gradient norm appended: ``apply_update`` calls it, so a step reads the device once
    at its end. Before ``read`` only what the host knows is present (``batches``, ``oom_splits``, and
    ``loss_tokens`` on one process); looking up anything else is a ``KeyError`` that names ``read``, so
    no lookup synchronises by surprise. ``has_targets``: this rank's batches hold loss tokens, so the step
    is not empty (``is_empty`` reads the device only when this rank has none)."""

    def __init__(
        self,
        known: dict,
        *,
        sums: torch.Tensor,
        total: float | torch.Tensor,
        source_names: list[str] | None,
        by_source,
        has_targets: bool = False,
        entries=None,
    ):
        super().__init__(known)
        if not isinstance(total, torch.Tensor):
            self["loss_tokens"] = int(total)
        self.has_targets = has_targets
        self._pending = (sums, total, source_names, by_source)
        self._entries = entries  # (loss sum, the extra sums) -> entries that replace or add to the defaults

    @classmethod
    def gather(
        cls,
        batches: list[Batch],
        loss: torch.Tensor,
        *,
        splits: int,
        sources: SourceLosses | None,
        total,
        has_targets: bool,
        dist,
        extra: torch.Tensor | None = None,
        entries=None,
    ) -> StepStats:
        """The stats of a step whose passes summed ``loss`` (this rank's, on the device) over ``batches``: the
        loss sum, real tokens and slots (and the sums per source) all-reduced in one collective, left on the
        device until ``read``; ``total``: the step's loss tokens over ranks (a number, or a device tensor).
        ``extra``: more sums of an objective's (train/objectives/steps.py), all-reduced with the rest, which
        ``entries(loss sum, extra sums)`` turns into the entries that replace the loss or add to the stats."""
        real, slots = sum(b.num_real_tokens for b in batches), sum(b.num_slots for b in batches if not b.is_null)
        sums = torch.tensor([0.0, real, slots], dtype=torch.float64, device=loss.device)  # CE sum, real tokens, slots
        sums[0] = loss
        if sources is not None:  # per source: loss sums, then loss tokens (one all-reduce with the rest)
            sums = torch.cat([sums, sources.sums])
        if extra is not None:
            sums = torch.cat([sums, extra.to(sums)])
        return cls(
            {"batches": len(batches), "oom_splits": splits},
            sums=dist.all_reduce_sum(sums),
            total=total,
            source_names=sources.names if sources is not None else None,
            by_source=by_source,
            has_targets=has_targets,
            entries=entries,
        )

    def read(self, extra: torch.Tensor | None = None) -> float | None:
        """Fill in the device's values (with ``extra``, a one-element tensor, in the same transfer); ``extra``'s value."""
        if self._pending is None:
            return None if extra is None else float(extra)
        sums, total, names, by_source = self._pending
        self._pending = None
        on_device = isinstance(total, torch.Tensor)
        tail = [total.reshape(1).to(sums)] if on_device else []
        if extra is not None:
            tail.append(extra.detach().reshape(1).to(sums))
        values = torch.cat([sums, *tail]).tolist() if tail else sums.tolist()
        if on_device:
            total = values[len(sums)]
            self["loss_tokens"] = int(total)
        loss_sum, real, slots = values[:3]
        self.update({"loss": loss_sum / total if total > 0 else math.nan, "real_tokens": int(real), "slot_tokens": int(slots)})
        if names:
            self["loss_by_source"], self["loss_tokens_share_by_source"] = by_source(values[3 : 3 + 2 * len(names)], names)
        if self._entries is not None:
            self.update(self._entries(loss_sum, values[3 + 2 * len(names or ()) : len(sums)]))
        return values[-1] if extra is not None else None

    def is_empty(self) -> bool:
        """No loss tokens in the step, over every rank (``read`` from the device only when this rank has none)."""
        if self.has_targets:
            return False
        if "loss_tokens" not in self:
            self.read()
        return self["loss_tokens"] == 0

    def __missing__(self, key):
        if self._pending is not None:
            raise KeyError(f"{key!r}: a step's device values come with StepStats.read() (apply_update calls it)")
        raise KeyError(key)


def is_empty(stats: dict) -> bool:
    """The step has no loss tokens on any rank (a ``StepStats`` decides without reading the device when it can)."""
    return stats.is_empty() if isinstance(stats, StepStats) else stats["loss_tokens"] == 0


def apply_update(
    optimizer: torch.optim.Optimizer,
    *,
    scaler: torch.amp.GradScaler,
    params: Iterable[torch.Tensor],
    stats: dict,
    clipper,
    guard: AnomalyGuard | None,
) -> tuple[StepOutcome, float, float]:
    """(outcome, gradient norm before clipping, clip limit); ``guard`` None: every finite step is applied."""
    if is_empty(stats):
        optimizer.zero_grad(set_to_none=True)
        if isinstance(stats, StepStats):
            stats.read()
        return StepOutcome.EMPTY, math.nan, math.nan  # nothing to learn from: no update, no verdict
    scaler.unscale_(optimizer)  # clip and judge the true gradient, not the fp16-scaled one
    params = [p for p in params if p.grad is not None]
    total = gradient_norm(params)  # on the device
    norm = None
    if isinstance(stats, StepStats):  # the step's one read, the gradient norm with it
        norm = stats.read(total) if total is not None else stats.read()
    grad_norm, limit = clip_gradients(params, clipper=clipper, total=total, norm=norm)
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

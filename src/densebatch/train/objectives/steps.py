"""A preference objective inside the trainer: a step's passes, exact over micro-batches and ranks; its metrics; evaluation.

The loss of a step is ``sum(pair losses) / P + w x sum(chosen-sequence cross-entropy) / M`` over every pair
and target of the step on every rank (``P`` pairs, ``M`` such targets, both known on the host before the
step runs, summed over ranks in one all-reduce): a pair is never split across micro-batches or ranks (the
planner keeps it whole), so each batch computes its pairs' losses in full and adds its share, and the
gradient is the same however the step's pairs are split (DDP and FSDP average over ranks: each share is
scaled by the world size). Metrics are TRL's names, means over the step's (or the evaluation's) pairs:
``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies`` (chosen's reward above rejected's),
``rewards/margins``, ``logps/chosen``, ``logps/rejected``; and ``pairs``, their count.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from densebatch.batch import Batch
from densebatch.train.objectives.losses import Objective
from densebatch.train.objectives.pair_logps import chosen_sequence_nll, chosen_sequence_targets, pair_logps
from densebatch.train.objectives.reference import LiveReference, reference_of
from densebatch.train.passes import accumulate
from densebatch.train.precision import autocast, to_device
from densebatch.train.update import StepStats

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected")
# the sums behind METRICS, then the pair count: what a pass reports besides its loss
_SUMS = len(METRICS) + 1


def metric_sums(pl) -> Tensor:
    """(len(METRICS) + 1,) float64 sums over a batch's pairs (``losses.PairLosses``), then the pairs."""
    c, r = pl.chosen_rewards.double(), pl.rejected_rewards.double()
    return torch.stack(
        [c.sum(), r.sum(), (c > r).double().sum(), (c - r).sum(), pl.logps[:, 0].double().sum(), pl.logps[:, 1].double().sum(),
         c.new_tensor(float(c.numel()))]
    )  # fmt: skip


def metrics_of(sums: list[float]) -> dict:
    """The METRICS (means over the pairs) and ``pairs`` from ``metric_sums`` added up."""
    n = sums[-1]
    out = {name: (s / n if n else math.nan) for name, s in zip(METRICS, sums)}
    return out | {"pairs": int(n)}


class PreferenceSteps:
    """What the trainer hands a step and an evaluation to under a preference objective (``StepParts.objective``)."""

    def __init__(self, objective: Objective, live: LiveReference | None = None):
        self.objective, self.live = objective, live

    def _scales(self, batches: list[Batch], dist, device) -> tuple:
        """(what a pass's summed pair losses are multiplied by, what its chosen-sequence CE is, this rank's loss
        tokens, the step's over ranks): the step's pairs and CE targets over all ranks, times the world size."""
        pairs = float(sum(b.pairs.count for b in batches if b.pairs is not None))
        nll = float(sum(chosen_sequence_targets(b, self.objective.prompt_targets) for b in batches))
        tokens = float(sum(b.num_loss_tokens for b in batches))
        if not dist.enabled:
            return 1.0 / max(pairs, 1.0), 1.0 / max(nll, 1.0), tokens, tokens
        both = dist.all_reduce_sum(torch.tensor([pairs, nll, tokens], dtype=torch.float64, device=device))
        world = float(dist.world_size)
        return (world / both[0].clamp(min=1.0)).float(), (world / both[1].clamp(min=1.0)).float(), tokens, both[2]

    def pass_loss(self, forward, batch: Batch, scales) -> tuple[Tensor, Tensor]:
        """(this batch's share of the step's loss, to back-propagate; what it reports: its share of the loss
        over ranks, then its metric sums). ``batch`` is on the device, inside the pass's autocast."""
        losses = forward(batch)  # (rows, T) float32 cross-entropy of every target
        policy = pair_logps(losses, batch)
        o = self.objective
        ref = reference_of(batch, self.live) if o.needs_reference and batch.pairs is not None and batch.pairs.count else None
        pl = o.pair_losses(policy, ref)
        loss = pl.losses.sum() * scales[0]
        if o.nll_weight:
            loss = loss + o.nll_weight * chosen_sequence_nll(losses, batch) * scales[1]
        loss = loss + 0.0 * losses.sum()  # a batch without pairs still joins the backward (an idle rank)
        world = scales[2]
        return loss, torch.cat([(loss.detach().double() / world).reshape(1), metric_sums(pl)])

    def forward_backward(self, trainer, batches: Iterable[Batch]) -> StepStats:
        """The trainer's ``forward_backward`` under this objective: the step's gradient in ``.grad``, its stats."""
        batches = list(batches)
        dist, device = trainer.dist, trainer.device
        per_pair, per_target, local, total = self._scales(batches, dist, device)
        scales = (per_pair, per_target, float(dist.world_size))
        p = trainer.passes()
        passes = dataclasses.replace(p, loss_of=lambda b: self.pass_loss(p.forward, b, scales), source_losses=None)
        report, splits = accumulate(passes, batches, 1.0)
        return StepStats.gather(
            batches, report[0], splits=splits, sources=None, total=total, has_targets=local > 0, dist=dist,
            extra=report[1:], entries=lambda loss, sums: {"loss": loss, "record": metrics_of(sums)} | metrics_of(sums),
        )  # fmt: skip

    @torch.no_grad()
    def evaluate(self, trainer, batches: Iterable[Batch], max_batches: int | None = None) -> PairEval:
        """The objective's loss and metrics over ``batches`` (this rank's share; summed over ranks), eval mode."""
        model, device, o = trainer.model, trainer.device, self.objective
        sums = torch.zeros(5 + _SUMS, dtype=torch.float64, device=device)  # pair losses, CE, its targets, tokens, then metrics
        was = model.training
        model.eval()
        n = 0
        try:
            for batch in batches:
                if max_batches is not None and n >= max_batches:
                    break
                n += 1
                batch = to_device(batch, device)
                with autocast(device, trainer.precision):
                    losses = trainer.forward(batch)
                if batch.pairs is None or batch.pairs.count == 0:
                    continue
                policy = pair_logps(losses, batch)
                pl = o.pair_losses(policy, reference_of(batch, self.live) if o.needs_reference else None)
                sums[0] += pl.losses.double().sum()
                sums[1] += chosen_sequence_nll(losses, batch).double()
                sums[2] += chosen_sequence_targets(batch, o.prompt_targets)
                sums[3] += batch.num_real_tokens
                sums[4] += batch.num_loss_tokens
                sums[5:] += metric_sums(pl)
        finally:
            model.train(was)
        if trainer.dist.enabled:
            sums = trainer.dist.all_reduce_sum(sums)
        v = sums.tolist()
        pairs = v[-1]
        loss = v[0] / pairs + (o.nll_weight * v[1] / v[2] if o.nll_weight and v[2] else 0.0) if pairs else math.nan
        return PairEval(loss=loss, tokens=int(v[4]), real_tokens=int(v[3]), batches=n, metrics=metrics_of(v[5:]))


@dataclass
class PairEval:
    """An evaluation under a preference objective (what the eval record holds: ``as_dict``)."""

    loss: float  # the objective's loss over every held-out pair
    tokens: int  # loss tokens (the answers' targets)
    real_tokens: int
    batches: int
    metrics: dict

    def as_dict(self) -> dict:
        return {
            "loss": self.loss,
            "tokens": self.tokens,
            "real_tokens": self.real_tokens,
            "batches": self.batches,
            **self.metrics,
        }

"""Per-source weighting and accounting of a step's loss tokens: the sources' weights in the gradient, and the loss per source.

The weights (``train.source_balance``) come from ``data/plan/source_balance.py``'s factors.

A step back-propagates ``sum(w[source] * token CE) / sum(w[source])`` over its loss tokens on every
rank: a weighted mean, exact however the step is split into batches and ranks, as the plain mean is
(every w = 1 is the plain mean). The denominator is known on the host before the step runs (the
batches' ``source_ids`` at their loss positions), so weighting costs one multiply on the device.
Reported losses stay plain means over loss tokens, so runs with and without weights compare: with two
or more sources each step and each evaluation also reports the loss of every source (``SourceLosses``,
``source_sums``, ``by_source``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
from torch import Tensor

from densebatch.batch import IGNORE_INDEX, Batch
from densebatch.train.distributed import Distributed


class SourceWeights:
    """One weight per source: ``host`` (float64, for the step's denominator) and ``on(device)`` (float32,
    for the losses; copied over once per device). ``in_model``: the model weighs its own losses
    (``weighs_losses``: it returns ``batch.loss_weights`` x CE, and its fused head weighs the gradient
    it computes in the forward pass, so nothing is recomputed)."""

    def __init__(self, weights: Sequence[float], in_model: bool = False) -> None:
        if any(not float(w) > 0 for w in weights):
            raise ValueError(f"source weights must be > 0; got {list(weights)}")
        self.host = torch.tensor([float(w) for w in weights], dtype=torch.float64)
        self.in_model = in_model
        self._device: dict[torch.device, Tensor] = {}

    def on(self, device: torch.device) -> Tensor:
        if device not in self._device:
            self._device[device] = self.host.to(device, torch.float32)
        return self._device[device]

    def loss_tokens(self, batch: Batch) -> float:
        """Sum of the weights over ``batch``'s loss tokens (its loss tokens without ``source_ids``)."""
        if batch.source_ids is None or batch.num_loss_tokens == 0:
            return float(batch.num_loss_tokens)
        return float(self.host[batch.source_ids[batch.labels != IGNORE_INDEX].cpu()].sum())


def step_loss_tokens(batches: Sequence[Batch], weights: SourceWeights | None) -> tuple[float, float]:
    """(loss tokens, their summed weight) of a step's batches on this rank."""
    count = float(sum(b.num_loss_tokens for b in batches))
    return count, count if weights is None else sum(weights.loss_tokens(b) for b in batches)


def step_denominator(
    batches: Sequence[Batch], weights: SourceWeights | None, dist: Distributed, device: torch.device
) -> tuple[float, float | Tensor, float | Tensor]:
    """(this rank's loss tokens; the step's over all ranks; what each batch's summed loss is divided by).

    The normaliser is known on the host: the step's loss tokens, weighted by source when there are weights.
    DDP and FSDP average gradients over ranks; dividing by total / world_size makes that sum / total. Under
    torchrun the counts over ranks stay on the device, read with the step's stats."""
    local, weight = step_loss_tokens(batches, weights)
    total: float | Tensor = local
    denom: float | Tensor = weight if weight > 0 else 1.0
    if dist.enabled:
        both = dist.all_reduce_sum(torch.tensor([local, weight], dtype=torch.float64, device=device))
        total, denom = both[0], torch.where(both[1] > 0, both[1] / dist.world_size, 1.0).float()
    return local, total, denom


def weighted_losses(forward: Callable[[Batch], Tensor], batch: Batch, weights: SourceWeights | None) -> tuple[Tensor, Tensor]:
    """(``sum(weight[source] x CE)`` to back-propagate, the plain per-token CE (rows, T) to report) of one
    pass of ``batch`` (on its device) through ``forward``."""
    if weights is None or batch.source_ids is None:
        losses = forward(batch)
        return losses.float().sum(), losses
    per = weights.on(batch.source_ids.device)[batch.source_ids.clamp(min=0)]  # (rows, T); padding's CE is 0
    if weights.in_model:
        losses = forward(replace(batch, loss_weights=per))  # weight x CE
        return losses.float().sum(), losses.detach() / per
    losses = forward(batch)
    return (losses.float() * per).sum(), losses


def source_sums(batch: Batch, losses: Tensor, num_sources: int) -> Tensor:
    """Per-source loss sums and loss-token counts of one batch: ``(2 * num_sources,)`` float64,
    sums first. Exact over each source's targets (positions whose label is not -100); zeros for a
    batch without ``source_ids`` (a null batch)."""
    out = torch.zeros(2 * num_sources, dtype=torch.float64, device=losses.device)
    if batch.source_ids is None or num_sources == 0:
        return out
    keep = batch.labels != IGNORE_INDEX  # (rows, T)
    src = batch.source_ids[keep]  # (n,)
    out[:num_sources] = torch.bincount(src, weights=losses.detach()[keep].double(), minlength=num_sources)
    out[num_sources:] = torch.bincount(src, minlength=num_sources).double()
    return out


def by_source(sums: list[float], names: list[str]) -> tuple[dict[str, float | None], dict[str, float]]:
    """(loss per source, share of the loss tokens per source) from all-reduced ``source_sums``."""
    k = len(names)
    total = sum(sums[k:]) or 1.0
    loss = {n: (sums[i] / sums[k + i] if sums[k + i] > 0 else None) for i, n in enumerate(names)}
    return loss, {n: sums[k + i] / total for i, n in enumerate(names)}


class SourceLosses:
    """One step's loss sums and loss tokens per source (two or more sources): ``sums``, ``(2 * k,)`` float64
    on the device, sums first, added pass by pass (``add``) and zeroed when the step's passes are replayed
    (``zero``); the trainer all-reduces them with the step's other sums and reads them with ``by_source``."""

    def __init__(self, names: list[str], device: torch.device) -> None:
        self.names = names
        self.sums = torch.zeros(2 * len(names), dtype=torch.float64, device=device)

    def zero(self) -> None:
        self.sums.zero_()

    def add(self, batch: Batch, losses: Tensor) -> None:
        self.sums += source_sums(batch, losses, len(self.names))

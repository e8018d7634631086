"""Each source's weight of its loss tokens in the gradient (``train.source_balance``; the factors come
from ``data/plan/source_balance.py``).

A step back-propagates ``sum(w[source] * token CE) / sum(w[source])`` over its loss tokens on every
rank: a weighted mean, exact however the step is split into batches and ranks, as the plain mean is
(every w = 1 is the plain mean). The denominator is known on the host before the step runs (the
batches' ``source_ids`` at their loss positions), so weighting costs one multiply on the device.
Reported losses stay plain means over loss tokens, so runs with and without weights compare.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
from torch import Tensor

from densebatch.batch import IGNORE_INDEX, Batch


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

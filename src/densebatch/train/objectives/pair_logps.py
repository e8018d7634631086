"""Each pair's summed log-probabilities, from a batch's per-token cross-entropies and its pairs' layout.

A model's ``token_losses(batch)`` is the cross-entropy of each target (0 elsewhere), so a target's
log-probability is its negative. ``Batch.pairs.answer`` names the pair and side of each answer target
(2k chosen, 2k + 1 rejected), so a pair's summed log-probability of an answer is one ``index_add`` over
the batch, whatever the layout (padded, packed, prompt once or twice): the same targets, at the same
positions, under the same attention. Counts are the answers' targets, for the objectives that average
(SimPO and ORPO, as TRL's ``average_log_prob``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from densebatch.batch import Batch


@dataclass
class PairLogps:
    sums: Tensor  # (pairs, 2) float32: summed log-probabilities of (chosen, rejected)
    counts: Tensor  # (pairs, 2) float32: their targets

    @property
    def chosen(self) -> Tensor:
        return self.sums[:, 0]

    @property
    def rejected(self) -> Tensor:
        return self.sums[:, 1]

    def means(self) -> Tensor:
        """(pairs, 2): the average log-probability of a target of each answer."""
        return self.sums / self.counts.clamp(min=1)


def pair_logps(losses: Tensor, batch: Batch) -> PairLogps:
    """``losses`` (rows, T), the per-token cross-entropy of ``batch`` (on its device): each pair's sums."""
    pairs = batch.pairs
    n = 0 if pairs is None else pairs.count
    if n == 0:
        empty = losses.new_zeros((0, 2), dtype=torch.float32)
        return PairLogps(empty, empty)
    slot = pairs.answer.reshape(-1)  # (rows * T,)
    keep = slot >= 0
    idx = slot[keep]
    sums = torch.zeros(2 * n, dtype=torch.float32, device=losses.device).index_add(0, idx, -losses.reshape(-1)[keep].float())
    counts = torch.zeros(2 * n, dtype=torch.float32, device=losses.device).index_add(
        0, idx, torch.ones_like(idx, dtype=torch.float32)
    )
    return PairLogps(sums.view(n, 2), counts.view(n, 2))


def chosen_sequence_nll(losses: Tensor, batch: Batch) -> Tensor:
    """The summed cross-entropy of the chosen sequences' targets (the chosen answers', and the prompts' when
    the batch labels them: ORPO's negative log-likelihood term, CPO's without the prompt). (scalar)"""
    pairs = batch.pairs
    if pairs is None:
        return losses.sum() * 0.0
    keep = (pairs.answer >= 0) & (pairs.answer % 2 == 0)
    if pairs.prompt is not None:
        keep = keep | (pairs.prompt >= 0)
    return (losses.float() * keep).sum()


def chosen_sequence_targets(batch: Batch, with_prompt: bool) -> int:
    """How many targets ``chosen_sequence_nll`` sums over in ``batch`` (on the host, before the step runs)."""
    pairs = batch.pairs
    if pairs is None:
        return 0
    n = int(((pairs.answer >= 0) & (pairs.answer % 2 == 0)).sum())
    if with_prompt and pairs.prompt is not None:
        n += int((pairs.prompt >= 0).sum())
    return n

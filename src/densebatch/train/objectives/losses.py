"""The preference objectives' losses per pair, as TRL defines them (its trainers' code, not re-derived).

A step's loss is ``sum(pair losses) / pairs + nll_weight x sum(chosen-sequence cross-entropy) / its targets``,
each sum over the whole step (``steps.py``), which on one batch is TRL's ``losses.mean() + alpha x nll``:

- ``dpo``: TRL's ``DPOTrainer`` ``loss_type="sigmoid"``: ``-logsigmoid(beta x delta)`` with
  ``delta = (chosen - ref_chosen) - (rejected - ref_rejected)`` of summed log-probabilities; with
  ``label_smoothing`` e, conservative DPO: ``-(1 - e) logsigmoid(beta delta) - e logsigmoid(-beta delta)`` (the
  form TRL's ``aot`` and CPO losses keep; TRL 1.x's DPO sigmoid no longer reads label_smoothing). Rewards:
  ``beta x (logp - ref_logp)``.
- ``simpo``: TRL's ``CPOTrainer`` ``loss_type="simpo"``: average log-probabilities, ``delta = chosen - rejected -
  gamma / beta``, the same (conservative) sigmoid loss; ``cpo_alpha`` x the chosen answers' cross-entropy.
  Rewards: ``beta x average logp``. No reference model.
- ``orpo``: TRL's ``ORPOTrainer``: ``log_odds = (c - r) - (log1mexp(c) - log1mexp(r))`` of average
  log-probabilities, loss ``-beta x logsigmoid(log_odds)``, plus the chosen sequence's cross-entropy (prompt and
  answer, as TRL's). Rewards: ``beta x average logp``. No reference model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from densebatch.train.objectives.pair_logps import PairLogps


@dataclass(frozen=True)
class PairLosses:
    losses: Tensor  # (pairs,)
    chosen_rewards: Tensor  # (pairs,) detached
    rejected_rewards: Tensor  # (pairs,) detached
    logps: Tensor  # (pairs, 2) detached: what TRL logs as logps/chosen, logps/rejected


def log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x < 0, stable on both sides of -ln 2 (as TRL's ORPO computes it)."""
    t = -0.6931471805599453
    return torch.where(x < t, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def _sigmoid_loss(z: Tensor, eps: float) -> Tensor:
    """``-logsigmoid(z)``, conservative with ``eps`` (the share of preferences taken to be flipped)."""
    loss = -F.logsigmoid(z)
    return loss if not eps else (1 - eps) * loss - eps * F.logsigmoid(-z)


class Objective:
    """One preference objective: its name (``train.objective``), what it reads, its loss per pair."""

    name: str
    needs_reference = False  # the reference model's log-probabilities of every pair
    prompt_targets = False  # the prompts carry targets (the chosen sequence's cross-entropy covers them)

    def __init__(self, *, beta: float, label_smoothing: float = 0.0, simpo_gamma: float = 0.5, cpo_alpha: float = 0.0):
        self.beta, self.label_smoothing, self.simpo_gamma, self.cpo_alpha = beta, label_smoothing, simpo_gamma, cpo_alpha

    @property
    def nll_weight(self) -> float:
        """Weight of the chosen sequences' cross-entropy (over its targets) added to the mean pair loss."""
        return 0.0

    def pair_losses(self, policy: PairLogps, reference: Tensor | None) -> PairLosses:
        raise NotImplementedError


class DPO(Objective):
    name = "dpo"
    needs_reference = True

    def pair_losses(self, policy: PairLogps, reference: Tensor | None) -> PairLosses:
        assert reference is not None, "dpo needs the reference's log-probabilities"
        ratios = policy.sums - reference.to(policy.sums)  # (pairs, 2): log-ratio of chosen, rejected
        delta = ratios[:, 0] - ratios[:, 1]
        rewards = self.beta * ratios.detach()
        return PairLosses(
            _sigmoid_loss(self.beta * delta, self.label_smoothing), rewards[:, 0], rewards[:, 1], policy.sums.detach()
        )


class SimPO(Objective):
    name = "simpo"

    @property
    def nll_weight(self) -> float:
        return self.cpo_alpha

    def pair_losses(self, policy: PairLogps, reference: Tensor | None) -> PairLosses:
        avg = policy.means()
        z = self.beta * ((avg[:, 0] - avg[:, 1]) - self.simpo_gamma / self.beta)
        rewards = self.beta * avg.detach()
        return PairLosses(_sigmoid_loss(z, self.label_smoothing), rewards[:, 0], rewards[:, 1], avg.detach())


class ORPO(Objective):
    name = "orpo"
    prompt_targets = True  # TRL's ORPO: the chosen sequence's cross-entropy covers the prompt and the answer

    @property
    def nll_weight(self) -> float:
        return 1.0

    def pair_losses(self, policy: PairLogps, reference: Tensor | None) -> PairLosses:
        avg = policy.means().float()
        log_odds = (avg[:, 0] - avg[:, 1]) - (log1mexp(avg[:, 0]) - log1mexp(avg[:, 1]))
        rewards = self.beta * avg.detach()
        return PairLosses(-self.beta * F.logsigmoid(log_odds), rewards[:, 0], rewards[:, 1], avg.detach())


OBJECTIVES: dict[str, type[Objective]] = {o.name: o for o in (DPO, SimPO, ORPO)}


def objective_from_config(cfg) -> Objective | None:
    """The preference objective a ``TrainConfig`` names (None for sft, the loop's own loss)."""
    if cfg.objective == "sft":
        return None
    return OBJECTIVES[cfg.objective](
        beta=cfg.beta, label_smoothing=cfg.label_smoothing, simpo_gamma=cfg.simpo_gamma, cpo_alpha=cfg.cpo_alpha
    )

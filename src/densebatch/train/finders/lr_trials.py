"""Short trials after the range test (``finder.trials``, ``densebatch find-lr --trials N``): for a model
far from its task, where the range test's curve cannot tell which rate trains best.

The range test reads a learning rate off the loss of ~100 steps at growing rates. Near its task that
works (docs/finders.md: within 10% of the best of three grids); far from it (a new task, a model at
chance on its answers) the best rate of a whole run is not where the curve says: a rate that makes the
loss fall fastest in a few steps is not the one that learns the task best by the end. So the trials
ask the question the grid asks, in small: ``N`` rates around the range test's suggestion (a ladder of
factors of 3: for 3 trials, suggestion / 3, x 1, x 3; ties go to the lower rate), each trained from
the same initial weights for ``finder.trial_steps`` steps (default: a quarter of ``train.max_steps``,
at least 10) under the run's own schedule fitted to that length (``trial_config``: the run's warm-up
steps and its layer groups' own, each at most half the trial, then the same decay to ``min_lr_ratio``), then scored by the held-out loss (the eval data, ``eval.max_batches``
of it; without eval data, ``finder.heldout_batches`` (at least 2) batches of the first training step,
whose documents no trial trains on). Without eval data, turning trials on also gives the range test
these held-out batches (and so its held-out curve, which its near-task rule reads), so its own
suggestion may differ from a test without trials.

*Which models get trials*: those at or below chance on the task (the range test's first loss at most
``CONFIDENT`` x ln(vocabulary); a uniform guess scores 1x). There the range test errs low (a model that
learns the task inside the test reads a low rate) and the trials fix it. A model confidently wrong on
its task (above ``CONFIDENT`` x: it answers its old tasks' words) keeps the range test's rate unless
``finder.trials_always``: on every grid of docs/finders.md of that kind the range test's own rate did as
well as the trials or better (the trials there prefer the rate that unlearns the old answers fastest, a
factor 3 above the one that learns the new task best). The seven grids the rule was chosen on start
at 0.5x to 1.01x (upper, key, Shakespeare) or at 2.2x to 2.4x (parity, color, two): any factor
between splits them alike, and 1.5 is the middle, not a fit.

*The warm-up* keeps its length in steps, not its share of the run: it steadies the optimizer's first
updates (Adam's moment estimates start from nothing), and a shorter run needs as many of them. Squeezed
to its share (2-3 steps of a 25-step trial for a run's 10 of 100), a high rate overshot in the trial
where the whole run did not, and the trials leaned low: on docs/finders.md's ``finetune-upper2`` their
25-step winner sat a factor 2-5 below the whole runs' best on every seed.

Two steps then read the trials as a search rather than a vote. *Bracketing* (``next_rate``): while
the lowest held-out loss is at an end of the rates tried, the next rung beyond that end is trained
too, up to ``MAX_EXTRA`` more (the range test may be a factor 10 off: a model that learns the task
inside the test reads a low rate). *The ceiling*, when trials run for a model confidently wrong
(``finder.trials_always``) or one whose vocabulary is unknown: no trial runs above the rate where the
range test's smoothed loss was lowest (its ``minimum``; the suggestion itself when that is higher).
Past that rate ~100 steps of growing rates stopped lowering the loss, and a short trial, which anneals
before the instability of a high rate shows, can still favour it: on docs/finders.md's
``finetune-color`` grid (starting loss 16, 2.3x ln 1024) 25-step trials preferred 2e-2, twice the
range test's minimum, on two seeds of five, and whole runs there ended 1.5-2x above the grid's best.
For a model at or below chance there is no ceiling: the range test's minimum is where the test learned
the task inside itself, not a limit (``finetune-upper``, starting at 3.5 = 0.5x ln 1024, is best at 3x
its minimum). *The vertex* (``refine``): the rungs are a factor 3 apart and a
run's best rate rarely sits on one, so the suggestion is the vertex of the parabola, in log rate,
through the best trial and its two neighbours (within half a rung of the best; the best trial's own
rate when it is at an end or a neighbour diverged).

Cost: ``N x trial_steps`` optimizer steps and ``N`` evaluations on top of the range test, up to
``N + MAX_EXTRA`` of each when bracketing: with 3 trials of a quarter each, 0.75 to 1.25 runs again.
Trials of half the run (``trial_steps``) cost twice that and were not better on the grids of
docs/finders.md (better on one, worse on another). Like the range test, the trials leave no trace
(``TrainerSnapshot``): the run that follows is bit for bit the one that would have run with the
chosen rate given.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from densebatch.config import FinderConfig, TrainConfig
from densebatch.errors import UserError
from densebatch.train.contracts import TrainerHost
from densebatch.train.optim import LAYER_GROUPS, set_lrs
from densebatch.train.update import is_empty

LADDER = 3.0  # the factor between neighbouring trial rates
MAX_EXTRA = 2  # rungs bracketing may add beyond finder.trials
CONFIDENT = 1.5  # a range test starting above this many times ln(vocabulary): no trials (the model is confidently wrong)


@dataclass
class Trial:
    lr: float
    heldout_loss: float
    steps: int

    @property
    def scored(self) -> bool:
        """It took steps and ended with a finite held-out loss (a rate that blew up did not)."""
        return bool(self.steps) and math.isfinite(self.heldout_loss)


def trial_rates(suggested: float, n: int) -> list[float]:
    """``n`` rates around ``suggested``, a factor ``LADDER`` apart (one below it for 2 or 3, more above
    for larger ``n``: a range test far from its task errs low, docs/finders.md)."""
    below = min(1, n - 1)
    return [suggested * LADDER ** (j - below) for j in range(n)]


def vocabulary(model) -> int | None:
    """The model's output vocabulary: its ``vocab_size`` (densebatch's models: the reference GPT and the
    Hugging Face wrapper), else a transformers model's ``config``'s; None when it does not say."""
    cfg = getattr(model, "config", None)
    for owner in (model, cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg):
        size = getattr(owner, "vocab_size", None)
        if isinstance(size, int) and size > 1:
            return size
    return None


def confidently_wrong(start_loss: float, vocab: int | None) -> bool | None:
    """The range test's first loss is above ``CONFIDENT`` x ln(``vocab``) (a uniform guess scores 1x): the
    model answers its task with confidence, wrongly. None when the vocabulary or the start is unknown."""
    if vocab is None or not math.isfinite(start_loss):
        return None
    return start_loss > CONFIDENT * math.log(vocab)


def _line(vocab: int) -> str:
    """The confidence line in the rule's words: ``CONFIDENT`` x ln(``vocab``) and its value."""
    return f"{CONFIDENT:g} x ln({vocab}) = {CONFIDENT * math.log(vocab):.3g}"


def skipped(start_loss: float, vocab: int) -> str:
    """The rule's words when ``finder.trials`` is skipped for a model ``confidently_wrong``."""
    return (
        f"short trials skipped: the model starts confidently wrong on its task (loss {start_loss:.3g}, above "
        f"{_line(vocab)}), where the range test's own rate did as well or better on the grids of docs/finders.md; "
        "finder.trials_always: true runs them"
    )


def trial_ceiling(minimum: float, suggested: float, start_loss: float, vocab: int | None) -> tuple[float, str]:
    """The rate no trial runs above, and the rule's words for it: the range test's ``minimum`` (never below
    ``suggested``) when the test started above ``CONFIDENT`` x ln(``vocab``), or ``vocab`` is unknown;
    else none (``inf``): a model at or below chance on its task."""
    if confidently_wrong(start_loss, vocab) is False:
        return math.inf, f"no ceiling: the range test started at loss {start_loss:.3g}, not above {_line(vocab)}"
    top = max(minimum, suggested)
    return top, f"none above {top:.3g}, where the range test's loss was lowest"


def trial_steps(finder: FinderConfig, max_steps: int | None) -> int:
    """Steps per trial: ``finder.trial_steps``, else a quarter of ``train.max_steps`` (at least 10; 25
    without a step limit)."""
    if finder.trial_steps:
        return finder.trial_steps
    return max(10, (max_steps or 100) // 4)


def trial_config(cfg: TrainConfig, n: int) -> TrainConfig:
    """The run's schedule fitted to a trial of ``n`` steps: the same decay over ``n`` steps, and every
    warm-up (``train.warmup_steps`` and each layer group's own, ``train.<group>.warmup_steps``) kept
    in steps, at most half the trial."""
    fit = lambda w: None if w is None else min(w, n // 2)  # noqa: E731
    groups = {g: dataclasses.replace(getattr(cfg, g), warmup_steps=fit(getattr(cfg, g).warmup_steps)) for g in LAYER_GROUPS}
    return dataclasses.replace(cfg, warmup_steps=fit(cfg.warmup_steps or 0), max_steps=n, **groups)


def run_trials(
    trainer: TrainerHost,
    finder: FinderConfig,
    suggested: float,
    snapshot,
    heldout: list,
    log: Callable[[str], None] | None = None,
    ceiling: float = math.inf,
) -> list[Trial]:
    """Train each of ``trial_rates(suggested, finder.trials)`` up to ``ceiling`` (``trial_ceiling``; never
    below ``suggested``) for ``trial_steps`` steps from the state in ``snapshot`` (a
    ``TrainerSnapshot``, restored after each trial), then the rungs bracketing adds, and score each by the
    held-out loss: the eval data when there are some, else ``heldout`` (batches of the first training
    step, which the trials then skip, as the range test does)."""
    n = trial_steps(finder, trainer.cfg.max_steps)
    base = trial_config(trainer.cfg, n)
    if trainer.eval_data is None and not heldout:
        raise UserError("finder.trials: no held-out data to score the trials on: set data.eval_fraction > 0 or data.eval_path")
    # Without eval data the held-out batches are the first training step's documents: no trial trains on them,
    # in any epoch (the data cycle when a trial is longer than an epoch).
    held_docs = set() if trainer.eval_data is not None else {d for b in heldout for d in b.documents}
    data = trainer.data
    held_out = (lambda step: any(held_docs.intersection(b.documents) for b in step.batches)) if held_docs else None

    def trial(rate: float) -> Trial:
        cfg = dataclasses.replace(base, lr=rate)
        data.set_step_fraction(None)  # full-size steps, as the range test takes them
        data.max_epochs = None  # cycle the data: a trial may need more steps than an epoch holds
        trainer.model.train()
        with contextlib.closing(iter(data)) as it:
            taken = 0
            while taken < n:
                rates = lambda k=taken, c=cfg: set_lrs(trainer.optimizer, step=k, cfg=c, total_steps=n)  # noqa: E731
                if one_update(trainer, it, rates, skip=held_out) is None:  # the run's clipper, no guard
                    break
                taken += 1
        loss = _heldout_loss(trainer, heldout)
        if log is not None:
            log(f"  trial at lr {rate:.3g}: {taken} steps, held-out loss {loss:.4f}")
        snapshot.restore(trainer)
        return Trial(rate, loss, taken)

    try:
        return search(trial, suggested, finder.trials, ceiling)
    finally:
        snapshot.restore(trainer)


def search(trial: Callable[[float], Trial], suggested: float, n: int, ceiling: float = math.inf) -> list[Trial]:
    """The rates the trials try, in order: ``trial_rates(suggested, n)`` up to ``ceiling`` (never below
    ``suggested``), then one rung at a time while ``next_rate`` asks for one; ``trial(rate)`` runs each."""
    ceiling = max(ceiling, suggested)
    trials: list[Trial] = []
    rates = [r for r in trial_rates(suggested, n) if not above(r, ceiling)]
    while rates:
        trials += [trial(rate) for rate in rates]
        rates = [r] if (r := next_rate(trials, n, ceiling)) is not None else []
    return trials


def above(rate: float, ceiling: float) -> bool:
    """``rate`` is past ``ceiling`` (by more than float rounding: a rung computed as x / 3 * 3 is not)."""
    return rate > ceiling * (1 + 1e-6)


def next_rate(trials: list[Trial], n: int, ceiling: float = math.inf) -> float | None:
    """Bracketing: when the trial with the lowest held-out loss is at an end of the rates tried (the
    highest, or the lowest), the next rung of the ladder beyond it, until ``MAX_EXTRA`` rungs were added to
    the first ``n``; else None (the best has a worse trial on either side, the next rung up is above
    ``ceiling``, or the budget is spent)."""
    if len(trials) >= n + MAX_EXTRA or sum(t.scored for t in trials) < 2:
        return None
    best, tried = best_trial(trials), sorted(t.lr for t in trials)
    if best.lr == tried[-1]:
        return None if above(best.lr * LADDER, ceiling) else best.lr * LADDER
    if best.lr == tried[0]:
        return best.lr / LADDER
    return None


def refine(trials: list[Trial]) -> float:
    """The rate to suggest: the vertex of the parabola, in log rate, through the best trial and its two
    neighbouring rungs, when both are finite (a rung is a factor ``LADDER`` from the next, so the vertex
    lies within half a rung of the best); the best trial's rate when it is at an end or a neighbour
    diverged: a run's best rate rarely sits on a rung."""
    best = best_trial(trials)

    def rung(rate: float) -> Trial | None:
        near = [t for t in trials if math.isclose(t.lr, rate, rel_tol=1e-6)]
        return near[0] if near and near[0].scored else None

    lo, hi = rung(best.lr / LADDER), rung(best.lr * LADDER)
    if lo is None or hi is None:
        return best.lr
    curve = lo.heldout_loss - 2 * best.heldout_loss + hi.heldout_loss
    if curve <= 0:  # a tie on all three: no vertex
        return best.lr
    h = math.log(LADDER)
    return best.lr * math.exp(h * (lo.heldout_loss - hi.heldout_loss) / (2 * curve))


def one_update(trainer: TrainerHost, it, set_rates: Callable[[], object], clipper=None, skip=None) -> dict | None:
    """One optimizer step on the next step of ``it`` that carries targets (and that ``skip`` does not reject):
    forward and backward, ``set_rates()``, the update (``clipper``: the trainer's when None; no guard
    verdicts). Its stats, or None when the data ended or 100 steps in a row had nothing to learn from."""
    for _ in range(100):
        step = next(it, None)
        if step is None:
            return None
        if skip is not None and skip(step):
            continue
        stats = trainer.forward_backward(step.batches)
        if is_empty(stats):  # no update, the same rate for the next step
            trainer.optimizer.zero_grad(set_to_none=True)
            continue
        set_rates()
        trainer.apply_update(stats, clipper=clipper, judge=False)
        trainer.optimizer.zero_grad(set_to_none=True)
        return stats
    return None


def best_trial(trials: list[Trial]) -> Trial:
    """The trial with the lowest finite held-out loss (ties: the lower rate)."""
    finite = [t for t in trials if t.scored]
    if not finite:
        raise UserError(
            "finder.trials: no trial ended with a finite held-out loss ("
            + ", ".join(f"lr {t.lr:.3g}: {t.heldout_loss:.4g} after {t.steps} steps" for t in trials)
            + "): lower finder.lr_start / the range, or check the data"
        )
    return min(finite, key=lambda t: (t.heldout_loss, t.lr))


def _heldout_loss(trainer: TrainerHost, heldout: list) -> float:
    if trainer.eval_data is None:
        return float(trainer.evaluate_batches(heldout).loss)
    source = trainer.eval_data() if callable(trainer.eval_data) else trainer.eval_data
    return float(trainer.evaluate_batches(source, trainer.eval_cfg.max_batches).loss)

"""The learning-rate range test: train briefly at exponentially growing rates, suggest one, and leave no trace.

``lr_range_test(trainer, finder)`` takes ``finder.lr_steps`` optimizer steps on the trainer's own
data, model and optimizer, the ``k``-th at ``lr_start × (lr_end / lr_start) ** (k / (lr_steps - 1))``
(one rate per optimizer step, however many batches a step accumulates; each parameter group at that
rate × its ``lr_mult``). The loss is smoothed by a bias-corrected exponential moving average; the test
stops once the smoothed loss exceeds ``diverge`` × its minimum, climbs back above where it started
after falling by a quarter (a clipped loss may saturate instead of blowing up), or a loss is not finite; only the
last is judged during the first tenth of the steps (``baseline_steps``), where batch noise rules. Under
torchrun every rank sees the same all-reduced loss, and the stop is agreed (``Distributed.agree``),
so all ranks take the same steps.

No trace: before the first step ``TrainerSnapshot`` copies the model's tensors and gradients, the
optimizer's state and hyper-parameters, every named trainer part (``Trainer.parts()``: counters, data position, guard,
clipper, scaler, ...), every RNG and the train/eval mode; afterwards all of it is put back, so the
run that follows is bit for bit the one that would have run without the test.

The suggestion and the step-size diagnosis read the curve: ``train/finders/lr_curve.py``. With
``finder.trials`` the suggestion is then put to short trainings at a few rates around it, and the one
with the lowest held-out loss is suggested (``train/finders/lr_trials.py``).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from densebatch.atomic import write_file
from densebatch.config import FinderConfig
from densebatch.errors import UserError
from densebatch.train.checkpoint.rng import capture_rng_state, restore_rng_state
from densebatch.train.contracts import TrainerHost
from densebatch.train.finders.lr_curve import RULES, centred, choose_rule, diagnose, lowest, shown, smooth, suggest
from densebatch.train.finders.lr_trials import (
    best_trial,
    confidently_wrong,
    one_update,
    refine,
    run_trials,
    skipped,
    trial_ceiling,
    vocabulary,
)
from densebatch.train.guard import FixedClipper
from densebatch.train.observe.monitor import _fmt_time, strict_json
from densebatch.train.observe.plots import plot_lr_finder

LR_FINDER_JSON, LR_FINDER_PNG = "lr_finder.json", "lr_finder.png"
FELL = 0.25  # the range test stops when the loss is back above its start after falling by this share
ROSE = 0.5  # ... or when it rises this share above its start without such a fall (a model at chance with a large vocabulary)


class TrainerSnapshot:
    """Everything a training step can change, copied (tensors cloned), and ``restore`` to put it back."""

    def __init__(self, trainer: TrainerHost):
        self.model = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        self.optimizer = copy.deepcopy(trainer.optimizer.state_dict())
        self.parts = copy.deepcopy(trainer.trainer_state())
        self.rng = capture_rng_state()
        self.training = trainer.model.training
        self.grads = [None if p.grad is None else p.grad.detach().clone() for p in trainer.model.parameters()]
        self.max_epochs, self.step_fraction = trainer.data.max_epochs, trainer.data.step_fraction

    def restore(self, trainer: TrainerHost) -> None:
        """Put it all back; copies again, so that the snapshot can be restored more than once (the optimizer
        would otherwise hold the snapshot's own state tensors and update them in place)."""
        with torch.no_grad():
            trainer.model.load_state_dict(self.model)
        trainer.optimizer.load_state_dict(copy.deepcopy(self.optimizer))  # state (empty before training), hyper-parameters
        for p, g in zip(trainer.model.parameters(), self.grads):  # None before training: nothing copied
            p.grad = None if g is None else g.clone()
        trainer.data.max_epochs = self.max_epochs
        trainer.data.set_step_fraction(self.step_fraction)
        trainer.load_trainer_state(copy.deepcopy(self.parts))  # every named part; the data iterator restarts there
        restore_rng_state(self.rng)
        trainer.model.train(self.training)


@dataclass
class LRFinderResult:
    suggested_lr: float
    rule: str  # how the suggestion was chosen, in words
    used: str  # which rule: a key of RULES and of candidates
    lrs: list[float]
    losses: list[float]  # per optimizer step, all ranks
    smoothed: list[float]
    stop: str  # why the test ended
    candidates: dict[str, float] = field(default_factory=dict)  # every rule's rate (REPORTED) and the minimum's
    diagnosis: dict = field(default_factory=dict)
    heldout_losses: list[float] = field(default_factory=list)  # after every step, on finder.heldout_batches batches
    trials: list[dict] = field(default_factory=list)  # finder.trials: {lr, heldout_loss, steps} of each short trial

    def as_dict(self) -> dict:
        return asdict(self) | {"smoothed_losses": self.smoothed}

    def report(self) -> str:
        c, d = self.candidates, self.diagnosis
        lines = [
            f"learning-rate range test: {len(self.lrs)} steps from {self.lrs[0]:.2e} to {self.lrs[-1]:.2e}; {self.stop}",
            f"suggested learning rate: {self.suggested_lr:.3g} ({self.rule})",
            "  other rules (not used): "
            + ", ".join(f"{k} {c[k]:.3g}" for k in shown(self.used) if k in c)
            + (f"; the smoothed loss was lowest at {c['minimum']:.3g}" if "minimum" in c else ""),
            f"batch size: {d.get('verdict', 'n/a')}",
        ]
        if (at := lowest(h := self.heldout_losses)) is not None:
            lines.insert(
                3,
                f"  held-out loss: {h[0]:.4g} at the first rate, lowest {h[at]:.4g} at {self.lrs[at]:.3g}, "
                f"{h[-1]:.4g} at the last ({self.lrs[len(h) - 1]:.3g})",
            )
        if self.trials:
            tried = ", ".join(f"{t['lr']:.3g}: {t['heldout_loss']:.4g}" for t in self.trials)
            lines.insert(2, f"  short trials ({self.trials[0]['steps']} steps each; lr: held-out loss): {tried}")
        return "\n".join(lines)


def schedule(finder: FinderConfig) -> list[float]:
    """The rate of each optimizer step: exponential from ``lr_start`` to ``lr_end``."""
    n = finder.lr_steps
    return [finder.lr_start * (finder.lr_end / finder.lr_start) ** (k / (n - 1)) for k in range(n)]


def progress_line(step: int, *, total: int, elapsed: float, lr: float, loss: float, heldout: float | None = None) -> str:
    """``  step 20/100 | 0:12 elapsed, ETA 0:48 | lr 1.00e-05 | loss 5.5123 | held-out 5.4012``: the ETA at
    the pace so far, for all ``total`` steps (the test may stop earlier, when the loss diverges)."""
    eta = elapsed / step * (total - step) if step else 0.0
    line = f"  step {step}/{total} | {_fmt_time(elapsed)} elapsed, ETA {_fmt_time(eta)} | lr {lr:.2e} | loss {loss:.4f}"
    return line + (f" | held-out {heldout:.4f}" if heldout is not None else "")


def lr_range_test(trainer: TrainerHost, finder: FinderConfig, log: Callable[[str], None] | None = None) -> LRFinderResult:
    """Run the test on ``trainer`` (see the module docstring); every rank must call it. ``log`` gets a
    progress line after the first step and every tenth (``progress_line``), then the report."""
    t0 = time.perf_counter()
    snap = TrainerSnapshot(trainer)
    rates, losses, lrs, held = schedule(finder), [], [], []
    stop = None
    data = trainer.data
    data.set_step_fraction(None)  # full-size steps: a batch-size ramp would shrink the first ones
    data.max_epochs = None  # cycle the data: the test may need more steps than an epoch holds
    heldout: list = []
    wanted = max(finder.heldout_batches, 2 if finder.trials and trainer.eval_data is None else 0)  # trials score on them
    try:
        with contextlib.closing(iter(data)) as it:
            heldout = heldout_batches(trainer, wanted, it)
            trainer.model.train()
            for lr in rates:
                loss = _step(trainer, it, lr)
                if loss is None:
                    stop = "the data ended"
                    break
                lrs.append(lr)
                losses.append(loss)
                if heldout:
                    held.append(float(trainer.evaluate_batches(heldout).loss))  # eval mode: no dropout, no RNG drawn
                if log is not None and (len(lrs) == 1 or len(lrs) % 10 == 0):  # the first: an ETA early on
                    log(
                        progress_line(
                            len(lrs),
                            total=len(rates),
                            elapsed=time.perf_counter() - t0,
                            lr=lr,
                            loss=loss,
                            heldout=held[-1] if held else None,
                        )
                    )
                why = running_divergence(losses, finder)  # the same on every rank: the losses are all-reduced
                if trainer.dist.agree(why is not None):
                    stop = f"stopped at lr {lr:.2e}: diverged: {why}"
                    break
    finally:
        snap.restore(trainer)
    smoothed = centred([x if math.isfinite(x) else math.inf for x in losses], finder.smoothing)
    warm = baseline_steps(finder)
    head = [x for x in losses[:warm] if math.isfinite(x)]
    if stop is None and lrs:
        stop = ending(lrs, smoothed=smoothed, start=float(np.mean(head)) if head else math.nan, held=held, finder=finder)
    noise = float(np.std(head)) if len(head) > 1 else 0.0  # the batch noise: rates too small to move the weights
    candidates = suggest(lrs, smoothed, noise, warm, held)
    if not candidates:
        raise UserError(
            f"the range test took {len(lrs)} steps ({stop}), too few to suggest a rate: lower finder.lr_start or raise finder.lr_steps"
        )
    used = choose_rule(smoothed, noise, held)
    suggested, rule, trials = candidates[used], RULES[used], []
    start, vocab = (float(np.mean(head)) if head else math.nan), vocabulary(trainer.model)
    if finder.trials and confidently_wrong(start, vocab) and not finder.trials_always:
        rule = f"{rule} ({skipped(start, vocab)})"
    elif finder.trials:
        if log is not None:
            log(f"short trials around {suggested:.3g} ({finder.trials} rates, finder.trials):")
        ceiling, capped = trial_ceiling(candidates.get("minimum", math.inf), suggested, start, vocab)
        trials = run_trials(trainer, finder, suggested, snap, heldout, log, ceiling)
        best, chosen = best_trial(trials), refine(trials)
        rates = ", ".join(f"{t.lr:.3g}" for t in sorted(trials, key=lambda t: t.lr))
        rule = (
            f"short trials: the lowest held-out loss after {best.steps} steps at {len(trials)} rates ({rates}; {capped}) around "
            f"the range test's {suggested:.3g} ({RULES[used].split(':')[0]}): {best.lr:.3g}"
            + (f", refined to {chosen:.3g} (the vertex of a parabola through it and its neighbours)" if chosen != best.lr else "")
        )
        candidates = {**candidates, "range test": suggested}
        suggested, used = chosen, "trials"
    result = LRFinderResult(
        suggested_lr=suggested,
        rule=rule,
        used=used,
        lrs=lrs,
        losses=losses,
        smoothed=smoothed,
        stop=stop,
        candidates=candidates,
        diagnosis=diagnose(losses, smoothed),
        heldout_losses=held,
        trials=[asdict(t) for t in trials],
    )
    if log is not None:
        log(result.report())
    return result


def heldout_batches(trainer: TrainerHost, k: int, it) -> list:
    """The first ``k`` batches of the eval data (this rank's share of them under torchrun, the same
    number on every rank), else of the first training step, which the test then does not train on."""
    if k <= 0:
        return []
    per_rank = -(-k // trainer.dist.world_size)
    if trainer.eval_data is not None:
        source = trainer.eval_data() if callable(trainer.eval_data) else trainer.eval_data
        batches = list(itertools.islice(source, per_rank))
    else:
        step = next(it, None)
        batches = [] if step is None else list(step.batches)[:per_rank]
    n = int(trainer.dist.all_reduce(torch.tensor(len(batches)), "min").item())  # FSDP: every rank the same forwards
    return batches[:n]


def baseline_steps(finder: FinderConfig) -> int:
    """Steps before any divergence is judged (a non-finite loss aside); their mean loss is the start.
    At the smallest rates one step's loss may be half or twice the next one's (a model already near
    its task, few loss tokens a step): judged from the first steps, that noise read as a blow-up."""
    return max(5, finder.lr_steps // 10)


def divergence(curve: list[float], *, start: float, warm: int, diverge: float, what: str) -> str | None:
    """Why ``curve`` (a loss, smoothed or held out) has diverged at its last point, in words with its numbers;
    None when it has not. Past the first ``warm`` points: above ``diverge`` x its lowest since them, back above
    ``start`` (its level at the smallest rates) after falling by a quarter (a clipped loss may saturate near
    ln(vocabulary) instead of blowing up), or risen half above ``start`` (a model at chance with a large
    vocabulary: its loss can neither fall a quarter nor grow 4x). The lowest point is taken from the end of
    the first ``warm`` on: before it an average holds too few steps to be one."""
    now = curve[-1]
    if not math.isfinite(now):
        return f"{what} is not finite"
    if len(curve) <= warm:
        return None
    best = min(curve[warm - 1 :])
    if now > diverge * best:
        return f"{what} {now:.4g} is above {diverge:g}x its lowest {best:.4g}"
    if best < (1 - FELL) * start and now > start:
        return f"{what} {now:.4g} is back above its start {start:.4g} after falling to {best:.4g}"
    if now > (1 + ROSE) * start:
        return f"{what} {now:.4g} rose above {1 + ROSE:g}x its start {start:.4g}"
    return None


def running_divergence(losses: list[float], finder: FinderConfig) -> str | None:
    """Why the test stops after ``losses`` (None: it goes on), judged as it runs: the last loss is not finite, or
    (past the baseline steps, whose mean loss is the start) the running average of the loss diverged
    (``divergence``). Within the baseline only a non-finite loss stops it: there batch noise rules."""
    if not math.isfinite(losses[-1]):
        return f"the loss is not finite ({losses[-1]})"
    warm = baseline_steps(finder)
    if len(losses) <= warm:
        return None
    start = float(np.mean(losses[:warm]))
    return divergence(
        smooth(losses, finder.smoothing), start=start, warm=warm, diverge=finder.diverge, what="the running average of the loss"
    )


def diverged(losses: list[float], finder: FinderConfig) -> bool:
    """Whether the test stops after ``losses`` (``running_divergence``)."""
    return running_divergence(losses, finder) is not None


def ending(lrs: list[float], *, smoothed: list[float], start: float, held: list[float], finder: FinderConfig) -> str:
    """How a test that ran to ``lr_end`` ended, judged on the curves it plots: the smoothed train loss (lag-free)
    and the held-out loss (from its first value) by ``divergence``'s rules, each with where it was lowest."""
    said = []
    warm = baseline_steps(finder)
    for curve, first, what, skip in (
        (smoothed, start, "the smoothed loss", warm),
        (held, held[0] if held else 0.0, "the held-out loss", 1),
    ):
        why = divergence(curve, start=first, warm=skip, diverge=finder.diverge, what=what) if curve else None
        if why is not None:
            at = lowest(curve[skip - 1 :])
            said.append(why + ("" if at is None else f" (lowest at lr {lrs[skip - 1 + at]:.3g})"))
    if not said:
        return f"reached lr_end {finder.lr_end:g} without diverging"
    return f"reached lr_end {finder.lr_end:g}, diverged on the way: " + "; ".join(said)


def _step(trainer: TrainerHost, it, lr: float) -> float | None:
    """One optimizer step at ``lr`` on the next step of data; its loss (all ranks), None when data ended."""

    def rates() -> None:
        for group in trainer.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)

    # A fixed clip and no guard: the test wants the loss at every rate, a spike included, and must not
    # change the run's adaptive clipper.
    stats = one_update(trainer, it, rates, clipper=FixedClipper(trainer.cfg.grad_clip))
    return None if stats is None else float(stats["loss"])


def write_outputs(result: LRFinderResult, out_dir: str | Path) -> tuple[Path, Path | None]:
    """``lr_finder.json`` and (with matplotlib) ``lr_finder.png``: loss against the rate, log axis,
    the suggestion marked. Returns both paths (the PNG's None without matplotlib)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = strict_json(result.as_dict())
    write_file(out / LR_FINDER_JSON, json.dumps(doc, indent=1, allow_nan=False) + "\n")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return out / LR_FINDER_JSON, None
    tmp = out / f".{LR_FINDER_PNG}.tmp"
    plot_lr_finder(result, tmp, shown(result.used))
    tmp.replace(out / LR_FINDER_PNG)
    return out / LR_FINDER_JSON, out / LR_FINDER_PNG

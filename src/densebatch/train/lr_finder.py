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

The suggestion (``suggest``, ``choose_rule``): **most of the fall**: on the curve smoothed forwards and
backwards (``centred``: no lag; a lagging average shifts every point to the right), the lowest rate at
which the loss has made 90% of its fall from its start to its minimum, capped at a third of the
minimum's rate. Past it a higher rate buys little more descent before the curve turns. Unless the
model is **near its task**: when the smoothed loss falls by less than twice the step-to-step noise at
the smallest rates, what fell is noise and the minimum sits wherever the noise put it; the
suggestion is then the rate at which the loss starts to climb (**climb**: from it on, the smoothed
loss stays more than one noise sd above its level at the smallest rates), the edge of the rates the
model takes without losing what it knows. On the instruction-tuning grid it was chosen on
(docs/finders.md) the best runs sat there; on a held-out one the best rate was lower (1e-3 against
1.6e-3 and 4.3e-3): read it as the top of a range to try.
Reported beside them, not used: the **steepest descent** (the middle of the half-decade over which
the loss falls most: the rule this module first used; on a fine-tuning grid its rate trained to six
times the best eval loss: the fall is steepest where the rate first starts to matter, not where
training is fastest), the **minimum ÷ 10** (the classic rule; too low on the same grid) and fastai's
**valley** (half-way down the longest falling stretch, which a long flat start drags to rates that
barely train). docs/finders.md compares them with grids of training runs.

``diagnose`` reads the curve for the step size: loss noise at small rates, where the weights barely
move, is batch-to-batch noise (steps too small); a smooth curve that falls little before diverging
suggests steps larger than needed.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from densebatch.atomic import write_file
from densebatch.config import FinderConfig
from densebatch.errors import UserError
from densebatch.train.guard import clip_gradients
from densebatch.train.rng import capture_rng_state, restore_rng_state

LR_FINDER_JSON, LR_FINDER_PNG = "lr_finder.json", "lr_finder.png"
NOISY, SLOW = 0.10, 0.25  # diagnosis thresholds: relative step-to-step noise; relative fall of the loss
SPAN, CAP = 0.5, 3.0  # the steepest fall is measured over half a decade of rates; at most the minimum's rate / 3
FELL = 0.25  # the range test stops when the loss is back above its start after falling by this share
FALL = 0.9  # the suggestion: where the smoothed loss has made this share of its fall to its minimum
NEAR = 2.0  # a fall of less than this many step-to-step noise sds is noise: the model is near its task
RULES = {  # the rules choose_rule() picks from, in words
    "fall": "most of the fall: the lowest rate at which the lag-free smoothed loss has made 90% of its fall to its minimum",
    "climb": (
        "near its task: the loss fell by less than twice its step-to-step noise, so the rate at which it "
        "starts to climb (from there on one noise sd above its level at the smallest rates)"
    ),
}
REPORTED = ("fall", "climb", "steepest", "min/10", "valley")  # every rate suggest() computes


def shown(used: str) -> tuple[str, ...]:
    """The rules reported beside the one used; ``climb`` only when used (after a real fall it
    measures the blow-up, not a rate to train at)."""
    return tuple(k for k in REPORTED if k != used and k != "climb")


class TrainerSnapshot:
    """Everything a training step can change, copied (tensors cloned), and ``restore`` to put it back."""

    def __init__(self, trainer: Any):
        self.model = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        self.optimizer = copy.deepcopy(trainer.optimizer.state_dict())
        self.parts = copy.deepcopy(trainer.trainer_state())
        self.rng = capture_rng_state()
        self.training = trainer.model.training
        self.grads = [None if p.grad is None else p.grad.detach().clone() for p in trainer.model.parameters()]
        self.data_attrs = {k: getattr(trainer.data, k) for k in ("max_epochs", "fraction") if hasattr(trainer.data, k)}

    def restore(self, trainer: Any) -> None:
        with torch.no_grad():
            trainer.model.load_state_dict(self.model)
        trainer.optimizer.load_state_dict(self.optimizer)  # state (empty before training) and hyper-parameters
        for p, g in zip(trainer.model.parameters(), self.grads):  # None before training: nothing copied
            p.grad = g
        for k, v in self.data_attrs.items():
            setattr(trainer.data, k, v)
        trainer.load_trainer_state(self.parts)  # every named part; the data iterator restarts from its position
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
        return "\n".join(lines)


def schedule(finder: FinderConfig) -> list[float]:
    """The rate of each optimizer step: exponential from ``lr_start`` to ``lr_end``."""
    n = finder.lr_steps
    return [finder.lr_start * (finder.lr_end / finder.lr_start) ** (k / (n - 1)) for k in range(n)]


def smooth(losses: list[float], weight: float) -> list[float]:
    """Bias-corrected exponential moving average (the first values are not pulled towards 0)."""
    out, avg = [], 0.0
    for k, x in enumerate(losses, start=1):
        avg = weight * avg + (1.0 - weight) * x
        out.append(avg / (1.0 - weight**k))
    return out


def centred(losses: list[float], weight: float) -> list[float]:
    """``smooth`` forwards, then backwards: no lag. A forward average trails the curve by about
    ``1 / (1 - weight)`` steps (half a decade of rates at 0.9 and 100 steps over 6 decades), which
    would move every rule's rate to the right."""
    return smooth(smooth(losses, weight)[::-1], weight)[::-1]


def lr_range_test(trainer: Any, finder: FinderConfig, log: Callable[[str], None] | None = None) -> LRFinderResult:
    """Run the test on ``trainer`` (see the module docstring); every rank must call it."""
    snap = TrainerSnapshot(trainer)
    rates, losses, lrs, smoothed = schedule(finder), [], [], []
    stop = f"reached lr_end {finder.lr_end:g} without diverging"
    data = trainer.data
    if hasattr(data, "fraction"):
        data.fraction = lambda n: 1.0  # full-size steps: a batch-size ramp would shrink the first ones
    data.max_epochs = None  # cycle the data: the test may need more steps than an epoch holds
    try:
        with contextlib.closing(iter(data)) as it:
            trainer.model.train()
            for lr in rates:
                loss = _step(trainer, it, lr)
                if loss is None:
                    stop = "the data ended"
                    break
                lrs.append(lr)
                losses.append(loss)
                if log is not None and len(lrs) % 10 == 0:
                    log(f"  step {len(lrs)}/{len(rates)}: lr {lr:.2e}, loss {loss:.4f}")
                if trainer.dist.agree(diverged(losses, finder)):
                    stop = f"stopped at lr {lr:.2e}: the smoothed loss diverged (above {finder.diverge:g}x its minimum, or back above its start)"
                    break
    finally:
        snap.restore(trainer)
    smoothed = centred([x if math.isfinite(x) else math.inf for x in losses], finder.smoothing)
    warm = baseline_steps(finder)
    head = [x for x in losses[:warm] if math.isfinite(x)]
    noise = float(np.std(head)) if len(head) > 1 else 0.0  # the batch noise: rates too small to move the weights
    candidates = suggest(lrs, smoothed, noise, warm)
    if not candidates:
        raise UserError(
            f"the range test took {len(lrs)} steps ({stop}), too few to suggest a rate: lower finder.lr_start or raise finder.lr_steps"
        )
    used = choose_rule(smoothed, noise)
    result = LRFinderResult(
        suggested_lr=candidates[used],
        rule=RULES[used],
        used=used,
        lrs=lrs,
        losses=losses,
        smoothed=smoothed,
        stop=stop,
        candidates=candidates,
        diagnosis=diagnose(losses, smoothed),
    )
    if log is not None:
        log(result.report())
    return result


def baseline_steps(finder: FinderConfig) -> int:
    """Steps before any divergence is judged (a non-finite loss aside); their mean loss is the start.
    At the smallest rates one step's loss may be half or twice the next one's (a model already near
    its task, few loss tokens a step): judged from the first steps, that noise read as a blow-up."""
    return max(5, finder.lr_steps // 10)


def diverged(losses: list[float], finder: FinderConfig) -> bool:
    """Whether the test stops after ``losses``: the last is not finite, or (past the baseline steps)
    the smoothed loss is above ``diverge`` x its minimum, or back above the start after falling by a
    quarter (a clipped loss may saturate near ln(vocabulary) instead of blowing up). The minimum is
    taken from the end of the baseline on: before it the average holds too few steps to be one."""
    if not math.isfinite(losses[-1]):
        return True
    warm = baseline_steps(finder)
    if len(losses) <= warm:
        return False
    smoothed = smooth(losses, finder.smoothing)
    best, start = min(smoothed[warm - 1 :]), float(np.mean(losses[:warm]))
    return smoothed[-1] > finder.diverge * best or (best < (1 - FELL) * start and smoothed[-1] > start)


def _step(trainer: Any, it, lr: float) -> float | None:
    """One optimizer step at ``lr`` on the next step of data; its loss (all ranks), None when data ended."""
    for _ in range(100):  # steps without loss tokens carry no signal: take the next (no update, same rate)
        step = next(it, None)
        if step is None:
            return None
        stats = trainer.forward_backward(step.batches)
        if stats["loss_tokens"]:
            break
    else:
        return None
    for group in trainer.optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)
    trainer.scaler.unscale_(trainer.optimizer)
    clip_gradients(trainer._params, max_norm=trainer.cfg.grad_clip)
    trainer.scaler.step(trainer.optimizer)
    trainer.scaler.update()
    trainer.optimizer.zero_grad(set_to_none=True)
    return float(stats["loss"])


def choose_rule(smoothed: list[float], noise: float) -> str:
    """``fall``, unless the smoothed loss fell from its start to its minimum by less than ``NEAR`` x the
    step-to-step ``noise`` at the smallest rates: then what fell was noise (a model already near its
    task), the minimum is wherever the noise put it, and ``climb`` is used."""
    y = np.asarray(smoothed, dtype=np.float64)
    y = np.where(np.isfinite(y), y, np.inf)
    return "climb" if y[0] - y.min() < NEAR * noise else "fall"


def suggest(lrs: list[float], smoothed: list[float], noise: float = 0.0, baseline: int = 5) -> dict[str, float]:
    """Each rule's rate: ``fall``, ``climb``, ``steepest``, ``min/10``, ``valley`` (``choose_rule`` picks
    the one suggested), and the loss ``minimum``'s rate (see the module docstring), from the lag-free
    smoothed curve. Only the points up to the minimum count for the fall (past it the curve measures
    the blow-up); ``climb`` is the rate from which on the smoothed loss stays more than ``noise`` above
    its level over the first ``baseline`` steps (the last rate when it ends below)."""
    y = np.asarray(smoothed, dtype=np.float64)
    n = len(y)
    if n < 5 or not np.isfinite(y).any():
        return {}
    y = np.where(np.isfinite(y), y, np.inf)
    lo = int(np.argmin(y))
    # Longest decreasing subsequence ending at each point (fastai's valley), over the finite points.
    run = np.ones(n, dtype=np.int64)
    for i in range(1, n):
        prev = run[:i][y[:i] > y[i]]
        run[i] = 1 + (prev.max() if len(prev) else 0)
    end = int(np.argmax(run))
    start = end - int(run[end]) + 1
    valley = start + (end - start) // 2
    x = np.log10(np.asarray(lrs, dtype=np.float64))
    k = max(1, int(round(SPAN / max(1e-12, (x[-1] - x[0]) / (n - 1)))))  # points per half decade
    k = min(k, max(1, lo))
    fall = y[k : lo + 1] - y[: lo + 1 - k]  # change of the loss over each half-decade window before the minimum
    i = int(np.argmin(fall)) if len(fall) else 0
    steepest = min(10 ** ((x[i] + x[min(n - 1, i + k)]) / 2), float(lrs[lo]) / CAP)
    done = (y[0] - y[: lo + 1]) / max(1e-12, y[0] - y[lo])  # share of the fall made at each rate, 1 at the minimum
    j = int(np.argmax(done >= FALL))  # the first rate past FALL (the minimum itself when the curve never fell)
    if j > 0:  # log-linear between the two rates around FALL: a point, not a grid step
        t = (FALL - done[j - 1]) / max(1e-12, done[j] - done[j - 1])
        at = 10 ** (x[j - 1] + min(1.0, max(0.0, t)) * (x[j] - x[j - 1]))
    else:
        at = float(lrs[0])
    # The climb: the first rate of the last stretch that stays more than the noise above the level at
    # the smallest rates. Not above the minimum: on a flat curve that is a noise dip (or the curve's
    # first point), and the first wiggle above it put the climb up to a decade early.
    level = float(np.mean(y[:baseline]))
    below = np.flatnonzero(y[lo:] <= level + noise)  # never empty: the minimum is at most the level
    climb = float(lrs[min(n - 1, lo + int(below[-1]) + 1)])
    return {
        "fall": float(min(at, float(lrs[lo]) / CAP)),
        "climb": climb,
        "steepest": float(steepest),
        "min/10": float(lrs[lo]) / 10.0,
        "valley": float(lrs[valley]),
        "minimum": float(lrs[lo]),
    }


def diagnose(losses: list[float], smoothed: list[float]) -> dict:
    """What the curve says about the step size (see the module docstring), with the numbers."""
    y, s = np.asarray(losses, dtype=np.float64), np.asarray(smoothed, dtype=np.float64)
    finite = np.isfinite(y) & np.isfinite(s)
    if finite.sum() < 5:
        return {"verdict": "too few steps to judge"}
    start = float(s[finite][0])
    # The flat head: rates too small to move the weights, where the loss varies only with the batch.
    head = np.flatnonzero(finite & (np.abs(s - start) <= 0.02 * abs(start)))
    head = head[head < max(5, len(y) // 3)]
    if len(head) < 5:
        head = np.flatnonzero(finite)[: max(5, len(y) // 10)]
    noise = float(np.std(y[head]) / max(1e-12, abs(float(np.mean(y[head])))))
    fall = float((start - np.min(s[finite])) / max(1e-12, abs(start)))
    if noise >= NOISY:
        verdict = (
            f"noisy: at small rates the loss varies {noise:.0%} from step to step, which is batch noise, not learning; "
            "steps look too small for a steady signal (raise train.grad_accum_batches or train.loss_tokens_per_step)"
        )
    elif noise < 0.02 and fall < SLOW:
        verdict = (
            f"smooth but slow: {noise:.1%} noise at small rates and the loss fell only {fall:.0%} before diverging; "
            "steps look larger than needed (fewer tokens per step give more updates for the same data)"
        )
    else:
        verdict = f"balanced: {noise:.1%} step-to-step noise at small rates, the loss fell {fall:.0%} before diverging"
    return {"verdict": verdict, "noise": noise, "fall": fall, "head_steps": int(len(head))}


def write_outputs(result: LRFinderResult, out_dir: str | Path) -> tuple[Path, Path | None]:
    """``lr_finder.json`` and (with matplotlib) ``lr_finder.png``: loss against the rate, log axis,
    the suggestion marked. Returns both paths (the PNG's None without matplotlib)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    finite = lambda v: v if isinstance(v, float) and math.isfinite(v) else None  # noqa: E731 - strict JSON
    doc = {k: ([finite(x) for x in v] if isinstance(v, list) else v) for k, v in result.as_dict().items()}
    write_file(out / LR_FINDER_JSON, json.dumps(doc, indent=1, allow_nan=False) + "\n")
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return out / LR_FINDER_JSON, None
    fig = Figure(figsize=(8, 4.2), dpi=100, layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    ax.plot(result.lrs, result.losses, color="tab:blue", alpha=0.3, linewidth=0.8, label="loss (per step)")
    ax.plot(result.lrs, result.smoothed, color="tab:blue", linewidth=1.8, label="loss (smoothed)")
    ax.axvline(result.suggested_lr, color="tab:red", linestyle="--", label=f"suggested {result.suggested_lr:.2g} ({result.used})")
    styles = {"fall": (0, (5, 2, 1, 2)), "climb": (0, (1, 1)), "steepest": (0, (5, 2, 1, 2)), "min/10": ":", "valley": "-."}
    for name, style in ((k, styles[k]) for k in shown(result.used)):
        if name in result.candidates:
            ax.axvline(
                result.candidates[name], color="gray", linestyle=style, linewidth=1, label=f"{name} {result.candidates[name]:.2g}"
            )
    ax.set_xscale("log")
    ax.set_xlabel("learning rate (log scale)")
    ax.set_ylabel("train loss")
    finite_s = [v for v in result.smoothed + result.losses if math.isfinite(v)]
    if finite_s:  # the blow-up at the end would squash the curve: show up to a little above the start,
        # and above the smoothed loss at the suggestion (near its task that is where the climb begins)
        at = result.smoothed[int(np.argmin(np.abs(np.log(np.asarray(result.lrs) / result.suggested_lr))))]
        top = max(result.smoothed[0], min(finite_s), at if math.isfinite(at) else 0.0) * 1.3
        ax.set_ylim(min(finite_s) * 0.9, top)
    ax.set_title("learning-rate range test")
    ax.legend(loc="upper left", fontsize=8)
    tmp = out / f".{LR_FINDER_PNG}.tmp"
    fig.savefig(tmp, format="png")
    tmp.replace(out / LR_FINDER_PNG)
    return out / LR_FINDER_JSON, out / LR_FINDER_PNG

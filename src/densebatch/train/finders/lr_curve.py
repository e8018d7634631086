"""Reading a learning-rate range test's curve: the suggested rate, the other rules' rates, the step-size diagnosis.

The suggestion (``suggest``, ``choose_rule``): **most of the fall**: on the curve smoothed forwards and
backwards (``centred``: no lag; a lagging average shifts every point to the right), the lowest rate at
which the loss has made 90% of its fall from its start to its minimum, capped at a third of the
minimum's rate. Past it a higher rate buys little more descent before the curve turns. Unless the
model is **near its task**: when the smoothed loss falls by less than twice the step-to-step noise at
the smallest rates, what fell is noise and the minimum sits wherever the noise put it. The test
therefore also measures, after every step, the loss on a few fixed **held-out** batches
(``finder.heldout_batches``: the eval data's first, else the first training step's, left out of the
test), which has no batch noise; near its task the suggestion is half the rate at which that loss
was lowest (an empirical factor: the best runs of two instruction-tuning grids sat at 0.4-0.6 of it;
docs/finders.md, with a third grid that was run after it was fixed). Without held-out batches it is
the rate at which the train loss starts to climb (**climb**: one noise sd above its early level).
Reported beside them, not used: the **steepest descent** (the middle of the half-decade over which
the loss falls most: the rule the range test first used; six times the best eval loss on a
fine-tuning grid: the fall is steepest where the rate first starts to matter, not where training is
fastest), the **minimum ÷ 10** (the classic rule; too low on the same grid) and fastai's **valley**
(half-way down the longest falling stretch, which a long flat start drags to rates that barely
train). docs/finders.md compares them with grids of training runs.

``diagnose`` reads the curve for the step size: loss noise at small rates, where the weights barely
move, is batch-to-batch noise (steps too small); a smooth curve that falls little to its lowest point
suggests steps larger than needed.
"""

from __future__ import annotations

import numpy as np

NOISY, SLOW = 0.10, 0.25  # diagnosis thresholds: relative step-to-step noise; relative fall of the loss
SPAN, CAP = 0.5, 3.0  # the steepest fall is measured over half a decade of rates; at most the minimum's rate / 3
FALL = 0.9  # the suggestion: where the smoothed loss has made this share of its fall to its minimum
NEAR = 2.0  # a fall of less than this many step-to-step noise sds is noise: the model is near its task
HALF = 2.0  # near its task: the suggestion is the rate of the held-out loss's lowest point / HALF
RULES = {  # the rules choose_rule() picks from, in words
    "fall": "most of the fall: the lowest rate at which the lag-free smoothed loss has made 90% of its fall to its minimum",
    "held-out": "near its task (the train loss fell by less than twice its step-to-step noise): half the rate "
    "at which the held-out loss, measured after every step, was lowest",
    "climb": "near its task (the train loss fell by less than twice its step-to-step noise), no held-out batches: "
    "the rate from which on the smoothed loss stays one noise sd above its level at the smallest rates",
}
REPORTED = ("fall", "held-out", "climb", "steepest", "min/10", "valley")  # every rate suggest() computes


def shown(used: str) -> tuple[str, ...]:
    """The rules reported beside the one used; the near-task ones only when used (after a real fall
    they measure the blow-up, not a rate to train at)."""
    return tuple(k for k in REPORTED if k != used and k not in ("held-out", "climb"))


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


def lowest(losses: list[float]) -> int | None:
    """The index of the lowest finite loss; None when there is none."""
    h = np.asarray(losses, dtype=np.float64)
    return int(np.nanargmin(np.where(np.isfinite(h), h, np.nan))) if np.isfinite(h).any() else None


def choose_rule(smoothed: list[float], noise: float, heldout: list[float] = ()) -> str:
    """``fall``, unless the smoothed loss fell from its start to its minimum by less than ``NEAR`` x the
    step-to-step ``noise`` at the smallest rates: then what fell was noise (a model already near its
    task), the minimum is wherever the noise put it, and ``held-out`` is used (``climb`` without
    held-out losses)."""
    y = np.asarray(smoothed, dtype=np.float64)
    y = np.where(np.isfinite(y), y, np.inf)
    if y[0] - y.min() >= NEAR * noise:
        return "fall"
    return "climb" if lowest(heldout) is None else "held-out"


def suggest(
    lrs: list[float], smoothed: list[float], noise: float = 0.0, baseline: int = 5, heldout: list[float] = ()
) -> dict[str, float]:
    """Each rule's rate: ``fall``, ``held-out`` (with ``heldout`` losses), ``climb``, ``steepest``,
    ``min/10``, ``valley`` (``choose_rule`` picks the one suggested), and the loss ``minimum``'s rate
    (see the module docstring), from the lag-free smoothed curve. Only the points up to the minimum
    count for the fall (past it the curve measures the blow-up); ``climb`` is the rate from which on
    the smoothed loss stays more than ``noise`` above its level over the first ``baseline`` steps (the
    last rate when it ends below); ``held-out`` is the rate of the lowest held-out loss / ``HALF``
    (not smoothed: it has no batch noise, and what it has is the model's, which is what the run gets)."""
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
    near = {} if (best := lowest(heldout)) is None else {"held-out": float(lrs[best]) / HALF}
    return {
        "fall": float(min(at, float(lrs[lo]) / CAP)),
        **near,
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
            f"smooth but slow: {noise:.1%} noise at small rates and the smoothed loss fell only {fall:.0%} to its lowest; "
            "steps look larger than needed (fewer tokens per step give more updates for the same data)"
        )
    else:
        verdict = f"balanced: {noise:.1%} step-to-step noise at small rates, the smoothed loss fell {fall:.0%} to its lowest"
    return {"verdict": verdict, "noise": noise, "fall": fall, "head_steps": int(len(head))}

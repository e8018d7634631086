"""Reading the range test's curve (``train/finders/lr_curve.py``): the suggested rate and the rule chosen, the
rates reported beside it, and the step-size diagnosis, on synthetic curves shaped like measured ones."""

from __future__ import annotations

import math

import numpy as np
import pytest

from densebatch.train.finders.lr_curve import centred, choose_rule, diagnose, smooth, suggest


def _curve(lrs: np.ndarray, noise: float = 0.0, seed: int = 0) -> list[float]:
    """A range-test-like loss: flat at 5, falls to 1 between 1e-4 and 1e-2, blows up past 3e-2."""
    x = np.log10(lrs)
    fall = 4.0 / (1.0 + np.exp(-3.0 * (x + 3.0)))  # centred at 1e-3
    blow = np.where(x > -1.5, (x + 1.5) * 30.0, 0.0)
    return (5.0 - fall + blow + noise * np.random.default_rng(seed).standard_normal(len(x))).tolist()


def test_the_suggestion_is_where_the_loss_has_made_most_of_its_fall():
    """On the synthetic curve 90% of the fall to the minimum is made at 10 ** -2.3 = 5e-3 (the steepest
    point, 1e-3, is where the rate starts to matter: too low for training, as the grids showed)."""
    lrs = np.logspace(-6, 0, 100)
    x = np.log10(lrs)
    gentle = 5.0 - 4.0 / (1.0 + np.exp(-3.0 * (x + 3.0))) + np.where(x > -1.0, (x + 1.0) * 6.0, 0.0)  # turns at 1e-1
    for seed in range(3):
        noisy = gentle + 0.3 * np.random.default_rng(seed).standard_normal(len(x))
        c = suggest(lrs.tolist(), centred(noisy.tolist(), 0.8))
        assert 3.5e-3 < c["fall"] < 7e-3 and c["fall"] < c["minimum"] / 3  # not the cap: the 90% point
        assert c["steepest"] < c["fall"] / 2.5 and c["min/10"] < c["fall"]
    # A sharp turn drags the smoothed minimum to the left: then the cap, a third of its rate, decides.
    c = suggest(lrs.tolist(), centred(_curve(lrs, noise=0.3), 0.8))
    assert c["fall"] == pytest.approx(c["minimum"] / 3)
    # A curve that falls all the way to its last rate: 90% of the fall, capped at a third of that rate.
    falling = (5.0 - 4.0 / (1.0 + np.exp(-3.0 * (np.log10(lrs) + 1.0)))).tolist()  # centred at 1e-1
    c = suggest(lrs.tolist(), centred(falling, 0.8))
    assert c["fall"] == pytest.approx(c["minimum"] / 3) and c["minimum"] == lrs[-1]


def test_near_its_task_the_suggestion_is_where_the_loss_starts_to_climb():
    """A model near its task: the loss only wobbles (noise sd 0.1 about 0.34) until 1e-3, then climbs.
    The fall to the noisy minimum is noise, so the suggestion is the rate from which on the loss stays
    one noise sd above its level at the smallest rates; a curve that falls far (from scratch) keeps the fall rule."""
    lrs = np.logspace(-6, -2, 65)
    x = np.log10(lrs)
    for seed in range(3):
        climb = np.where(x > -3.0, (x + 3.0) * 0.5, 0.0)  # +0.5 a decade, as measured on an instruction-tuned model
        raw = 0.34 + 0.1 * np.random.default_rng(seed).standard_normal(len(x)) + climb
        noise = float(np.std(raw[:10]))
        smoothed = centred(raw.tolist(), 0.8)
        c = suggest(lrs.tolist(), smoothed, noise, baseline=10)
        assert choose_rule(smoothed, noise) == "climb"
        assert 3e-4 < c["climb"] < 3e-3  # the climb starts at 1e-3 and passes one sd at ~1.6e-3 (noise: half a decade)
        assert c["fall"] < 1e-4 or c["minimum"] < 1e-4  # the fall rule would land wherever the noise is lowest
        fell = raw - np.where(x > -4.0, 0.5, 0.0)  # the same noise after a real fall of 0.5 at 1e-4
        assert choose_rule(centred(fell.tolist(), 0.8), noise) == "fall"
    falling = _curve(np.logspace(-6, 0, 100), noise=0.3)
    assert choose_rule(centred(falling, 0.8), float(np.std(falling[:10]))) == "fall"


def test_near_its_task_the_held_out_loss_places_the_suggestion():
    """The train loss as above (noise, then a climb), and the held-out loss measured after every step:
    smooth (no batch noise), 0.50 falling to 0.42 at 2e-3, then climbing. Near its task the suggestion
    is half the rate of its lowest point; after a real fall of the train loss the fall rule stays."""
    lrs = np.logspace(-6, -2, 65)
    x = np.log10(lrs)
    held = 0.5 - 0.08 * np.exp(-(((x + 2.7) / 0.5) ** 2)) + np.where(x > -2.7, (x + 2.7) * 0.6, 0.0)
    at = int(np.argmin(held))
    assert 1.5e-3 < lrs[at] < 2.5e-3
    for seed in range(3):
        raw = 0.34 + 0.1 * np.random.default_rng(seed).standard_normal(len(x)) + np.where(x > -3.0, (x + 3.0) * 0.5, 0.0)
        noise, smoothed = float(np.std(raw[:10])), centred(raw.tolist(), 0.8)
        c = suggest(lrs.tolist(), smoothed, noise, baseline=10, heldout=held.tolist())
        assert choose_rule(smoothed, noise, held.tolist()) == "held-out"
        assert c["held-out"] == pytest.approx(lrs[at] / 2)
        assert choose_rule(smoothed, noise) == "climb"  # without held-out losses
        fell = raw - np.where(x > -4.0, 0.5, 0.0)
        assert choose_rule(centred(fell.tolist(), 0.8), noise, held.tolist()) == "fall"
    # A non-finite held-out loss (a blow-up) is never the lowest; none finite: no held-out rule.
    assert suggest(lrs.tolist(), smoothed, noise, 10, [*held[:-1].tolist(), math.nan])["held-out"] == pytest.approx(lrs[at] / 2)
    assert "held-out" not in suggest(lrs.tolist(), smoothed, noise, 10, [math.nan] * len(lrs))


def test_the_steepest_half_decade_short_of_the_minimum_is_reported():
    lrs = np.logspace(-6, 0, 100)
    c = suggest(lrs.tolist(), centred(_curve(lrs, noise=0.3), 0.8))
    assert 5e-4 < c["steepest"] < 2e-3  # the fall is steepest at its centre, 1e-3, whatever the noise
    assert c["steepest"] <= c["minimum"] / 3 and c["min/10"] == pytest.approx(c["minimum"] / 10)
    assert c["valley"] < c["minimum"]
    # A lagging (forward-only) average moves the steepest point to the right; the centred one does not.
    lagging = suggest(lrs.tolist(), smooth(_curve(lrs, noise=0.3), 0.95))["steepest"]
    assert lagging > 1.5 * c["steepest"]
    assert suggest(lrs[:3].tolist(), [1.0, 1.0, 1.0]) == {}


def test_the_diagnosis_tells_noisy_from_smooth_and_slow():
    lrs = np.logspace(-6, 0, 100)
    noisy = _curve(lrs, noise=0.8)
    assert diagnose(noisy, smooth(noisy, 0.9))["verdict"].startswith("noisy")
    slow = (5.0 - 0.2 * np.clip(np.log10(lrs) + 4, 0, None) / 4).tolist()  # smooth, falls 4% only
    assert diagnose(slow, smooth(slow, 0.9))["verdict"].startswith("smooth but slow")
    clean = _curve(lrs, noise=0.01)
    assert diagnose(clean, smooth(clean, 0.9))["verdict"].startswith("balanced")

"""The short trials (``finder.trials``): the rate search (bracketing past a winning end of the ladder, the
parabola's vertex between rungs) against losses given as functions of the rate; which models get trials
and a ceiling; the trials inside a range test (rates, schedules, the suggestion). No trace and outputs
are in test_finders.py."""

from __future__ import annotations

import dataclasses
import math
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_finders import FAST, _trainer

from densebatch.config import FinderConfig, GroupScheduleConfig
from densebatch.train.finders.lr_finder import lr_range_test
from densebatch.train.finders.lr_trials import (
    CONFIDENT,
    LADDER,
    MAX_EXTRA,
    Trial,
    above,
    confidently_wrong,
    refine,
    search,
    trial_ceiling,
    trial_rates,
    trial_steps,
    vocabulary,
)


def _search(loss, start: float, n: int = 3, ceiling: float = math.inf) -> list:
    """``run_trials``' rate search (the ladder up to ``ceiling``, then bracketing) against a loss of the rate."""
    return search(lambda r: Trial(r, loss(r), 25), start, n, ceiling)


@settings(max_examples=200, deadline=None)
@given(st.floats(-3.0, 3.0), st.floats(-2.5, 2.5), st.floats(0.1, 5.0))
def test_the_trials_bracket_the_best_rate_and_refine_to_the_vertex(offset, start_offset, width):
    """Against a loss that is a parabola in log rate, the search adds rungs beyond an end while the end is
    the best (at most MAX_EXTRA), and once the best trial has a worse one on either side the suggestion is
    the parabola's vertex, exactly; with the budget spent at an end, the end's rate."""
    optimum = 1e-3 * math.exp(offset)
    loss = lambda lr: 1.0 + width * (math.log(lr) - math.log(optimum)) ** 2  # noqa: E731
    start = 1e-3 * math.exp(start_offset)
    trials = _search(loss, start)
    assert 3 <= len(trials) <= 3 + MAX_EXTRA
    tried = sorted(t.lr for t in trials)
    assert all(math.isclose(b / a, LADDER) for a, b in zip(tried, tried[1:]))  # one ladder, no gaps
    best = min(trials, key=lambda t: t.heldout_loss)
    if tried[0] < best.lr < tried[-1]:  # bracketed: the vertex of the parabola is the optimum
        assert refine(trials) == pytest.approx(optimum, rel=1e-9)
    else:  # the budget ran out at an end, still moving towards the optimum
        assert len(trials) == 3 + MAX_EXTRA and refine(trials) == best.lr
        half = LADDER**0.5  # the optimum lies beyond that end, or within half a rung of it
        assert optimum > best.lr / half if best.lr == tried[-1] else optimum < best.lr * half


def test_a_diverged_rung_ends_the_bracketing_and_keeps_the_best_rate():
    """A trial whose held-out loss is not finite (the rate blew up) is never the best, stops the search
    upwards, and no vertex is fitted through it."""
    trials = _search(lambda lr: 1.0 - lr if lr < 5e-3 else math.inf, 1e-3)
    assert [round(t.lr, 9) for t in trials] == [round(x, 9) for x in (1e-3 / 3, 1e-3, 3e-3, 9e-3)]
    assert refine(trials) == pytest.approx(3e-3)


@settings(max_examples=200, deadline=None)
@given(st.floats(-3.0, 3.0), st.floats(-2.5, 2.5), st.floats(-1.0, 3.0))
def test_no_trial_runs_above_the_ceiling_and_below_it_the_search_is_unchanged(offset, start_offset, room):
    """The ceiling (the range test's minimum) bounds every rung, the initial ladder's included, but never
    the suggestion itself; when the best rate lies below the ceiling by more than the search climbs past
    it, the rungs tried and the suggestion are those without a ceiling; at the ceiling the search stops
    upwards and suggests the best rung it has."""
    optimum = 1e-3 * math.exp(offset)
    loss = lambda lr: 1.0 + (math.log(lr) - math.log(optimum)) ** 2  # noqa: E731
    start = 1e-3 * math.exp(start_offset)
    ceiling = start * LADDER**room
    capped, free = _search(loss, start, ceiling=ceiling), _search(loss, start)
    assert all(not above(t.lr, max(ceiling, start)) for t in capped) and len(capped) >= 2
    assert not above(refine(capped), max(ceiling, start))  # the vertex lies between rungs, so below the ceiling too
    if not any(above(t.lr, max(ceiling, start)) for t in free):
        assert [t.lr for t in capped] == [t.lr for t in free] and refine(capped) == refine(free)
    elif max(t.lr for t in capped) == min(capped, key=lambda t: t.heldout_loss).lr:  # the best is the top rung allowed
        assert refine(capped) == max(t.lr for t in capped) and optimum > refine(capped) / LADDER**0.5


@settings(max_examples=200, deadline=None)
@given(st.floats(0.0, 30.0), st.sampled_from([None, 2, 259, 1024, 50257]), st.floats(1e-6, 1.0), st.floats(1e-6, 1.0))
def test_the_ceiling_holds_for_a_model_confidently_wrong_or_of_unknown_vocabulary(start, vocab, minimum, suggested):
    """Starting above CONFIDENT x ln(vocabulary) (or the vocabulary unknown): no trial above the range test's
    minimum, never below its suggestion. At or below (a model at chance, or better): no ceiling, and the
    rule's words say why."""
    top, words = trial_ceiling(minimum, suggested, start, vocab)
    if vocab is None or start > CONFIDENT * math.log(vocab):
        assert top == max(minimum, suggested) and words.startswith(f"none above {top:.3g}")
    else:
        assert top == math.inf and words.startswith("no ceiling") and f"ln({vocab})" in words
    assert trial_ceiling(minimum, suggested, math.nan, 1024)[0] == max(minimum, suggested)  # no start read: kept


def test_the_vocabulary_is_read_off_a_hugging_face_or_reference_model_and_else_unknown(tmp_path):
    import types

    import torch

    from densebatch.model.gpt import GPT, GPTConfig

    assert vocabulary(GPT(GPTConfig(vocab_size=97, block_size=8, n_layer=1, n_head=1, n_embd=8))) == 97
    transformers = pytest.importorskip("transformers")
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=61, n_layer=1, n_embd=8, n_head=1, n_positions=8))
    assert vocabulary(hf) == 61
    from densebatch.model.hf.adapter import HFCausalLM

    hf.save_pretrained(tmp_path)
    assert vocabulary(HFCausalLM(tmp_path)) == 61  # what densebatch trains: its wrapper
    assert vocabulary(torch.nn.Linear(2, 2)) is None and vocabulary(types.SimpleNamespace(config=None)) is None


def test_a_model_is_confidently_wrong_above_one_and_a_half_times_ln_vocabulary_and_else_not_or_unknown():
    assert confidently_wrong(16.0, 1024) and confidently_wrong(10.5, 1024)  # color, parity: 2.2-2.4x ln 1024
    assert confidently_wrong(7.06, 1024) is False and confidently_wrong(3.4, 1024) is False  # Shakespeare, upper
    assert confidently_wrong(5.0, None) is None and confidently_wrong(math.nan, 1024) is None


# The tiny model starts near ln 32 = 3.47: told its vocabulary is 32 it is at chance (trials, no ceiling);
# told 2 (1.5 x ln 2 = 1.04) it is confidently wrong (no trials, unless trials_always: then the ceiling).
@pytest.mark.parametrize(("vocab", "always"), [(None, False), (32, False), (2, False), (2, True)])
def test_short_trials_train_each_rate_from_the_same_start_and_suggest_the_lowest_heldout_loss(tiny, tmp_path, vocab, always):
    """Three rates a factor 3 apart around the range test's suggestion, each for trial_steps optimizer steps
    under the run's schedule fitted to that length (the run's warm-up steps, at most half the trial), scored on held-out batches; the
    suggestion is the trial with the lowest held-out loss, and the range test's own rate is reported. No
    trial runs above the range test's minimum unless the model says its vocabulary (``config.vocab_size``)
    and starts no higher than 1.5 x its ln: then the ladder is whole. Starting higher, the range test's
    rate stands and no trial runs, unless ``finder.trials_always``."""
    assert trial_rates(1e-3, 3) == pytest.approx([1e-3 / 3, 1e-3, 3e-3])
    assert trial_rates(1e-3, 2) == pytest.approx([1e-3 / 3, 1e-3]) and len(trial_rates(1e-3, 5)) == 5
    assert trial_steps(FinderConfig(), 100) == 25 and trial_steps(FinderConfig(), 8) == 10
    assert trial_steps(FinderConfig(trial_steps=7), 100) == 7
    t = _trainer(tiny, tmp_path, max_steps=40, warmup_steps=8)
    if vocab:
        t.model.config = types.SimpleNamespace(vocab_size=vocab)
    used = []
    step = t.optimizer.step

    def record(*a, **k):
        used.append(t.optimizer.param_groups[0]["lr"] / t.optimizer.param_groups[0]["lr_mult"])
        return step(*a, **k)

    finder = dataclasses.replace(FAST, trials=3, trial_steps=4, trials_always=always)
    t.optimizer.step = record
    result = lr_range_test(t, finder)
    start = float(np.mean(result.losses[:5]))  # the baseline steps of a 12-step test
    if vocab == 2 and not always:  # confidently wrong: the range test's own rate, no trial trained
        assert start > CONFIDENT * math.log(2) and result.trials == [] and len(used) == len(result.lrs)
        assert result.used != "trials" and result.suggested_lr == result.candidates[result.used]
        assert "short trials skipped: the model starts confidently wrong" in result.rule and "range test" not in result.candidates
        return
    base = result.candidates["range test"]
    ceiling = max(result.candidates["minimum"], base)  # no trial above the range test's minimum
    if vocab == 32:
        assert start <= CONFIDENT * math.log(vocab) and "no ceiling: the range test started" in result.rule
        ceiling = math.inf
    rates = [r for r in trial_rates(base, 3) if r <= ceiling * (1 + 1e-6)]
    tried = [x["lr"] for x in result.trials]
    assert tried[: len(rates)] == pytest.approx(rates) and 2 <= len(tried) <= 3 + MAX_EXTRA  # the ladder, then bracketing
    assert max(tried) <= ceiling * (1 + 1e-6) and (vocab == 32 or f"none above {ceiling:.3g}" in result.rule)
    trial_lrs = used[len(result.lrs) :]  # after the range test's steps: the trials, 4 steps each
    assert len(trial_lrs) == 4 * len(tried)
    for k, rate in enumerate(tried):  # the run's warm-up of 8 steps -> 2 (half the trial's 4), then cosine to 0
        a, b, c, d = trial_lrs[4 * k : 4 * k + 4]
        assert a == pytest.approx(rate / 2) and b == pytest.approx(rate) == c and d < c
    trials = [Trial(**x) for x in result.trials]
    assert result.suggested_lr == refine(trials) and result.used == "trials" and "short trials" in result.rule
    best = min(result.trials, key=lambda x: x["heldout_loss"])
    assert best["lr"] / 3**0.5 <= result.suggested_lr <= best["lr"] * 3**0.5  # within half a rung of the best trial


def _trial_rates(t, steps: int) -> tuple[list[float], list[list[dict]]]:
    """Two trials of ``steps`` steps after the range test of ``t``: the trials' rates and, per trial, the
    rate of each layer group (embeddings, blocks, head) at each of its steps."""
    t.model.config = types.SimpleNamespace(vocab_size=32)  # at chance: the trials run
    used = []
    step = t.optimizer.step

    def record(*a, **k):
        used.append({g["name"].split(".")[0]: g["lr"] / g["lr_mult"] for g in t.optimizer.param_groups})
        return step(*a, **k)

    t.optimizer.step = record
    result = lr_range_test(t, dataclasses.replace(FAST, trials=2, trial_steps=steps))
    trial_lrs = used[len(result.lrs) :]
    assert result.trials and len(trial_lrs) == steps * len(result.trials)
    return [x["lr"] for x in result.trials], [trial_lrs[steps * k : steps * (k + 1)] for k in range(len(result.trials))]


def test_a_trial_keeps_the_runs_warm_up_in_steps_not_its_share_of_the_run(tiny, tmp_path):
    """A run of 100 steps warming up over 3: each 8-step trial warms up over the same 3 steps (a share would
    give 0), then decays; the warm-up is what steadies the first updates, whatever the run's length."""
    rates, per_trial = _trial_rates(_trainer(tiny, tmp_path, max_steps=100, warmup_steps=3), 8)
    for rate, steps in zip(rates, per_trial):
        lrs = [s["head"] for s in steps]
        assert lrs[:4] == pytest.approx([rate / 3, 2 * rate / 3, rate, rate])
        assert all(b < a for a, b in zip(lrs[3:], lrs[4:]))  # then cosine down from the peak


def test_a_layer_groups_own_warm_up_is_capped_at_half_a_trial_like_the_runs(tiny, tmp_path):
    """``train.blocks.warmup_steps: 8`` in a 4-step trial: the blocks warm up over 2 steps and reach the
    trial's rate, as the run's own warm-up does, instead of still climbing when the trial is scored; the
    groups without a warm-up of their own follow the run's (none here)."""
    t = _trainer(tiny, tmp_path, max_steps=100, blocks=GroupScheduleConfig(warmup_steps=8))
    for rate, steps in zip(*_trial_rates(t, 4)):
        assert [s["blocks"] for s in steps[:2]] == pytest.approx([rate / 2, rate])
        assert steps[0]["head"] == pytest.approx(rate) == steps[0]["embeddings"]

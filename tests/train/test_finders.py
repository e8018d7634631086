"""The learning-rate range test (no trace, one rate per optimizer step, divergence stop, held-out
batches, outputs; the rules that read its curve are in test_lr_curve.py) and the token-budget finder
(largest budget within the memory, agreement, memory given back)."""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from densebatch.config import FinderConfig, TrainConfig
from densebatch.errors import UserError
from densebatch.train.checkpoint.rng import capture_rng_state, restore_rng_state
from densebatch.train.finders.lr_finder import diverged, lr_range_test, progress_line, schedule, smooth, write_outputs
from densebatch.train.finders.lr_trials import MAX_EXTRA
from densebatch.train.loop import Trainer
from densebatch.train.parts import Evaluation, Placement, Reporting


def _cfg(**kw) -> TrainConfig:
    return TrainConfig(**{"lr": 1e-2, "warmup_steps": 0, "progress": False, "device": "cpu", **kw})


def _trainer(tiny, tmp_path, model=None, **kw) -> Trainer:
    batches = [tiny.collate(tiny.make_docs(4, seed=s)) for s in range(6)]
    return Trainer(
        model or tiny.TinyLM(),
        tiny.ListLoader(batches),
        _cfg(**kw),
        output_dir=tmp_path,
        placement=Placement("cpu"),
        reporting=Reporting(console=False),
    )


def _state(t: Trainer) -> dict:
    """Everything a step can change, as comparable values."""
    return {
        "model": {k: v.clone() for k, v in t.model.state_dict().items()},
        "optimizer": copy.deepcopy(t.optimizer.state_dict()),  # the live tensors change in place
        "parts": json.loads(json.dumps(t.trainer_state())),
        "rng": capture_rng_state(),
        "grads": [p.grad is None for p in t.model.parameters()],
    }


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))


FAST = FinderConfig(lr_start=1e-4, lr_end=10.0, lr_steps=12, smoothing=0.5)


@pytest.mark.parametrize("trials", [0, 3])
def test_the_range_test_leaves_no_trace(tiny, tmp_path, trials):
    """Model, optimizer (state and rates), every trainer part (data position, counters, guard, clipper,
    scaler), every RNG and the gradients are as before; the next step is the one it would have been.
    Also after short trials (``finder.trials``), which train three more times from the same state."""

    class Noisy(tiny.TinyLM):  # draws from the global RNG in every pass, as dropout does
        def token_losses(self, batch):
            return super().token_losses(batch) * (1 + 1e-3 * torch.rand(()))

    ref, t = _trainer(tiny, tmp_path / "ref", Noisy()), _trainer(tiny, tmp_path / "t", Noisy())
    rngs = []
    for trainer in (ref, t):  # two real steps first: the optimizer has state, the data a position
        torch.manual_seed(5)
        for _ in range(2):
            trainer.train_step(trainer.next_step())
        rngs.append(capture_rng_state())
    assert _same(_state(ref)["model"], _state(t)["model"])
    t.next_step()  # a live iterator with prefetched data: the test must not consume from it
    t.reset_data_iterator()
    t.data.load_state_dict(ref.data.state_dict())
    before = _state(t)
    result = lr_range_test(t, dataclasses.replace(FAST, trials=trials, trial_steps=3))
    assert len(result.lrs) >= 5 and result.lrs[-1] > 1e-2  # it trained at rates that change the weights
    assert len(result.trials) == 0 if not trials else 2 <= len(result.trials) <= trials + MAX_EXTRA  # the ceiling may drop a rung
    assert all(x["steps"] == 3 for x in result.trials)
    after = _state(t)
    for key in before:
        assert _same(before[key], after[key]), key
    r2 = t.train_step(t.next_step())
    restore_rng_state(rngs[0])
    r1 = ref.train_step(ref.next_step())
    assert r1.record["loss"] == r2.record["loss"]
    assert _same(ref.model.state_dict(), t.model.state_dict())
    assert _same(ref.optimizer.state_dict(), t.optimizer.state_dict())


def test_one_rate_per_optimizer_step_under_accumulation(tiny, tmp_path):
    t = _trainer(tiny, tmp_path, grad_accum_batches=3)
    used, passes = [], []
    step = t.optimizer.step

    def record(*a, **k):
        used.append([g["lr"] / g["lr_mult"] for g in t.optimizer.param_groups])
        return step(*a, **k)

    t.optimizer.step = record
    forward = t.forward.forward
    t.forward.forward = lambda batch: passes.append(1) or forward(batch)
    finder = FinderConfig(lr_start=1e-5, lr_end=1e-3, lr_steps=7, diverge=1e9, heldout_batches=0)
    result = lr_range_test(t, finder)
    assert len(used) == len(result.lrs) == 7 and len(passes) == 3 * 7
    assert all(len(set(rates)) == 1 for rates in used)  # every group at the step's rate x its multiplier
    assert [r[0] for r in used] == pytest.approx(schedule(finder), rel=1e-12)
    assert schedule(finder)[0] == pytest.approx(1e-5) and schedule(finder)[-1] == pytest.approx(1e-3)


def test_it_stops_when_the_loss_diverges(tiny, tmp_path):
    t = _trainer(tiny, tmp_path)
    result = lr_range_test(t, FinderConfig(lr_start=1e-3, lr_end=1e4, lr_steps=40, smoothing=0.3, diverge=2.0))
    assert "diverged" in result.stop and len(result.lrs) < 40
    causal = smooth(result.losses, 0.3)  # what the test watched while it ran
    start = float(np.mean(result.losses[:5]))  # the baseline: the first 5 steps (a tenth of 40, at least 5)

    def diverged(k: int) -> bool:  # past the baseline: above 2x the minimum since it, back above the start after a 25% fall,
        if k < 5:  # or 1.5x the start without one
            return False
        best = min(causal[4 : k + 1])
        return causal[k] > 2.0 * best or (best < 0.75 * start and causal[k] > start) or causal[k] > 1.5 * start

    assert diverged(len(causal) - 1) or not math.isfinite(result.losses[-1])
    assert not any(diverged(k) for k in range(len(causal) - 1))  # and not earlier
    assert result.suggested_lr < result.lrs[-1]


def test_batch_noise_at_the_smallest_rates_is_not_a_divergence():
    """A model near its task: its first losses differ by half from step to step (measured: 0.263, 0.387 on
    an instruction-tuned model's answers). Judged from the first steps, that stopped the test after two
    steps with no suggestion. Only a non-finite loss stops it within the baseline."""
    finder = FinderConfig()  # 100 steps: a baseline of 10
    measured = [0.263, 0.387, 0.313, 0.166, 0.234, 0.302, 0.355, 0.457, 0.259, 0.424]
    assert not any(diverged(measured[: k + 1], finder) for k in range(len(measured)))
    assert diverged([*measured[:3], math.nan], finder)
    flat = measured + [0.33, 0.29, 0.31, 0.35, 0.30] * 4  # noise about a flat start: no stop after the baseline
    assert not any(diverged(flat[: k + 1], finder) for k in range(len(flat)))
    blown = flat + [1.0, 2.0, 4.0, 8.0]  # then a blow-up: above 4x the smoothed minimum
    assert diverged(blown, finder) and not diverged(blown[:-3], finder)
    saturated = [6.9] * 10 + [3.0] * 10 + [7.2] * 30  # fell, then back above the start (a clipped loss)
    first = next(k for k in range(len(saturated)) if diverged(saturated[: k + 1], finder))
    assert first > 20 and smooth(saturated[: first + 1], 0.8)[-1] > 6.9 > smooth(saturated[:first], 0.8)[-1]


def test_too_few_steps_to_suggest_a_rate_is_a_one_line_error(tiny, tmp_path):
    with pytest.raises(UserError, match="too few to suggest a rate: lower finder.lr_start or raise finder.lr_steps"):
        lr_range_test(_trainer(tiny, tmp_path), FinderConfig(lr_start=1e-4, lr_end=1e-3, lr_steps=3))


def test_held_out_batches_are_measured_after_every_step_and_never_trained_on(tiny, tmp_path):
    """Without eval data the held-out batches are the first training step's, which the test then skips;
    with eval data they are its first batches (``finder.heldout_batches`` of them). They are measured in
    eval mode after every optimizer step, and the test leaves no trace either way."""
    batches = [tiny.collate(tiny.make_docs(4, seed=s)) for s in range(6)]
    key = lambda b: hash(b.input_ids.numpy().tobytes())  # noqa: E731 - tells the batches apart
    finder = FinderConfig(lr_start=1e-4, lr_end=1e-1, lr_steps=8, diverge=1e9, heldout_batches=2)
    for eval_data in (None, [tiny.collate(tiny.make_docs(4, seed=100 + s)) for s in range(3)]):
        t = Trainer(
            tiny.TinyLM(),
            tiny.ListLoader(batches),
            _cfg(),
            output_dir=tmp_path,
            evaluation=Evaluation(data=eval_data),
            placement=Placement("cpu"),
            reporting=Reporting(console=False),
        )
        seen = []

        def record(batch, t=t, seen=seen, forward=t.forward.forward):
            seen.append((t.model.training, key(batch)))
            return forward(batch)

        t.forward.forward = record
        before = _state(t)
        result = lr_range_test(t, finder)
        assert all(_same(before[k], v) for k, v in _state(t).items())
        trained = [k for training, k in seen if training]
        measured = [k for training, k in seen if not training]
        held = [key(batches[0])] if eval_data is None else [key(b) for b in eval_data[:2]]  # one batch a step here
        assert len(result.heldout_losses) == len(result.lrs) == 8 and all(math.isfinite(v) for v in result.heldout_losses)
        assert measured == held * 8
        first = 1 if eval_data is None else 0  # the step held out is not trained on
        assert trained == [key(batches[(first + i) % 6]) for i in range(8)]
        assert not set(trained[: 6 - first]) & set(held)


def test_progress_says_the_step_the_time_elapsed_and_the_eta(tiny, tmp_path):
    assert progress_line(20, total=100, elapsed=12.4, lr=1e-5, loss=5.51234, heldout=5.4) == (
        "  step 20/100 | 0:12 elapsed, ETA 0:50 | lr 1.00e-05 | loss 5.5123 | held-out 5.4000"
    )
    assert (
        progress_line(1, total=100, elapsed=3725.0, lr=2e-3, loss=1.0)
        == "  step 1/100 | 1:02:05 elapsed, ETA 102:26:15 | lr 2.00e-03 | loss 1.0000"
    )
    lines = []
    finder = FinderConfig(lr_start=1e-5, lr_end=1e-3, lr_steps=21, diverge=1e9, heldout_batches=0)
    lr_range_test(_trainer(tiny, tmp_path), finder, log=lines.append)
    steps = [line.split(" | ")[0].strip() for line in lines if line.startswith("  step ")]
    assert steps == ["step 1/21", "step 10/21", "step 20/21"]  # an ETA after the first step, then every tenth
    assert all(" elapsed, ETA " in line for line in lines if line.startswith("  step "))


def test_outputs_are_a_png_and_json(tiny, tmp_path):
    pytest.importorskip("matplotlib")
    result = lr_range_test(_trainer(tiny, tmp_path), dataclasses.replace(FAST, trials=2, trial_steps=2))
    result.losses[-1] = math.inf  # a step that blew up is written as null (strict JSON)
    js, png = write_outputs(result, tmp_path / "out")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads(js.read_text())
    assert doc["suggested_lr"] == result.suggested_lr and len(doc["lrs"]) == len(doc["losses"]) == len(result.lrs)
    assert {"rule", "stop", "candidates", "diagnosis", "smoothed_losses"} <= doc.keys()
    assert len(doc["heldout_losses"]) == len(doc["lrs"])  # the first training step's batch, measured after each step
    assert doc["losses"][-1] is None
    assert doc["trials"] == result.trials and {t["steps"] for t in doc["trials"]} == {2}  # each trial, whole


# ------------------------------------------------------------------------------ budget finder
class FakeMeter:
    """Peak bytes as a function of the budget probed: ``base + per_slot x budget`` (+ ``jump`` above
    ``jump_at``), so the search can be checked exactly; the probes still run real steps."""

    base, per_slot, jump_at, jump, exact = 100_000_000, 1000, None, 0, True
    budget = 0  # set by the test's ``worst``
    overruns: list = []

    def __init__(self, device):
        self.device = device

    def limit(self, limit_gb, margin):
        return int(limit_gb * 1e9 * (1 - margin))

    def reset(self):
        pass

    def peak(self):
        extra = self.jump if self.jump_at is not None and FakeMeter.budget > self.jump_at else 0
        return self.base + self.per_slot * FakeMeter.budget + extra

    def now(self):
        return self.base


@pytest.fixture
def fake_meter(monkeypatch):
    from densebatch.train.finders import budget_finder

    class Meter(FakeMeter):
        pass

    monkeypatch.setattr(budget_finder, "MemoryMeter", Meter)
    return Meter


def _budget_setup(tiny, max_rows=None):
    from densebatch.train.optim import build_optimizer

    class Model(tiny.TinyLM):
        def token_losses(self, batch):
            if max_rows is not None and batch.num_rows > max_rows:
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            return super().token_losses(batch)

    model = Model()
    optimizer = build_optimizer(model, _cfg())
    docs = tiny.make_docs(64, seed=9)

    def worst(budget: int):
        FakeMeter.budget = budget
        return [tiny.collate(docs[: max(1, min(64, budget // 1000))])]

    return model, optimizer, worst, (lambda b: max(1000, min(10**7, b // 64 * 64)))


def test_the_budget_is_the_largest_that_fits_and_no_probe_aims_past_the_limit(tiny, fake_meter):
    from densebatch.train.finders.budget_finder import find_budget

    model, optimizer, worst, snap = _budget_setup(tiny)
    result = find_budget(
        model, optimizer=optimizer, worst=worst, snap=snap, low=1000, high=10**7, limit_gb=0.2, margin=0.0, max_probes=12
    )
    most = (0.2e9 - FakeMeter.base) / FakeMeter.per_slot  # 100,000 slots
    assert 0.85 * most <= result.budget <= most and result.stop.startswith("converged")
    assert all(p.fits for p in result.probes)  # a straight line is never overshot
    assert [p.budget for p in result.probes] == sorted(p.budget for p in result.probes)
    assert max(p.budget / q.budget for p, q in zip(result.probes[1:], result.probes)) <= 2.0


def test_after_an_overrun_the_search_bisects_below_it(tiny, fake_meter):
    from densebatch.train.finders.budget_finder import find_budget

    fake_meter.jump_at, fake_meter.jump = 50_000, 60_000_000  # a step the line cannot predict
    model, optimizer, worst, snap = _budget_setup(tiny)
    result = find_budget(
        model, optimizer=optimizer, worst=worst, snap=snap, low=1000, high=10**7, limit_gb=0.2, margin=0.0, max_probes=12
    )
    assert 50_000 / 1.1 <= result.budget <= 50_000
    assert any(not p.fits for p in result.probes) and all(p.peak_gb[0] <= 0.2 for p in result.probes if p.fits)
    # A resident set keeps what an overrun took: on CPU the search ends there, at the last budget that fitted.
    fake_meter.exact = False
    result = find_budget(
        model, optimizer=optimizer, worst=worst, snap=snap, low=1000, high=10**7, limit_gb=0.2, margin=0.0, max_probes=12
    )
    assert not result.probes[-1].fits and result.budget == result.probes[-2].budget < 50_000
    assert "no bisection" in result.stop


def test_an_out_of_memory_error_in_a_probe_means_too_large(tiny, fake_meter):
    from densebatch.train.finders.budget_finder import find_budget

    model, optimizer, worst, snap = _budget_setup(tiny, max_rows=20)  # a budget of 21,000+ raises
    result = find_budget(
        model, optimizer=optimizer, worst=worst, snap=snap, low=1000, high=10**7, limit_gb=10.0, margin=0.0, max_probes=12
    )
    assert 18_000 <= result.budget < 21_000
    assert any(not p.fits and p.tokens_per_s is None for p in result.probes)


def test_the_finder_leaves_model_optimizer_memory_and_rngs_as_they_were(tiny, tmp_path):
    """Real memory (no fake meter): weights bit for bit, optimizer state and rates, the bytes held by
    parameters, gradients and optimizer state (within 1%: here exactly), every RNG."""
    from densebatch.train.finders.budget_finder import find_budget
    from densebatch.train.state import rank_state_bytes

    t = _trainer(tiny, tmp_path)
    t.train_step(t.next_step())  # the optimizer has state
    t.optimizer.zero_grad(set_to_none=True)
    model, optimizer = t.model, t.optimizer
    before = _state(t)
    held = rank_state_bytes(model, optimizer)
    docs = tiny.make_docs(32, seed=2)
    result = find_budget(
        model, optimizer=optimizer, worst=lambda b: [tiny.collate(docs[: b // 100])], snap=lambda b: min(3200, b // 100 * 100), low=100, high=3200,
        limit_gb=64.0, margin=0.1, max_probes=4,
    )  # fmt: skip
    assert len(result.probes) == 4 and result.budget == result.probes[-1].budget and "max_probes" in result.stop
    assert abs(rank_state_bytes(model, optimizer) - held) <= 0.01 * held
    after = _state(t)
    for key in ("model", "optimizer", "rng", "grads"):
        assert _same(before[key], after[key]), key


def test_when_even_the_smallest_budget_does_not_fit_it_says_what_to_set(tiny, fake_meter):
    from densebatch.errors import UserError
    from densebatch.train.finders.budget_finder import find_budget

    model, optimizer, worst, snap = _budget_setup(tiny)
    with pytest.raises(UserError, match="even the smallest budget .* raise the limit"):
        find_budget(model, optimizer=optimizer, worst=worst, snap=snap, low=1000, high=10**7, limit_gb=0.05, margin=0.0)

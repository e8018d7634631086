"""HealthMonitor: each cause warns once, with its figure and step; a healthy run warns about nothing."""

from __future__ import annotations

import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from densebatch.config import TrainConfig
from densebatch.train.loop import Trainer
from densebatch.train.observe.health import HealthMonitor, HealthWarning, default_memory_limit_gb
from densebatch.train.observe.monitor import read_metrics
from densebatch.train.parts import Placement, Reporting


def _rec(step: int, rng: random.Random | None = None, **over) -> dict:
    """A healthy step: little data wait, steady throughput and fill rate, gradients under the limit."""
    rng = rng or random.Random(step)
    noise = lambda: 1 + rng.uniform(-0.1, 0.1)  # noqa: E731
    rec = {
        "kind": "train",
        "step": step,
        "loss": 2.0,
        "tokens_per_s": 15000.0 * noise(),
        "fill_rate": 0.97 * (1 + rng.uniform(-0.02, 0.02)),
        "grad_norm": 0.5 * noise(),
        "clip_limit": 1.0,
        "data_wait_s": 0.002 * noise(),
        "step_s": 0.27 * noise(),
        "mem_rss_gb": 1.0,
        "mem_peak_rss_gb": 1.2,
    }
    return rec | over


def _feed(monitor: HealthMonitor, records) -> list[HealthWarning]:
    out = []
    for r in records:
        out += monitor.observe(r)
    return out


def test_a_healthy_run_raises_nothing():
    rng = random.Random(0)
    monitor = HealthMonitor(memory_limit_gb=24.0)
    assert _feed(monitor, [_rec(s, rng) for s in range(1, 2001)]) == []
    assert monitor.summary() == [] and monitor.format_summary() == ""


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), jitter=st.floats(0.0, 0.3))
def test_noisy_but_healthy_runs_raise_nothing(seed, jitter):
    rng = random.Random(seed)
    recs = []
    for s in range(1, 301):
        j = lambda: 1 + rng.uniform(-jitter, jitter)  # noqa: E731
        recs.append(_rec(s, rng, tokens_per_s=15000 * j(), fill_rate=min(1.0, 0.9 * j()), step_s=0.3 * j()))
    assert _feed(HealthMonitor(memory_limit_gb=24.0), recs) == []


def test_data_wait_warns_once_with_the_share():
    monitor = HealthMonitor(warmup_steps=5, window=20)
    recs = [_rec(s) for s in range(1, 31)] + [_rec(s, data_wait_s=0.15, step_s=0.3) for s in range(31, 200)]
    got = _feed(monitor, recs)
    assert [w.key for w in got] == ["data_wait"]
    w = got[0]
    assert 0.2 < w.value <= 0.5 and w.threshold == 0.2 and 31 <= w.step < 45
    assert f"{w.value:.0%}" in w.message and str(w) == f"step {w.step}: {w.message}"


def test_a_single_slow_batch_is_not_a_data_wait_problem():
    recs = [_rec(s) for s in range(1, 100)]
    recs[60] = _rec(61, data_wait_s=0.5, step_s=0.8)  # one epoch boundary, say
    assert _feed(HealthMonitor(), recs) == []


def test_memory_near_the_limit_warns_from_the_first_step():
    monitor = HealthMonitor(memory_limit_gb=10.0, memory_headroom=0.1)
    assert _feed(monitor, [_rec(1, mem_peak_rss_gb=8.9)]) == []
    got = _feed(monitor, [_rec(2, mem_peak_rss_gb=9.5), _rec(3, mem_peak_rss_gb=9.9)])
    assert [(w.key, w.step, w.value) for w in got] == [("memory", 2, 9.5)]
    assert "9.50 GB" in got[0].message and "10.00 GB" in got[0].message and "95%" in got[0].message


def test_cuda_records_are_judged_on_cuda_memory_not_host_memory():
    monitor = HealthMonitor(memory_limit_gb=80.0)
    rec = _rec(1, mem_rss_gb=79.0, mem_peak_rss_gb=79.0, cuda_max_allocated_gb=40.0, cuda_max_reserved_gb=50.0)
    assert monitor.observe(rec) == []
    got = monitor.observe(_rec(2, cuda_max_allocated_gb=70.0, cuda_max_reserved_gb=75.0))
    assert [(w.key, w.value) for w in got] == [("memory", 75.0)] and "cuda_max_reserved_gb" in got[0].message


def test_no_memory_limit_no_memory_warning():
    assert _feed(HealthMonitor(memory_limit_gb=None), [_rec(s, mem_peak_rss_gb=1e6) for s in range(1, 50)]) == []


def test_throughput_far_below_its_median_warns_once():
    monitor = HealthMonitor(warmup_steps=10, window=50, recent=10)
    recs = [_rec(s) for s in range(1, 101)] + [_rec(s, tokens_per_s=5000.0) for s in range(101, 300)]
    got = _feed(monitor, recs)
    assert [w.key for w in got] == ["throughput"]
    assert 101 <= got[0].step <= 111 and got[0].value == 5000.0 and "5000" in got[0].message


def test_fill_rate_drop_warns_but_not_during_warmup():
    monitor = HealthMonitor(warmup_steps=30)
    early = [_rec(s, fill_rate=0.3) for s in range(1, 31)]  # warm-up: not judged
    recs = early + [_rec(s) for s in range(31, 120)] + [_rec(s, fill_rate=0.5) for s in range(120, 200)]
    got = _feed(monitor, recs)
    assert [w.key for w in got] == ["fill_rate"] and got[0].step >= 120


def test_clipping_on_most_steps_warns():
    monitor = HealthMonitor(warmup_steps=0, clip_warmup_steps=0, window=20)
    recs = [_rec(s, grad_norm=2.0 if s % 3 else 0.5) for s in range(1, 60)]  # 2 of 3 steps clipped
    got = _feed(monitor, recs)
    assert [w.key for w in got] == ["clipping"] and got[0].step == 20
    assert 0.5 < got[0].value < 0.75 and "1" in got[0].message


def test_clipping_uses_the_fixed_limit_when_records_carry_none_and_is_off_without_one():
    recs = [{k: v for k, v in _rec(s, grad_norm=5.0).items() if k != "clip_limit"} for s in range(1, 400)]
    assert [w.key for w in _feed(HealthMonitor(clip_limit=1.0), recs)] == ["clipping"]
    assert _feed(HealthMonitor(clip_limit=None), recs) == []
    assert _feed(HealthMonitor(clip_limit=0.0), recs) == []  # grad_clip 0 = clipping off


def test_clipping_the_first_steps_of_a_run_is_what_the_limit_is_for():
    """As the demo: every step clipped at first, fewer and fewer until step 200, then almost none."""
    rng = random.Random(0)
    recs = [_rec(s, grad_norm=8.0 if s <= 100 else (2.0 if rng.random() < 0.5 else 0.5)) for s in range(1, 201)]
    recs += [_rec(s, grad_norm=2.0 if rng.random() < 0.1 else 0.5) for s in range(201, 600)]
    assert _feed(HealthMonitor(), recs) == []
    late = recs[:200] + [_rec(s, grad_norm=2.0) for s in range(201, 300)]  # still clipping after 200 steps
    assert [(w.key, w.step) for w in _feed(HealthMonitor(), late)] == [("clipping", 250)]


def test_clipping_on_a_minority_of_steps_is_fine():
    recs = [_rec(s, grad_norm=2.0 if s % 3 == 0 else 0.5) for s in range(1, 300)]  # 1 in 3
    assert _feed(HealthMonitor(), recs) == []


def test_every_cause_once_in_one_run_and_summary_lists_them():
    monitor = HealthMonitor(memory_limit_gb=2.0, warmup_steps=5, clip_warmup_steps=5, window=20)
    bad = dict(data_wait_s=0.2, step_s=0.3, tokens_per_s=1000.0, fill_rate=0.2, grad_norm=3.0, mem_peak_rss_gb=1.95)
    recs = [_rec(s) for s in range(1, 60)] + [_rec(s, **bad) for s in range(60, 400)]
    got = _feed(monitor, recs)
    assert sorted(w.key for w in got) == ["clipping", "data_wait", "fill_rate", "memory", "throughput"]
    assert monitor.summary() == got
    assert monitor.format_summary().count("\n") == 4


def test_missing_and_non_finite_fields_are_ignored():
    recs = [{"kind": "train", "step": s, "loss": math.nan, "grad_norm": math.inf, "tokens_per_s": None} for s in range(1, 200)]
    recs += [{"kind": "eval", "step": 5, "loss": 1.0}]
    assert _feed(HealthMonitor(memory_limit_gb=1.0, clip_limit=1.0), recs) == []


def test_state_round_trip_keeps_causes_already_given():
    monitor = HealthMonitor(memory_limit_gb=1.0)
    (w,) = monitor.observe(_rec(1, mem_rss_gb=0.5, mem_peak_rss_gb=0.99))
    assert w.as_record() == {"kind": "warning", "key": "memory", "step": 1, "message": w.message, "value": 0.99, "threshold": 0.9}
    resumed = HealthMonitor(memory_limit_gb=1.0)
    resumed.load_state_dict(monitor.state_dict())
    assert resumed.observe(_rec(2, mem_peak_rss_gb=0.99)) == [] and resumed.summary() == [w]


# ------------------------------------------------------------------- wired into the loop
def _run_with_health(tiny, tmp_path, health, steps=4, log_every=2):
    cfg = TrainConfig(lr=1e-2, warmup_steps=0, progress=False, device="cpu", max_steps=steps, log_every=log_every)
    batches = [tiny.collate(tiny.make_docs(4, seed=i)) for i in range(steps)]
    trainer = Trainer(
        tiny.TinyLM(), batches, cfg, output_dir=tmp_path, placement=Placement("cpu"), reporting=Reporting(health=health)
    )
    return trainer, trainer.run()


def test_the_loop_writes_each_warning_once_to_console_metrics_and_summary(tiny, tmp_path, capsys):
    # Any process is above 1 kB of memory: the memory cause fires at step 1, which log_every=2 does not log.
    _, result = _run_with_health(tiny, tmp_path, HealthMonitor(memory_limit_gb=1e-6))
    records = read_metrics(tmp_path / "metrics.jsonl")
    warnings = [r for r in records if r["kind"] == "warning"]
    assert [(w["key"], w["step"]) for w in warnings] == [("memory", 1)]
    assert warnings[0]["value"] > warnings[0]["threshold"] > 0  # the figure and what it crossed
    assert [r["step"] for r in records if r["kind"] == "train"] == [2, 4]
    out = capsys.readouterr().out
    assert out.count("warning: step 1: memory") == 1
    assert [w["key"] for w in result.summary["warnings"]] == ["memory"]
    assert "warning          step 1: memory" in result.text


def test_a_healthy_loop_run_and_a_resumed_one_warn_about_nothing_new(tiny, tmp_path):
    trainer, result = _run_with_health(tiny, tmp_path / "a", HealthMonitor(memory_limit_gb=1e-6))
    state = trainer.trainer_state()
    assert [w["key"] for w in state["health"]["warnings"]] == ["memory"]
    resumed = HealthMonitor(memory_limit_gb=1e-6)
    resumed.load_state_dict(state["health"])
    assert resumed.observe({"kind": "train", "step": 5, "mem_rss_gb": 1.0}) == []  # given before: not again

    _, result = _run_with_health(tiny, tmp_path / "b", HealthMonitor(memory_limit_gb=1e6))
    assert result.summary["warnings"] == [] and "warning" not in result.text
    assert not [r for r in read_metrics(tmp_path / "b" / "metrics.jsonl") if r["kind"] == "warning"]


def test_default_memory_limit_is_the_machine_or_container_memory():
    limit = default_memory_limit_gb("cpu")
    assert limit is not None and 0.1 < limit < 1e5  # GB: a machine, not bytes or kilobytes

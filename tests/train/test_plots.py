"""Plots: the data drawn (series, skipped steps, rollbacks, smoothing) and valid PNGs for every kind of run."""

from __future__ import annotations

import math
import struct
import sys

import pytest

from densebatch.errors import ConfigError
from densebatch.train.observe.monitor import METRICS_FILE, MetricsWriter
from densebatch.train.observe.plots import PLOTS_DIR, extract, plot_run, smooth, smooth_on

pytest.importorskip("matplotlib")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def _train(step: int, loss, **extra) -> dict:
    rec = {"kind": "train", "step": step, "loss": loss, "lr": 1e-3 * min(1, step / 5), "grad_norm": 2.0 / step}
    return rec | {"tokens_per_s": 15000.0, "fill_rate": 0.95, "clip_limit": 1.0} | extra


def _run(tmp_path, records, name="myrun"):
    run = tmp_path / name
    w = MetricsWriter(run / METRICS_FILE, append=False)  # as a run writes them: NaN becomes null
    for r in records:
        w.write(r)
    w.close()
    return run


# ------------------------------------------------------------------------------------ data
def test_extract_series_eval_points_and_skipped_steps_from_both_spellings():
    recs = [_train(s, 3.0 / s) for s in range(1, 6)]
    recs[2] |= {"loss": math.nan, "skipped": "skip"}
    recs[3] |= {"outcome": "skipped_nonfinite"}
    recs[4] |= {"outcome": "applied"}
    recs.append({"kind": "eval", "step": 5, "loss": 0.9, "accuracy": 0.5})
    d = extract(recs, name="r")
    assert d.series("loss").steps == [1, 2, 3, 4, 5] and math.isnan(d.series("loss").values[2])
    assert d.series("grad_norm").values[0] == 2.0 and d.series("clip_limit").values == [1.0] * 5
    assert [(s, why) for s, why, _ in d.skipped] == [(3, "skip"), (4, "skipped_nonfinite")]
    assert d.eval_loss.steps == [5] and d.eval_loss.values == [0.9]
    assert d.rollbacks == []


def test_extract_rollback_marks_the_step_and_replayed_steps_supersede():
    recs = [_train(s, 1.0) for s in range(1, 7)]
    recs[5] |= {"loss": 50.0, "skipped": "rollback"}
    recs += [{"kind": "eval", "step": 5, "loss": 9.0}, {"kind": "rollback", "step": 6, "loss": 50.0, "to_step": 3}]
    recs += [_train(s, 0.5) for s in range(4, 9)]  # the restored step-3 weights train steps 4.. again
    d = extract(recs)
    loss = d.series("loss")
    assert loss.steps == list(range(1, 9)) and loss.values == [1.0] * 3 + [0.5] * 5
    assert d.rollbacks == [6] and d.eval_loss.steps == []


def test_extract_rollback_spelled_as_an_outcome():
    d = extract([_train(1, 1.0), _train(2, 9.0, outcome="rollback"), _train(3, 1.0, outcome="empty")])
    assert d.rollbacks == [2] and [s for s, _, _ in d.skipped] == [2, 3]


def test_extract_tolerates_missing_null_and_foreign_records():
    recs = [{"kind": "train", "step": 1, "loss": None}, {"kind": "note"}, {"kind": "train", "step": "x"}, {"step": 2}]
    d = extract(recs)
    assert d.series("loss").steps == [1] and not d.series("loss") and not d.eval_loss


def test_smooth_is_two_sided_normalised_at_the_ends_and_skips_gaps():
    assert smooth([4.0, 4.0, 4.0], span=10) == [4.0, 4.0, 4.0]  # no pull towards zero at either end
    out = smooth([1.0, math.nan, 3.0], span=2)
    assert 1.0 < out[0] < out[1] < out[2] < 3.0 and not any(math.isnan(v) for v in out)
    assert math.isnan(smooth([math.nan, math.nan])[0])
    ramp = smooth([float(i) for i in range(1000)])  # span 40
    assert abs(ramp[500] - 500) < 1e-3  # two-sided: no lag behind a trend (a one-sided EMA lags by ~40)
    assert 950 < ramp[-1] < 999  # at the end only the past is there to average
    noisy = smooth([1.0 + (-1) ** i for i in range(1000)])
    assert all(abs(v - 1.0) < 0.1 for v in noisy[100:-100])


# --------------------------------------------------------------------------------- drawing
def _assert_pngs(paths, expected):
    assert sorted(p.name for p in paths) == sorted(f"{n}.png" for n in expected)
    for p in paths:
        w, h = _png_size(p)
        assert w >= 600 and h >= 300


@pytest.mark.slow
def test_a_full_run_gets_every_plot(tmp_path):
    mem = {"mem_rss_gb": 1.0, "mem_peak_rss_gb": 1.2, "data_wait_s": 0.01, "fwd_bwd_s": 0.2, "optimizer_s": 0.05, "step_s": 0.27}
    recs = [_train(s, 5.0 / s, **mem) for s in range(1, 41)]
    recs[9] |= {"loss": math.nan, "skipped": "skip"}
    recs.insert(20, {"kind": "eval", "step": 20, "loss": 0.4, "ppl": 1.5})
    recs.append({"kind": "rollback", "step": 30, "to_step": 25, "lr_scale": 0.5})
    run = _run(tmp_path, recs)
    paths = plot_run(run)
    _assert_pngs(paths, ["loss", "lr", "grad_norm", "throughput", "memory", "step_time"])
    assert all(p.parent == run / PLOTS_DIR for p in paths)


def test_a_run_of_a_few_steps_without_eval_or_new_metrics(tmp_path):
    run = _run(tmp_path, [_train(1, 7.0), _train(2, 6.5)])
    _assert_pngs(plot_run(run), ["loss", "lr", "grad_norm", "throughput"])


def test_eval_only(tmp_path):
    run = _run(tmp_path, [{"kind": "eval", "step": 0, "loss": 2.0}, {"kind": "eval", "step": 10, "loss": 1.5}])
    _assert_pngs(plot_run(run), ["loss"])


def test_nan_and_null_values_everywhere(tmp_path):
    recs = [_train(s, math.nan, grad_norm=math.inf, skipped="skip") for s in range(1, 4)] + [_train(4, None, lr=None)]
    run = _run(tmp_path, recs)
    paths = plot_run(run)
    assert "throughput.png" in {p.name for p in paths}  # whatever is finite is drawn
    for p in paths:
        _png_size(p)


def test_missing_matplotlib_is_a_one_line_config_error(tmp_path, monkeypatch):
    run = _run(tmp_path, [_train(1, 2.0)])
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ConfigError) as e:
        plot_run(run)
    assert "pip install 'densebatch[plot]'" in str(e.value) and "\n" not in str(e.value)


def test_on_a_log_axis_a_loss_falling_by_decades_is_smoothed_on_that_axis():
    loss = [10 * 0.98**i for i in range(300)]  # a straight line on a log axis
    on_log, linear = smooth_on(loss, log=True), smooth_on(loss, log=False)
    # A straight line stays where it is, away from the ends (where only one side is there to average).
    assert on_log[80:220] == pytest.approx(loss[80:220], rel=1e-3)
    assert all(s > v * 1.02 for s, v in zip(linear[50:250], loss[50:250]))  # an arithmetic mean sits above it
    assert smooth_on([2.0, 0.0, math.nan, 2.0], log=True)[::3] == pytest.approx([2.0, 2.0])  # no log(0) error


def test_the_memory_plot_draws_the_summarys_whole_run_peak(tmp_path):
    """The step records' peak RSS stops at the last step; the summary's is the run record's, which also counts the
    final evaluation (0.67 against 0.98 GB once): the plot draws that figure too, each labelled with what it is."""
    recs = [_train(s, 1.0, mem_rss_gb=0.5, mem_peak_rss_gb=0.6 + s / 100) for s in range(1, 5)]
    recs.append({"kind": "run", "step": 4, "memory_peak": [{"mem_peak_rss_gb": 0.98}, {"mem_peak_rss_gb": 1.5}]})
    d = extract(recs)
    assert d.run_peak == {"mem_peak_rss_gb": 0.98} and max(d.series("mem_peak_rss_gb").values) == 0.64  # rank 0's
    assert "memory.png" in [p.name for p in plot_run(_run(tmp_path, recs))]
    from densebatch.train.observe.plots import MEMORY_KEYS, RUN_PEAK_KEYS

    assert "up to the step" in MEMORY_KEYS["mem_peak_rss_gb"] and "whole run" in RUN_PEAK_KEYS["mem_peak_rss_gb"]

"""Metric sinks: TensorBoard event files hold every scalar, CSV round trips, replayed steps never tangle."""

from __future__ import annotations

import csv
import math
import sys

import pytest

from densebatch.errors import ConfigError
from densebatch.train.observe.sinks import CSV_DIR, TENSORBOARD_DIR, build_sinks, flatten, numeric_scalars


def _train(step: int, loss: float, **extra) -> dict:
    return {"kind": "train", "step": step, "loss": loss, "lr": 1e-3, "fill_rate": 0.9} | extra


def _scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = event_accumulator.EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _write(sinks, records) -> None:
    for r in records:
        for s in sinks:
            s.write(r)
    for s in sinks:
        s.close()


def test_flatten_and_numeric_scalars():
    rec = {
        "kind": "train",
        "step": 3,
        "loss": 2.0,
        "skipped": "skip",
        "ok": True,
        "x": None,
        "by": {"web": 1, "code": {"py": 0.5}},
    }
    assert flatten(rec) == {"loss": 2.0, "skipped": "skip", "ok": True, "x": None, "by/web": 1, "by/code/py": 0.5}
    assert numeric_scalars(rec) == {"loss": 2.0, "by/web": 1.0, "by/code/py": 0.5}
    assert math.isnan(numeric_scalars({"loss": math.nan})["loss"])  # a NaN loss is news, not noise


def test_tensorboard_event_files_hold_every_scalar(tmp_path):
    pytest.importorskip("tensorboard")
    records = [_train(s, 3.0 - s / 10, loss_by_source={"web": 2.5, "code": 1.5}) for s in (1, 2, 3)]
    records.append({"kind": "eval", "step": 3, "loss": 2.2, "ppl": math.exp(2.2), "accuracy": 0.5})
    records.append({"kind": "train", "step": 4, "loss": math.nan, "lr": 1e-3, "skipped": "skip"})
    _write(build_sinks(["tensorboard"], tmp_path), records)
    assert list((tmp_path / TENSORBOARD_DIR).glob("events.out.tfevents.*"))
    got = _scalars(tmp_path / TENSORBOARD_DIR)
    assert [s for s, _ in got["train/loss"]] == [1, 2, 3, 4]
    assert got["train/loss"][0][1] == pytest.approx(2.9) and math.isnan(got["train/loss"][3][1])
    assert got["train/loss_by_source/web"] == [(1, 2.5), (2, 2.5), (3, 2.5)]
    assert got["eval/loss"] == [(3, pytest.approx(2.2))] and got["eval/accuracy"] == [(3, 0.5)]
    assert not any("skipped" in t or t.endswith("/kind") or t.endswith("/step") for t in got)


def test_tensorboard_resume_replaces_replayed_steps(tmp_path):
    pytest.importorskip("tensorboard")
    _write(build_sinks(["tensorboard"], tmp_path), [_train(s, 10.0 + s) for s in range(1, 7)])
    # Resumed from the checkpoint of step 3: steps 4.. are logged again with other values.
    _write(build_sinks(["tensorboard"], tmp_path), [_train(s, 20.0 + s) for s in range(4, 9)])
    got = _scalars(tmp_path / TENSORBOARD_DIR)["train/loss"]
    assert got == [(1, 11.0), (2, 12.0), (3, 13.0)] + [(s, 20.0 + s) for s in range(4, 9)]


def test_tensorboard_rollback_within_a_session_does_not_tangle(tmp_path):
    pytest.importorskip("tensorboard")
    records = [_train(s, 1.0 * s) for s in range(1, 6)] + [{"kind": "eval", "step": 5, "loss": 5.5}]
    records += [{"kind": "rollback", "step": 5, "to_step": 2, "lr_scale": 0.5}]
    records += [_train(s, 100.0 + s) for s in range(3, 7)] + [{"kind": "eval", "step": 5, "loss": 7.5}]
    _write(build_sinks(["tensorboard"], tmp_path), records)
    got = _scalars(tmp_path / TENSORBOARD_DIR)
    assert got["train/loss"] == [(1, 1.0), (2, 2.0)] + [(s, 100.0 + s) for s in range(3, 7)]
    assert got["eval/loss"] == [(5, 7.5)]  # the replayed eval at step 5 is kept, the old one is gone


def test_records_sharing_a_step_do_not_purge_each_other(tmp_path):
    pytest.importorskip("tensorboard")
    warn = lambda key, value: {"kind": "warning", "step": 3, "key": key, "message": "m", "value": value}  # noqa: E731
    records = [_train(s, 1.0) for s in (1, 2, 3)] + [warn("throughput", 0.25), warn("fill_rate", 0.5), _train(4, 1.0)]
    _write(build_sinks(["tensorboard", "csv"], tmp_path), records)
    assert _scalars(tmp_path / TENSORBOARD_DIR)["warning/value"] == [(3, 0.25), (3, 0.5)]
    assert [r["key"] for r in _csv(tmp_path / CSV_DIR / "warning.csv")] == ["throughput", "fill_rate"]
    assert [r["step"] for r in _csv(tmp_path / CSV_DIR / "train.csv")] == ["1", "2", "3", "4"]


def test_missing_tensorboard_is_a_one_line_config_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import now raises ImportError
    with pytest.raises(ConfigError) as e:
        build_sinks(["tensorboard"], tmp_path)
    assert "pip install 'densebatch[tensorboard]'" in str(e.value) and "\n" not in str(e.value)


def test_unknown_sink_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="train.report_to: unknown sink 'neptune'"):
        build_sinks(["csv", "neptune"], tmp_path)
    assert build_sinks([], tmp_path) == []


def _csv(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_csv_round_trip_one_file_per_kind_with_the_union_of_columns(tmp_path):
    records = [_train(1, 3.0), _train(2, 2.5, skipped="skip", by={"web": 1.25}), _train(3, math.nan)]
    records.append({"kind": "eval", "step": 3, "loss": 2.0, "accuracy": 0.75})
    _write(build_sinks(["csv"], tmp_path), records)
    train = _csv(tmp_path / CSV_DIR / "train.csv")
    assert list(train[0]) == ["step", "loss", "lr", "fill_rate", "skipped", "by/web"]
    assert [r["step"] for r in train] == ["1", "2", "3"]
    assert float(train[1]["loss"]) == 2.5 and train[1]["skipped"] == "skip" and float(train[1]["by/web"]) == 1.25
    assert train[0]["skipped"] == "" and train[2]["loss"] == ""  # missing and non-finite values: empty cells
    assert _csv(tmp_path / CSV_DIR / "eval.csv") == [{"step": "3", "loss": "2.0", "accuracy": "0.75"}]


def test_csv_resume_keeps_rows_before_the_replayed_step_and_survives_a_torn_line(tmp_path):
    _write(
        build_sinks(["csv"], tmp_path), [_train(s, float(s)) for s in range(1, 6)] + [{"kind": "eval", "step": 5, "loss": 0.5}]
    )
    path = tmp_path / CSV_DIR / "train.csv"
    with open(path, "a") as f:
        f.write("6,6.0,0.0")  # killed mid-line
    _write(build_sinks(["csv"], tmp_path), [_train(s, 10.0 * s, extra=1) for s in (4, 5)])
    rows = _csv(path)
    assert [(r["step"], r["loss"], r["extra"]) for r in rows] == [
        ("1", "1.0", ""),
        ("2", "2.0", ""),
        ("3", "3.0", ""),
        ("4", "40.0", "1"),
        ("5", "50.0", "1"),
    ]
    assert _csv(tmp_path / CSV_DIR / "eval.csv") == []  # the eval at step 5 belonged to the replaced timeline


def test_a_fresh_run_in_an_old_directory_starts_afresh(tmp_path):
    _write(build_sinks(["csv"], tmp_path), [_train(s, 1.0) for s in range(1, 9)])
    _write(build_sinks(["csv"], tmp_path), [_train(s, 2.0) for s in (1, 2)])
    assert [r["loss"] for r in _csv(tmp_path / CSV_DIR / "train.csv")] == ["2.0", "2.0"]


def test_records_without_a_step_are_ignored(tmp_path):
    _write(build_sinks(["csv"], tmp_path), [{"kind": "note", "text": "hi"}, _train(1, 1.0)])
    assert not (tmp_path / CSV_DIR / "note.csv").exists()

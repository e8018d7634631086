"""Observability end to end: `train --train.report_to=tensorboard` leaves event files and plots; `densebatch plot`."""

from __future__ import annotations

import shutil
import sys

import pytest
from cli_args import TINY

from densebatch.cli import main
from densebatch.train.observe.monitor import read_metrics

pytest.importorskip("matplotlib")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
STEPS = 3


def _pngs(plots) -> dict[str, bytes]:
    return {p.name: p.read_bytes()[:8] for p in sorted(plots.glob("*.png"))}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One tiny run with TensorBoard and the end-of-run plots (both off in the other CLI tests)."""
    pytest.importorskip("tensorboard")
    out = tmp_path_factory.mktemp("obs") / "run"
    args = ["train", f"--output_dir={out}", *TINY, f"--train.max_steps={STEPS}", "--train.report_to=tensorboard"]
    assert main([*args, "--train.plots=true"]) == 0
    return out


@pytest.mark.slow
def test_train_writes_tensorboard_events_with_the_loss_and_plots(run, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    assert {"train/loss", "train/data_wait_s", "train/mem_rss_gb", "eval/loss"} <= set(acc.Tags()["scalars"])
    logged = {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"}
    tb = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert sorted(tb) == list(range(1, STEPS + 1)) and tb == pytest.approx(logged, rel=1e-6)

    pngs = _pngs(run / "plots")
    assert {"loss.png", "lr.png", "grad_norm.png", "throughput.png", "memory.png", "step_time.png"} <= set(pngs)
    assert all(head == PNG_MAGIC for head in pngs.values())


@pytest.mark.slow
def test_train_records_carry_memory_and_data_wait(run):
    train = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"]
    assert len(train) == STEPS
    for r in train:
        assert r["mem_rss_gb"] > 0.01 and r["mem_peak_rss_gb"] >= r["mem_rss_gb"]  # GB: a process, not bytes
        assert 0 <= r["data_wait_s"] <= r["step_s"] and r["fwd_bwd_s"] + r["optimizer_s"] <= r["step_s"]


@pytest.mark.slow
def test_plot_command_redraws_a_run(run, capsys):
    for p in (run / "plots").glob("*.png"):
        p.unlink()
    assert main(["plot", str(run)]) == 0
    assert f"{run / 'plots'}/ (loss.png" in capsys.readouterr().out
    assert set(_pngs(run / "plots").values()) == {PNG_MAGIC}


def test_plot_command_errors_are_one_line(tmp_path, capsys, monkeypatch):
    assert main(["plot", str(tmp_path / "nowhere")]) == 2
    assert main(["plot", str(tmp_path)]) == 2  # a directory, but not a run
    (tmp_path / "metrics.jsonl").write_text('{"kind": "note", "step": 1}\n')
    assert main(["plot", str(tmp_path)]) == 2  # nothing to draw
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 4 and all(line.startswith("densebatch: error: ") for line in err)
    assert "does not exist" in err[0] and "no metrics.jsonl" in err[1] and "no train or eval record" in err[2]
    assert "pip install 'densebatch[plot]'" in err[3]
    assert not (tmp_path / "plots").exists()


def test_plot_reads_past_a_damaged_line_and_names_a_plots_path_it_cannot_write(run, capsys, tmp_path):
    damaged = tmp_path / "run"
    damaged.mkdir()
    (damaged / "metrics.jsonl").write_bytes((run / "metrics.jsonl").read_bytes() + b"\xff\xfe not UTF-8\n")
    assert main(["plot", str(damaged)]) == 0  # the damaged line is skipped, as a torn one is
    shutil.rmtree(damaged / "plots")
    (damaged / "plots").write_text("a file")
    capsys.readouterr()
    assert main(["plot", str(damaged)]) == 2
    assert "the plots cannot be written there" in capsys.readouterr().err

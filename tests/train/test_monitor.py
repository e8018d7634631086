"""metrics.jsonl writing (flushed, strict JSON), truncation on resume, console lines and the summary."""

from __future__ import annotations

import io
import json
import math

from densebatch.train.observe.monitor import Console, MetricsWriter, format_summary, read_metrics, truncate_metrics


def test_writer_flushes_each_line_and_writes_strict_json(tmp_path):
    path = tmp_path / "out" / "metrics.jsonl"
    w = MetricsWriter(path, append=False)
    w.write({"kind": "train", "step": 1, "loss": 2.5})
    w.write({"kind": "train", "step": 2, "loss": math.nan, "grad_norm": math.inf})
    lines = path.read_text().splitlines()  # readable while still open: flushed per line
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    assert json.loads(lines[1])["loss"] is None and json.loads(lines[1])["grad_norm"] is None
    w.close()
    MetricsWriter(path, append=True).write({"kind": "eval", "step": 2})
    assert len(read_metrics(path)) == 3
    MetricsWriter(path, append=False).close()
    assert read_metrics(path) == []


def test_truncate_keeps_records_up_to_step_and_drops_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    recs = [{"kind": "train", "step": s} for s in range(1, 6)] + [{"kind": "eval", "step": 4}, {"kind": "eval", "step": 2}]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"kind": "train", "st')
    dropped = truncate_metrics(path, after_step=3)
    kept = read_metrics(path)
    assert [(r["kind"], r["step"]) for r in kept] == [("train", 1), ("train", 2), ("train", 3), ("eval", 2)]
    assert dropped == 4
    assert path.read_text().endswith("\n")
    assert truncate_metrics(tmp_path / "absent.jsonl", 3) == 0


def _rec(step):
    return {"step": step, "loss": 1.0 / step, "lr": 1e-3, "fill_rate": 0.97, "real_tokens": 100}


def test_console_without_terminal_logs_about_every_tenth():
    lines = []
    c = Console(total_steps=20, initial_step=0, progress=True, stream=io.StringIO(), print_fn=lines.append)
    assert c.bar is None  # a StringIO is not a terminal
    for s in range(1, 21):
        c.step(_rec(s), 0.01)
    c.message("eval @ step 20")
    assert [line.split(" |")[0] for line in lines[:-1]] == ["step 1/20"] + [f"step {s}/20" for s in range(2, 21, 2)]
    assert "tok/s" in lines[0] and "fill 0.970" in lines[0] and "left" in lines[1]
    assert lines[-1] == "eval @ step 20"
    silent = []
    Console(20, 0, enabled=False, print_fn=silent.append).step(_rec(1), 0.01)
    assert silent == []


def test_summary_is_one_screen_with_the_facts():
    s = {
        "stop_reason": "max_steps",
        "steps": 100,
        "skipped_steps": 1,
        "real_tokens": 1_234_567,
        "loss_tokens": 600_000,
        "fill_rate": 0.991,
        "epoch": 1.5,
        "first_loss": 5.5,
        "final_loss": 1.25,
        "final_eval": {"kind": "eval", "step": 100, "loss": 1.3, "ppl": 3.67, "tokens": 5000, "accuracy": 0.85},
        "best_eval_loss": 1.3,
        "elapsed_s": 75.0,
        "session_seconds": 70.0,
        "session_real_tokens": 1_000_000,
        "output_dir": "runs/x",
        "processes": 2,
        "device": "cuda:0",
        "precision": "bf16",
    }
    text = format_summary(s)
    assert len(text.splitlines()) <= 20
    for needle in (
        "max_steps",
        "100",
        "skipped 1",
        "1.23M",
        "0.991",
        "5.5000",
        "1.2500",
        "1.3000",
        "3.6700",
        "accuracy",
        "0.8500",
        "1:15",
        "runs/x",
        "metrics.jsonl",
        "2 processes, cuda:0, bf16",
    ):
        assert needle in text, needle


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_console_on_a_terminal_draws_a_bar_with_the_numbers():
    stream, lines = _Terminal(), []
    c = Console(total_steps=None, initial_step=3, stream=stream, print_fn=lines.append)
    assert c.bar is not None
    c.set_total(10)
    c.step(_rec(4), 0.5)
    c.message("eval line")
    c.close()
    out = stream.getvalue()
    assert "loss=0.2500" in out and "fill=0.970" in out and "tok/s=200" in out and "4/10" in out
    assert lines == ["eval line"]
    assert Console(10, 0, progress=False, stream=_Terminal()).bar is None  # train.progress: false

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
    Console(20, initial_step=0, enabled=False, print_fn=silent.append).step(_rec(1), 0.01)
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
    assert Console(10, initial_step=0, progress=False, stream=_Terminal()).bar is None  # train.progress: false


class _FakeCuda:
    """torch.cuda's peak-memory counters as a device would keep them: a peak since the last reset."""

    def __init__(self):
        self.now = self.allocated = self.reserved = 0

    def use(self, allocated: int, reserved: int) -> None:  # a moment of the run holding this much
        self.allocated, self.reserved = max(self.allocated, allocated), max(self.reserved, reserved)

    def max_memory_allocated(self, device=None):
        return self.allocated

    def max_memory_reserved(self, device=None):
        return self.reserved

    def reset_peak_memory_stats(self, device=None):
        self.allocated = self.reserved = 0


def test_the_run_peak_survives_the_per_step_resets(monkeypatch):
    """Each step's record holds that step's peak (the counter is reset per step); the run's true peak, in the
    last record, is the largest any moment saw: a big middle step, and an evaluation after the last step.
    Every rank's peak is gathered; the next run starts afresh."""
    import torch

    from densebatch import torch_features
    from densebatch.train.observe.monitor import finish_run, resource_usage

    fake = _FakeCuda()
    for name in ("max_memory_allocated", "max_memory_reserved", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    dev = torch.device("cuda", 0)
    finish_run(
        dev, gather=lambda mine: [mine], write=lambda rec: None, step=0, reason="start"
    )  # a run before this one left nothing behind
    steps = [(7e9, 8e9), (50e9, 60e9), (9e9, 61e9)]  # (allocated, reserved) each step at its peak
    records = []
    for allocated, reserved in steps:
        fake.use(int(allocated), int(reserved))
        records.append(resource_usage(dev))
    assert [r["cuda_max_allocated_gb"] for r in records] == [7.0, 50.0, 9.0]  # per step, as before
    assert records[-1]["cuda_max_reserved_gb"] == 61.0
    fake.use(int(55e9), int(62e9))  # the final evaluation, after the last step's record
    torch_features.record_kernel("varlen (FlashAttention) bf16")
    other_rank = {"cuda_peak_allocated_gb": 56.5, "cuda_peak_reserved_gb": 60.0, "mem_peak_rss_gb": 2.0}
    written = []
    facts = finish_run(dev, gather=lambda mine: [mine, other_rank], write=written.append, step=3, reason="max_steps")
    (rec,) = written
    assert rec["kind"] == "run" and rec["step"] == 3 and rec["stop_reason"] == "max_steps"
    mine = rec["memory_peak"][0]
    assert mine["cuda_peak_allocated_gb"] == 55.0 and mine["cuda_peak_reserved_gb"] == 62.0 and "mem_peak_rss_gb" in mine
    assert rec["memory_peak"][1] == other_rank
    assert rec["cuda_peak_allocated_gb"] == 56.5 and rec["cuda_peak_reserved_gb"] == 62.0  # the largest of the ranks
    assert rec["attention"] == [{"kernel": "varlen (FlashAttention) bf16", "layer_calls": 1}]
    assert facts == {"memory_peak": rec["memory_peak"], "attention": {"varlen (FlashAttention) bf16": 1}}
    fake.reset_peak_memory_stats()
    again = []
    finish_run(dev, gather=lambda mine: [mine], write=again.append, step=0, reason="next")
    assert again[0]["cuda_peak_allocated_gb"] == 0.0 and again[0]["attention"] == []  # the next run starts afresh
    cpu = []
    finish_run(torch.device("cpu"), gather=lambda mine: [mine], write=cpu.append, step=0, reason="cpu")
    assert set(cpu[0]["memory_peak"][0]) == {"mem_peak_rss_gb"} and "cuda_peak_allocated_gb" not in cpu[0]


def test_summary_names_each_rank_s_true_peak_and_the_attention_kernels():
    from densebatch.train.observe.monitor import format_summary

    s = {
        "stop_reason": "max_steps",
        "steps": 3,
        "real_tokens": 10,
        "loss_tokens": 8,
        "fill_rate": 1.0,
        "epoch": 0.5,
        "elapsed_s": 1.0,
        "output_dir": "runs/x",
        "memory_peak": [
            {"cuda_peak_allocated_gb": 50.0, "cuda_peak_reserved_gb": 61.5, "mem_peak_rss_gb": 3.0},
            {"cuda_peak_allocated_gb": 49.0, "cuda_peak_reserved_gb": 60.0, "mem_peak_rss_gb": 3.1},
        ],
        "attention": {"varlen (FlashAttention) bf16": 48},
    }
    text = format_summary(s)
    assert "rank 0: 50.00 GB allocated, 61.50 GB reserved" in text and "rank 1: 49.00 GB allocated" in text
    assert "attention        varlen (FlashAttention) bf16 (48 layer calls)" in text

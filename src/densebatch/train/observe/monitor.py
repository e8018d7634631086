"""What a run shows and leaves behind: metrics.jsonl, the progress bar / periodic log lines, the summary.

``metrics.jsonl`` holds one JSON object per line: ``"kind": "train"`` per optimizer step, ``"kind":
"eval"`` per evaluation (other kinds, e.g. anomaly events, may be added by the caller), and last ``"kind":
"run"`` (the run's true peak memory per rank and the attention kernels its layers ran). Every line is
flushed as it is written, so a killed process leaves only complete lines (at most one torn last line,
which ``read_metrics`` and ``truncate_metrics`` ignore). Non-finite floats are written as ``null``
so the file stays strict JSON.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import torch
from tqdm import tqdm

from densebatch import torch_features
from densebatch.atomic import write_file

try:
    import resource
except ImportError:  # not on Windows
    resource = None

METRICS_FILE = "metrics.jsonl"
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_EVAL_BASE = ("kind", "step", "loss", "ppl", "tokens", "real_tokens", "batches", "elapsed_s")


def strict_json(value: Any) -> Any:
    """``value`` for strict JSON (``allow_nan=False``): every float that is not finite as None, inside
    dicts and lists too (metrics records; ``lr_finder.json``, whose ``trials`` are a list of dicts)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [strict_json(v) for v in value]
    return value


class MetricsWriter:
    """Append JSON records to ``path``, one per line, flushed per line. ``append=False`` starts afresh."""

    def __init__(self, path: str | Path, append: bool = True):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO | None = open(self.path, "a" if append else "w", encoding="utf-8")

    def write(self, record: dict) -> None:
        assert self._file is not None, "MetricsWriter used after close()"
        self._file.write(json.dumps(strict_json(record), allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_metrics(path: str | Path) -> list[dict]:
    """All complete records of a metrics file (a torn last line from a killed process is skipped)."""
    out = []
    p = Path(path)
    if not p.exists():
        return out
    for line in p.read_text(encoding="utf-8", errors="replace").splitlines():  # a damaged line is skipped
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def truncate_metrics(path: str | Path, after_step: int) -> int:
    """Keep only records with ``step <= after_step`` (and complete lines); returns how many were dropped.

    Used on resume from the checkpoint of step ``after_step``: the steps the dead process logged after
    that checkpoint will be run (and logged) again. Rewritten through a temporary file and an atomic
    rename, so a crash here cannot lose the records that are kept.
    """
    p = Path(path)
    if not p.exists():
        return 0
    lines = p.read_text(encoding="utf-8").splitlines()
    kept = []
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and rec.get("step", 0) <= after_step:
            kept.append(line)
    write_file(p, "".join(line + "\n" for line in kept))
    return len(lines) - len(kept)


class _RunPeak:
    """The run's true peak device memory (allocated and reserved, this process), kept across the per-step resets.

    CUDA keeps one peak counter per process; ``resource_usage`` reads it for each step's record and resets it,
    so a step's record holds that step's peak. Before each reset the reading is folded in here (process-wide,
    as the counter is), and ``finish_run`` folds in what came after the last step (an evaluation)."""

    def __init__(self) -> None:
        self.allocated = self.reserved = 0  # bytes

    def fold(self, allocated: int, reserved: int) -> None:
        self.allocated, self.reserved = max(self.allocated, allocated), max(self.reserved, reserved)

    def read(self, device: torch.device) -> dict[str, float]:
        """``cuda_peak_allocated_gb`` / ``cuda_peak_reserved_gb`` so far (CUDA; the counter is not reset) and the
        process's peak resident memory ``mem_peak_rss_gb`` (every device)."""
        out = {k: v for k, v in resource_usage(device, reset=False).items() if k == "mem_peak_rss_gb"}
        if device.type == "cuda":
            self.fold(torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device))
            out |= {"cuda_peak_allocated_gb": self.allocated / 1e9, "cuda_peak_reserved_gb": self.reserved / 1e9}
        return out


RUN_PEAK = _RunPeak()


def finish_run(device: torch.device, *, gather: Callable, write: Callable[[dict], None], step: int, reason: str) -> dict:
    """Write the run's last record (``"kind": "run"``: every rank's true peak memory, the largest of them, and
    the attention kernels this rank's layers ran, with any fallback's reason) and return its facts for the
    summary; then start the next run's afresh. ``gather``: every rank's object (a collective: every rank calls)."""
    peaks = gather(RUN_PEAK.read(device))  # [rank 0's, rank 1's, ...]
    facts = {"memory_peak": peaks, "attention": torch_features.kernels_used()}
    top = {k: max(p[k] for p in peaks) for k in ("cuda_peak_allocated_gb", "cuda_peak_reserved_gb") if k in peaks[0]}
    kernels = [{"kernel": k, "layer_calls": n} for k, n in facts["attention"].items()]  # a list: not a sink's scalars
    write({"kind": "run", "step": step, "stop_reason": reason} | top | facts | {"attention": kernels})
    RUN_PEAK.allocated = RUN_PEAK.reserved = 0
    torch_features.reset_kernels()
    return facts


def resource_usage(device: torch.device, reset: bool = True) -> dict[str, float]:
    """Memory figures for a step's record, in GB: the process's resident memory now and its peak
    (CPU), and on CUDA the peak allocated / reserved since the previous call (the peak is reset
    here, so each record holds its own step's peak; ``RUN_PEAK`` keeps the run's). A few microseconds; no
    device synchronisation."""
    out: dict[str, float] = {}
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            out["mem_rss_gb"] = int(f.read().split()[1]) * _PAGE / 1e9
    except (OSError, ValueError, IndexError):
        pass
    if resource is not None:  # ru_maxrss: kilobytes on Linux, bytes on macOS
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024) / 1e9
        # The kernel's RSS counters are approximate (per-CPU batches): the peak may read a few hundred kB
        # below the resident figure read just before; a peak is never below the present.
        out["mem_peak_rss_gb"] = max(peak, out.get("mem_rss_gb", 0.0))
    if device.type == "cuda" and reset:
        allocated, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
        RUN_PEAK.fold(allocated, reserved)
        out["cuda_max_allocated_gb"] = allocated / 1e9
        out["cuda_max_reserved_gb"] = reserved / 1e9
        torch.cuda.reset_peak_memory_stats(device)
    return out


def _fmt_tokens(n: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def _fmt_time(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class Console:
    """Progress bar on a terminal; one log line every ~10% of the steps when not a terminal (CI, files).

    ``enabled=False`` silences everything (non-zero ranks). The bar shows loss, lr, real tokens/s,
    fill rate, and (from tqdm) time left; tokens/s on the bar is the average since the bar started.
    """

    def __init__(
        self,
        total_steps: int | None,
        *,
        initial_step: int,
        enabled: bool = True,
        progress: bool = True,
        stream: TextIO | None = None,
        print_fn: Callable[[str], None] | None = None,
    ):
        self.enabled = enabled
        self.total = total_steps
        self._print = print_fn or (lambda s: print(s, flush=True))
        stream = stream or sys.stderr
        use_bar = enabled and progress and hasattr(stream, "isatty") and stream.isatty()
        self.bar = (
            tqdm(
                total=total_steps,
                initial=initial_step,
                desc="train",
                unit="step",
                file=stream,
                dynamic_ncols=True,
                disable=not use_bar,
            )
            if use_bar
            else None
        )
        self._log_every = max(1, (total_steps or 100) // 10)
        self._initial = initial_step
        self._tokens = 0
        self._seconds = 0.0

    def set_total(self, total_steps: int | None) -> None:
        self.total = total_steps
        self._log_every = max(1, (total_steps or 100) // 10)
        if self.bar is not None:
            self.bar.total = total_steps
            self.bar.refresh()

    def step(self, rec: dict, step_seconds: float) -> None:
        if not self.enabled:
            return
        self._tokens += rec.get("real_tokens", 0)
        self._seconds += step_seconds
        tps = self._tokens / self._seconds if self._seconds > 0 else 0.0
        loss = rec.get("loss")
        loss_s = f"{loss:.4f}" if isinstance(loss, float) and math.isfinite(loss) else "skip"
        if self.bar is not None:
            self.bar.set_postfix_str(
                f"loss={loss_s} lr={rec['lr']:.2e} tok/s={_fmt_tokens(tps)} fill={rec['fill_rate']:.3f}", refresh=False
            )
            self.bar.update(1)
            return
        step = rec["step"]
        if step % self._log_every == 0 or step == self.total or step == 1:
            left = ""
            if self.total and tps > 0 and step < self.total:
                per_step = self._seconds / max(1, step - self._initial)
                left = f" | left {_fmt_time(per_step * (self.total - step))}"
            of = f"/{self.total}" if self.total else ""
            self._print(
                f"step {step}{of} | loss {loss_s} | lr {rec['lr']:.2e} | {_fmt_tokens(tps)} tok/s"
                f" | fill {rec['fill_rate']:.3f}{left}"
            )

    def eval(self, rec: dict) -> None:
        """One line per evaluation: loss, perplexity and any extra numeric metric (e.g. accuracy)."""
        extra = "".join(f" {k} {v:.4f}" for k, v in rec.items() if k not in _EVAL_BASE and isinstance(v, float))
        fmt = lambda v: f"{v:.4f}" if isinstance(v, float) and math.isfinite(v) else "n/a"  # noqa: E731
        self.message(f"eval @ step {rec['step']}: loss {fmt(rec.get('loss'))} ppl {fmt(rec.get('ppl'))}{extra}")

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            with tqdm.external_write_mode(file=self.bar.fp):  # clear the bar, print, redraw it
                self._print(text)
        else:
            self._print(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def format_summary(s: dict) -> str:
    """One screen of end-of-run facts from the loop's summary dict (keys as in ``Trainer.summary()``)."""
    lines = [f"── densebatch run finished: {s['stop_reason']} ──"]
    total = f" (skipped {s['skipped_steps']})" if s.get("skipped_steps") else ""
    lines.append(f"steps            {s['steps']}{total}")
    lines.append(
        f"tokens seen      {_fmt_tokens(s['real_tokens'])} real, {_fmt_tokens(s['loss_tokens'])} with loss, "
        f"epoch {s['epoch']:.2f}"
    )
    lines.append(f"fill rate        {s['fill_rate']:.3f} (real tokens / slots computed)")
    fmt = lambda v: f"{v:.4f}" if isinstance(v, (int, float)) and v is not None and math.isfinite(v) else "n/a"  # noqa: E731
    lines.append(f"train loss       {fmt(s.get('first_loss'))} (first) → {fmt(s.get('final_loss'))} (final)")
    ev = s.get("final_eval")
    if ev:
        lines.append(
            f"eval loss        {fmt(ev.get('loss'))}  ppl {fmt(ev.get('ppl'))}  ({_fmt_tokens(ev.get('tokens', 0))} tokens)"
        )
        for k, v in ev.items():
            if k not in _EVAL_BASE and isinstance(v, (int, float)) and not isinstance(v, bool):
                lines.append(f"eval {k:<11} {v if isinstance(v, int) else fmt(v)}")  # counts stay integers
        for name, loss in (ev.get("loss_by_source") or {}).items():  # per data source (2+ sources)
            tokens = (ev.get("tokens_by_source") or {}).get(name, 0)
            lines.append(f"  source {name:<9} loss {fmt(loss)}  ({_fmt_tokens(tokens)} tokens)")
    if s.get("best_eval_loss") is not None and ev and s["best_eval_loss"] != ev.get("loss"):
        lines.append(f"best eval loss   {fmt(s['best_eval_loss'])}")
    tps = s["session_real_tokens"] / s["session_seconds"] if s.get("session_seconds") else 0.0
    lines.append(f"wall time        {_fmt_time(s['elapsed_s'])} total, {_fmt_tokens(tps)} real tok/s this session")
    if "processes" in s:
        lines.append(
            f"ran on           {s['processes']} process{'es' if s['processes'] != 1 else ''}, {s['device']}, {s['precision']}"
        )
    for rank, peak in enumerate(s.get("memory_peak") or []):  # per rank: the run's true peak
        if "cuda_peak_allocated_gb" in peak:
            lines.append(
                f"peak memory      rank {rank}: {peak['cuda_peak_allocated_gb']:.2f} GB allocated, "
                f"{peak['cuda_peak_reserved_gb']:.2f} GB reserved (CUDA, whole run, the final evaluation included)"
            )
        elif peak.get("mem_peak_rss_gb") is not None:
            lines.append(
                f"peak memory      rank {rank}: {peak['mem_peak_rss_gb']:.2f} GB resident (whole run, the final evaluation included)"
            )
    for what, calls in (s.get("attention") or {}).items():  # the kernels the layers ran, and any fallback's reason
        lines.append(f"attention        {what} ({calls} layer calls)")
    lines.append(f"outputs          {s['output_dir']}  (metrics: {METRICS_FILE})")
    return "\n".join(lines)

"""Metric sinks beyond metrics.jsonl: every numeric scalar of every record to TensorBoard and/or CSV.

``build_sinks(names, output_dir)`` returns one sink per name (``"tensorboard"``, ``"csv"``, and the trackers
of ``trackers.py``, ``"wandb"`` and ``"mlflow"``); each has
``write(record)`` and ``close()`` and is handed exactly the records ``metrics.jsonl`` receives.

What is written: a record of kind ``K`` at ``step`` S gives one scalar ``K/<key>`` per numeric field
at x = S (``train/loss``, ``eval/loss``, ``rollback/lr_scale``); nested dicts are flattened
(``loss_by_source: {"web": 2.1}`` → ``train/loss_by_source/web``). ``kind`` and ``step`` are the tag
and the axis, not values; booleans, ``None``, strings and lists are skipped by TensorBoard (the CSV
keeps strings, e.g. ``skipped``). Records without an integer ``step`` are ignored.

Replayed steps: after a resume the loop logs again from the checkpoint's step + 1, and after a
rollback from the restored step + 1. Both sinks treat a train record whose step is not past the last
train step, and the first record a sink receives, as the start of a new timeline: everything at that
step or later is dropped (TensorBoard: the writer is reopened with ``purge_step``; CSV: the files are
rewritten without those rows), so a curve never doubles back on itself. ``metrics.jsonl`` keeps every
record, and the plots mark the rollbacks.
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Any, Protocol

from densebatch.atomic import write_file
from densebatch.errors import ConfigError
from densebatch.train.observe import trackers
from densebatch.train.observe.scalars import flatten, numeric_scalars, record_step

__all__ = [
    "CSV_DIR",
    "SINKS",
    "TENSORBOARD_DIR",
    "CSVSink",
    "Sink",
    "TensorBoardSink",
    "build_sinks",
    "flatten",
    "numeric_scalars",
]

SINKS = ("tensorboard", "csv", "wandb", "mlflow")
TENSORBOARD_DIR = "tensorboard"  # event files: output_dir/tensorboard/events.out.tfevents.*
CSV_DIR = "csv"  # output_dir/csv/<kind>.csv


class Sink(Protocol):
    def write(self, record: dict) -> None: ...

    def close(self) -> None: ...


class _Timeline:
    """Says when a record starts a new timeline: the first record, or a train step not past the last one.

    Only train records reveal a replay (one per step, in step order within a timeline); several
    records of another kind may share a step (two warnings) and must not purge each other.
    """

    def __init__(self) -> None:
        self.started = False
        self.last_train = -math.inf

    def purge_from(self, kind: str, step: int) -> int | None:
        """The step from which earlier records must be dropped before writing this one, or None."""
        purge = None
        if not self.started:
            purge, self.started = step, True
        elif kind == "train" and step <= self.last_train:
            purge = step
        if kind == "train":
            self.last_train = step
        elif purge is not None:
            self.last_train = min(self.last_train, step - 1)
        return purge


def tensorboard_writer_class():
    """``torch.utils.tensorboard.SummaryWriter``, or a one-line ConfigError naming the extra."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError(
            "train.report_to: tensorboard needs the tensorboard package: pip install 'densebatch[tensorboard]'"
        ) from None
    return SummaryWriter


class TensorBoardSink:
    """Scalars to ``output_dir/tensorboard`` (``tensorboard --logdir output_dir`` shows them)."""

    def __init__(self, output_dir: str | Path, flush_secs: int = 10):
        self._writer_class = tensorboard_writer_class()  # fail at build time, not at the first step
        self.log_dir = Path(output_dir) / TENSORBOARD_DIR
        self.flush_secs = flush_secs  # TensorBoard's default (120 s) is too slow to watch a short run live
        self._writer = None
        self._timeline = _Timeline()

    def write(self, record: dict) -> None:
        step = record_step(record)
        if step is None:
            return
        kind = str(record.get("kind", "train"))
        purge = self._timeline.purge_from(kind, step)
        if purge is not None:
            if self._writer is not None:
                self._writer.close()
            # purge_step: TensorBoard hides every earlier event at this step or later (all tags).
            self._writer = self._writer_class(log_dir=str(self.log_dir), purge_step=purge, flush_secs=self.flush_secs)
        for tag, value in numeric_scalars(record).items():
            self._writer.add_scalar(f"{kind}/{tag}", value, global_step=step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class CSVSink:
    """One CSV per record kind under ``output_dir/csv``: ``step`` then every scalar field seen so far.

    Rows are appended and flushed as they come; a record with a field not yet in the header rewrites
    that file once with the wider header (fields appear in the first steps, so this is rare). Reopened
    on a resume, a file keeps its header and its rows before the first replayed step.
    """

    def __init__(self, output_dir: str | Path):
        self.dir = Path(output_dir) / CSV_DIR
        self._files: dict[str, Any] = {}  # kind -> open append handle
        self._headers: dict[str, list[str]] = {}
        self._timeline = _Timeline()

    def _path(self, kind: str) -> Path:
        return self.dir / f"{kind}.csv"

    def _read(self, kind: str) -> tuple[list[str], list[dict]]:
        path = self._path(kind)
        if not path.exists():
            return [], []
        text = path.read_text(encoding="utf-8")
        if text and not text.endswith("\n"):  # a torn last line from a killed process
            text = text[: text.rfind("\n") + 1]
        reader = csv.DictReader(io.StringIO(text))
        return list(reader.fieldnames or []), list(reader)

    def _rewrite(self, kind: str, header: list[str], rows: list[dict]) -> None:
        if kind in self._files:
            self._files.pop(kind).close()
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=header, lineterminator="\n", extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
        self.dir.mkdir(parents=True, exist_ok=True)
        write_file(self._path(kind), buf.getvalue())  # atomic: a crash here keeps the old file
        self._headers[kind] = header

    def _purge(self, step: int) -> None:
        for path in sorted(self.dir.glob("*.csv")) if self.dir.exists() else []:
            header, rows = self._read(path.stem)
            self._rewrite(path.stem, header or ["step"], [r for r in rows if _int(r.get("step")) < step])

    def write(self, record: dict) -> None:
        step = record_step(record)
        if step is None:
            return
        kind = str(record.get("kind", "train"))
        purge = self._timeline.purge_from(kind, step)
        if purge is not None:
            self._purge(purge)
        row = {"step": step} | {
            k: _cell(v) for k, v in flatten(record).items() if v is None or isinstance(v, (int, float, str, bool))
        }
        header = self._headers.get(kind)
        if header is None:
            header, _ = self._read(kind)
            self._headers[kind] = header
        new = [k for k in row if k not in header]
        if new:
            _, rows = self._read(kind)
            self._rewrite(kind, header + new if header else list(row), rows)
        f = self._files.get(kind)
        if f is None:
            f = self._files[kind] = open(self._path(kind), "a", encoding="utf-8", newline="")
        csv.DictWriter(f, fieldnames=self._headers[kind], lineterminator="\n").writerow(row)
        f.flush()  # like metrics.jsonl: a killed process leaves complete lines

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def _cell(value: Any) -> Any:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return ""  # an empty cell reads back as missing in pandas / spreadsheets
    return value


def _int(text: Any) -> int:
    try:
        return int(text)
    except (TypeError, ValueError):
        return -1  # a malformed row sorts before every step: kept rather than silently lost


def build_sinks(names: list[str] | tuple[str, ...], output_dir: str | Path, config: dict | None = None) -> list[Sink]:
    """One sink per name (duplicates once); ``config`` (the resolved configuration) becomes a tracker run's
    parameters. Unknown names and a missing package are ConfigErrors."""
    out: list[Sink] = []
    for name in dict.fromkeys(names):
        if name == "tensorboard":
            out.append(TensorBoardSink(output_dir))
        elif name == "csv":
            out.append(CSVSink(output_dir))
        elif name in ("wandb", "mlflow"):
            out.append((trackers.WandbSink if name == "wandb" else trackers.MLflowSink)(output_dir, config or {}))
        else:
            raise ConfigError(f"train.report_to: unknown sink {name!r}; expected some of {', '.join(SINKS)}")
    return out

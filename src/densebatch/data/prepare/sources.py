"""Sources: read records from a file or directory, reporting every unreadable one with its place.

``iter_records(path, fmt)`` yields, for each record, either ``(where, record_dict)`` or a
``BadRecord(where, reason, message)``; the caller decides whether a bad record stops the run.
``where`` names the file and place: ``file:LINE`` (1-based line) for JSONL, CSV and text, and
``file: record N (0-based index)`` for JSON arrays, Parquet and Hugging Face datasets (a
``save_to_disk`` directory, read through ``datasets.load_from_disk``: the optional ``datasets`` extra).

A path with a glob pattern (``corpus/part-*.jsonl``, ``**`` for every level below) stands for the files
it matches, in sorted order, read one after the other (``expand``); ``prepare`` keeps each file apart.

Undecodable bytes are read with ``surrogateescape`` so one bad record can be skipped without
losing the rest of the file; ``has_undecodable`` finds them afterwards.
Problems with the whole file (missing, empty, not parseable at all) always raise ``DataError``.
"""

from __future__ import annotations

import csv
import glob
import itertools
import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from densebatch.data.prepare.row_ranges import read_hf_disk, read_parquet
from densebatch.errors import DataError

FORMATS = ("json", "jsonl", "csv", "parquet", "text", "hf_disk")
_SUFFIXES = {
    ".json": "json",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".csv": "csv",
    ".parquet": "parquet",
    ".txt": "text",
    ".text": "text",
    ".md": "text",
}
SURROGATE = re.compile("[\udc80-\udcff]")


@dataclass(frozen=True)
class BadRecord:
    where: str
    reason: str  # a short key for counting: invalid_json, undecodable_bytes, wrong_type, ...
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


def is_pattern(path: str | Path) -> bool:
    """Whether ``path`` is a glob pattern (``*``, ``?`` or ``[``) rather than one file or directory (a path
    that exists is itself, whatever its name holds)."""
    return glob.has_magic(str(path)) and not Path(path).exists()


def expand(path: str | Path) -> list[Path]:
    """The files ``path`` stands for: itself, or the files its pattern matches, sorted (``DataError`` when
    it matches none)."""
    if not is_pattern(path):
        return [Path(path)]
    found = sorted(Path(f) for f in glob.glob(str(path), recursive=True) if Path(f).is_file())
    if not found:
        raise DataError(f"{path}: no file matches this pattern")
    return found


def detect_format(path: str | Path, fmt: str = "auto") -> str:
    p = Path(path)
    if fmt != "auto":
        return fmt
    if is_pattern(p):  # a pattern's files are each read in their own format; this is the first one's
        p = expand(p)[0]
    if p.is_dir():
        return "hf_disk"
    found = _SUFFIXES.get(p.suffix.lower())
    if found is None:
        raise DataError(f"{p}: cannot tell the format from the name; set data.format to one of {', '.join(FORMATS)}")
    return found


def has_undecodable(value: Any) -> bool:
    """True when a string anywhere in ``value`` holds bytes that were not valid UTF-8."""
    if isinstance(value, str):
        return SURROGATE.search(value) is not None
    if isinstance(value, dict):
        return any(has_undecodable(v) for v in value.values())
    if isinstance(value, list):
        return any(has_undecodable(v) for v in value)
    return False


def _check_file(p: Path) -> None:
    if not p.exists():
        raise DataError(f"{p}: file not found")
    if p.is_file() and p.stat().st_size == 0:
        raise DataError(f"{p}: the file is empty")


def iter_records(path: str | Path, fmt: str = "auto") -> Iterator[tuple[str, dict] | BadRecord]:
    """Records of ``path`` in file order (see the module docstring)."""
    if is_pattern(path):
        for f in expand(path):
            yield from iter_records(f, fmt)
        return
    p = Path(path)
    _check_file(p)
    fmt = detect_format(p, fmt)
    reader = {
        "json": _json_array,
        "jsonl": _jsonl,
        "csv": _csv,
        "parquet": read_parquet,
        "text": _text_lines,
        "hf_disk": read_hf_disk,
    }[fmt]
    count = 0
    for item in reader(p):
        count += 1
        yield item
    if count == 0:  # the readers name the emptiness they can tell apart (an empty JSON array, a header alone)
        raise DataError(f"{p}: holds no records (the file is empty or only whitespace)")


def _undecodable_where(raw: bytes) -> str:
    try:
        raw.decode("utf-8")
        return ""
    except UnicodeDecodeError as e:
        return f"byte {e.start} is not valid UTF-8"


@dataclass(frozen=True)
class LineRange:
    """Lines ``first_line`` ... of a JSONL file, bytes ``[start, stop)``; ``last``: the file's last range
    (blank lines at its end are harmless; before any later line they are reported)."""

    path: str
    start: int
    stop: int
    first_line: int
    last_line: int
    last: bool


def jsonl_ranges(path: str | Path, lines: int) -> Iterator[LineRange]:
    """``path`` cut into ranges of ``lines`` non-blank lines each (the last may hold fewer), every cut
    just before a non-blank line, so each range reads on its own exactly as the whole file reads (its
    blank lines are followed by a record, or end the file). Reads lines, parses nothing."""
    p = Path(path)
    _check_file(p)
    start = pos = 0
    first = lineno = 1
    count = 0
    with open(p, "rb") as f:
        for raw in f:
            if raw.strip() and count == lines:  # a full range ends before this non-blank line
                yield LineRange(str(p), start, pos, first, lineno - 1, False)
                start, first, count = pos, lineno, 0
            count += bool(raw.strip())
            pos += len(raw)
            lineno += 1
    if count == 0 and start == 0:
        next(iter_records(p, "jsonl"), None)  # the one-line error for a file without records
    yield LineRange(str(p), start, pos, first, lineno - 1, True)


def read_jsonl_range(r: LineRange) -> Iterator[tuple[str, dict] | BadRecord]:
    """The records of one range, as ``iter_records`` yields them for those lines of the whole file."""
    return _jsonl(Path(r.path), r)


def _jsonl(p: Path, part: LineRange | None = None) -> Iterator[tuple[str, dict] | BadRecord]:
    blank: list[int] = []
    with open(p, "rb") as f:
        first = 1
        if part is not None:
            f.seek(part.start)
            first = part.first_line
        lines = f if part is None else _lines_until(f, part.stop - part.start)
        for lineno, raw in enumerate(lines, first):
            where = f"{p}:{lineno}"
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]  # a UTF-8 byte-order mark is not content
            if not raw.strip():
                blank.append(lineno)  # trailing blank lines are harmless; one between records is reported
                continue
            for b in blank:
                yield BadRecord(f"{p}:{b}", "blank_line", "blank line (JSONL holds one JSON object on every line)")
            blank.clear()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield BadRecord(
                    where, "undecodable_bytes", f"undecodable bytes ({_undecodable_where(raw)}); the file must be UTF-8"
                )
                continue
            # Without its line break: json counts a column after the last "\n" it saw, so an error
            # at the end of a cut-off line would read "line 2, column 1" instead of its real column.
            text = text.rstrip("\r\n")
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                yield BadRecord(where, "invalid_json", _jsonl_error(text, e, lineno))
                continue
            except RecursionError:
                yield BadRecord(where, "invalid_json", TOO_DEEP)
                continue
            if not isinstance(obj, dict):
                yield BadRecord(where, "wrong_type", f"expected a JSON object per line, got {type(obj).__name__}")
                continue
            yield where, obj
        if part is not None and not part.last:  # a record follows in the next range: these were between records
            for b in blank:
                yield BadRecord(f"{p}:{b}", "blank_line", "blank line (JSONL holds one JSON object on every line)")


TOO_DEEP = "JSON nested too deeply to read (lists or objects about a thousand levels deep)"


def _lines_until(f, size: int) -> Iterator[bytes]:
    """The lines of ``f`` from where it stands, ``size`` bytes of them."""
    while size > 0:
        raw = f.readline()
        if not raw:
            return
        size -= len(raw)
        yield raw


def _jsonl_error(line: str, e: json.JSONDecodeError, lineno: int) -> str:
    """What is wrong with one JSONL line, at its real column (1-based, in characters)."""
    msg = f"invalid JSON at column {e.colno}: {e.msg}"
    if e.pos >= len(line.rstrip()):
        msg += " (the line ends before its JSON object does: cut off, or a record spread over several lines?)"
    if lineno == 1 and line.lstrip().startswith("["):
        msg += "; the file looks like one JSON array: set data.format: json"
    return msg


def _looks_like_jsonl(text: str) -> bool:
    """True when the first two non-blank lines each hold one JSON object (JSONL read as one JSON value)."""
    lines = [line for line in text.splitlines() if line.strip()][:2]
    try:
        return len(lines) == 2 and all(isinstance(json.loads(line), dict) for line in lines)
    except (json.JSONDecodeError, RecursionError):
        return False


def _json_array(p: Path) -> Iterator[tuple[str, dict] | BadRecord]:
    text = p.read_bytes().decode("utf-8-sig", "surrogateescape")
    try:
        data = json.loads(text)
    except RecursionError:
        raise DataError(f"{p}: {TOO_DEEP} (a JSON array cannot be read around it; as JSONL the line would be skipped)") from None
    except json.JSONDecodeError as e:
        if _looks_like_jsonl(text):
            raise DataError(
                f"{p}: read as one JSON array (data.format: json), but the content looks like JSONL, one JSON "
                "object per line: set data.format: jsonl (or auto with a .jsonl file name)"
            ) from None
        # One syntax error makes the whole array unreadable: no record can be skipped safely.
        raise DataError(
            f"{p}:{e.lineno}: invalid JSON at column {e.colno}: {e.msg} (a JSON array cannot be read around "
            "an error; fix it, or write one record per line as JSONL so bad lines can be skipped)"
        ) from None
    if isinstance(data, dict):
        raise DataError(
            f"{p}: expected a JSON array of records at the top level, got an object (one record per line? set data.format: jsonl)"
        )
    if not isinstance(data, list):
        raise DataError(f"{p}: expected a JSON array of records at the top level, got {type(data).__name__}")
    if not data:
        raise DataError(f"{p}: holds no records (an empty JSON array)")
    for i, obj in enumerate(data):
        where = f"{p}: record {i} (0-based index)"
        if not isinstance(obj, dict):
            yield BadRecord(where, "wrong_type", f"expected a JSON object, got {type(obj).__name__}")
        elif has_undecodable(obj):
            yield BadRecord(where, "undecodable_bytes", "undecodable bytes; the file must be UTF-8")
        else:
            yield where, obj


def _csv(p: Path) -> Iterator[tuple[str, dict] | BadRecord]:
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # long documents are legitimate in one field
    with open(p, encoding="utf-8-sig", errors="surrogateescape", newline="") as f:
        reader = csv.reader(f)
        try:
            header = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            raise DataError(f"{p}:1: cannot read the CSV header: {e}") from None
        if all(not h.strip() for h in header) and not any(any(c.strip() for c in row) for row in reader):
            return  # only whitespace: no records
        if not header or len(set(header)) != len(header) or any(not h.strip() for h in header):
            raise DataError(f"{p}:1: the CSV header must name every column once; got {header}")
        prev_end, rows = reader.line_num, 0
        while True:
            start = prev_end + 1
            try:
                row = next(reader)
            except StopIteration:
                if not rows:
                    raise DataError(f"{p}: holds no records (a header with columns {', '.join(header)}, and no rows)") from None
                return
            except csv.Error as e:
                raise DataError(f"{p}:{start}: malformed CSV: {e}") from None
            prev_end = reader.line_num
            where = f"{p}:{start}"
            if not row or all(not c.strip() for c in row):
                continue
            rows += 1
            if len(row) != len(header):
                yield BadRecord(where, "wrong_field_count", f"row has {len(row)} fields, the header has {len(header)}")
                continue
            rec = dict(zip(header, row))
            if has_undecodable(rec):
                yield BadRecord(where, "undecodable_bytes", "undecodable bytes; the file must be UTF-8")
                continue
            yield where, rec


def _text_lines(p: Path) -> Iterator[tuple[str, dict] | BadRecord]:
    """The text format yields one record per paragraph; ``prepare`` regroups them for chunking. Read line by
    line (memory: one paragraph), with the lines ``str.splitlines`` of the whole text would give."""
    start, buf = 0, []
    for lineno, line in enumerate(itertools.chain(_text_file_lines(p), [""]), 1):
        if line.strip():
            if not buf:
                start = lineno
            buf.append(line)
        elif buf:
            para = "\n".join(buf)
            buf = []
            if has_undecodable(para):
                yield BadRecord(f"{p}:{start}", "undecodable_bytes", "undecodable bytes; the file must be UTF-8")
            else:
                yield f"{p}:{start}", {"text": para}


def _text_file_lines(p: Path) -> Iterator[str]:
    with open(p, "rb") as f:
        for i, raw in enumerate(f):
            text = raw.decode("utf-8-sig" if i == 0 else "utf-8", "surrogateescape")
            yield from text.splitlines()  # also \r, \x0b, \x0c, \x1c-\x1e, \x85, \u2028, \u2029 inside a line

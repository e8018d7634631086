"""Parquet records: the whole file in order (``read_parquet``, what ``sources.iter_records`` yields), or
one range of rows (``RowRange``) that a worker or a rank reads itself.

Every Parquet row is a record (nothing in a row can be malformed the way a JSONL line can), so a file
cut into ranges of ``data.chunk_records`` rows gives exactly the chunks that its records read in order
would (``stream._work``), under the same names (``<file>: record <i> (0-based index)``). The cuts come
from the file's metadata, so the process that hands the chunks out parses no row, and a worker reads
only the row groups that hold its range: with several ranks each rank reads its own chunks' rows, not
the whole file (the Parquet counterpart of ``sources.jsonl_ranges``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from densebatch.errors import DataError


def require_pyarrow(what: str) -> None:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise DataError(f"reading {what} needs pyarrow: pip install 'densebatch[parquet]'") from None


def open_parquet(p: Path):
    """``pyarrow.parquet.ParquetFile`` of ``p``; ``DataError`` in one line for bytes that are not Parquet or
    a file without rows."""
    require_pyarrow("Parquet")
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(p)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for non-Parquet bytes
        raise DataError(f"{p}: not a readable Parquet file: {e}") from None
    if pf.metadata.num_rows == 0:
        raise DataError(f"{p}: holds no records (a Parquet file with columns {', '.join(pf.schema_arrow.names)} and no rows)")
    return pf


def row_name(p: Path, i: int) -> str:
    return f"{p}: record {i} (0-based index)"


def read_parquet(p: Path) -> Iterator[tuple[str, dict]]:
    """Every row of ``p`` in order, as (its name, the record)."""
    i = 0
    for batch in open_parquet(p).iter_batches(batch_size=4096):
        for rec in batch.to_pylist():
            yield row_name(p, i), rec
            i += 1


@dataclass(frozen=True)
class RowRange:
    """Rows ``first`` to ``stop - 1`` (0-based) of the Parquet file ``path``."""

    path: str
    first: int
    stop: int


def parquet_ranges(path: str | Path, rows: int) -> Iterator[RowRange]:
    """``path`` cut into ranges of ``rows`` rows (the last may hold fewer), from its metadata only."""
    p = Path(path)
    n = open_parquet(p).metadata.num_rows
    for first in range(0, n, rows):
        yield RowRange(str(p), first, min(n, first + rows))


def columns(path: str | Path) -> list[str]:
    """The file's columns (every record's fields), from its schema."""
    return list(open_parquet(Path(path)).schema_arrow.names)


def read_parquet_range(r: RowRange) -> Iterator[tuple[str, dict]]:
    """The rows of ``r``, named as ``read_parquet`` names them, reading only the row groups that hold them."""
    p = Path(r.path)
    pf = open_parquet(p)
    start = 0
    for g in range(pf.metadata.num_row_groups):
        size = pf.metadata.row_group(g).num_rows
        lo, hi = max(r.first, start), min(r.stop, start + size)
        if lo < hi:
            for k, rec in enumerate(pf.read_row_group(g).slice(lo - start, hi - lo).to_pylist()):
                yield row_name(p, lo + k), rec
        start += size
        if start >= r.stop:
            return

"""Row-addressable inputs, Parquet files and ``datasets`` ``save_to_disk`` directories: read whole in
order (``read_parquet``, ``read_hf_disk``: what ``sources.iter_records`` yields), or one range of rows
(``RowRange``) that a worker, or a rank, reads itself.

Every row of these is a record (nothing in a row can be malformed the way a JSONL line can), so the
input cut into ranges of ``data.chunk_records`` rows gives exactly the chunks that its records read in
order would (``stream._work``), under the same names (``<path>: record <i> (0-based index)``). The cuts
come from the row count alone (Parquet metadata; the dataset's length), so the process that hands the
chunks out parses no row, and a worker reads only its range: the row groups that hold it (Parquet), its
slice of the memory-mapped Arrow table (``save_to_disk``). Under torchrun each rank so reads its own
chunks' rows, not the whole input: the counterpart of ``sources.jsonl_ranges``.

A Parquet row group is decoded whole to read any of its rows, so a file whose row groups are much
larger than a range (pyarrow writes up to 1M rows a group by default) is not read in ranges
(``cut``): every range would decode its whole group, 25 ranges of 4,096 rows in one group of 200,000
took 4.8 s where the whole file read in order takes 0.4 s. Up to ``GROUP_CHUNKS`` ranges a group, the
decoding a range repeats stays small beside tokenising its records.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from densebatch.errors import DataError

FORMATS = ("parquet", "hf_disk")
GROUP_CHUNKS = 8  # a Parquet file is read in ranges when no row group holds more than this many ranges' rows


def require_pyarrow(what: str) -> None:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise DataError(f"reading {what} needs pyarrow: pip install 'densebatch[parquet]'") from None


def open_parquet(p: Path):
    """``pyarrow.parquet.ParquetFile`` of ``p``; ``DataError`` in one line for bytes that are not Parquet or
    a file without rows."""
    if p.is_file() and p.stat().st_size == 0:  # as sources.iter_records says it
        raise DataError(f"{p}: the file is empty")
    require_pyarrow("Parquet")
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(p)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for non-Parquet bytes
        raise DataError(f"{p}: not a readable Parquet file: {e}") from None
    if pf.metadata.num_rows == 0:
        raise DataError(f"{p}: holds no records (a Parquet file with columns {', '.join(pf.schema_arrow.names)} and no rows)")
    return pf


def open_hf_disk(d: Path):
    """(the dataset, the path its records are named by) of a ``save_to_disk`` directory, read with
    ``datasets.load_from_disk`` (a DatasetDict: its train split, named ``<d>/train``); ``DataError`` in one
    line for a directory it cannot read or a dataset without rows."""
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"{d}: reading a Hugging Face save_to_disk directory needs datasets: pip install 'densebatch[datasets]'"
        ) from None
    if d.is_file():
        raise DataError(f"{d}: a file; data.format hf_disk reads the directory a Hugging Face save_to_disk wrote")
    try:
        ds = datasets.load_from_disk(str(d))
    except FileNotFoundError:
        raise DataError(
            f"{d}: a directory, but not a Hugging Face save_to_disk dataset (datasets.load_from_disk cannot read it)"
        ) from None
    except Exception as e:  # a damaged or foreign directory: datasets raises many kinds
        why = (str(e).splitlines() or [type(e).__name__])[0]
        raise DataError(f"{d}: not a readable Hugging Face save_to_disk dataset: {why}") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"{d}: a DatasetDict without a 'train' split; point data.path at one of: {', '.join(ds)}")
        ds, d = ds["train"], d / "train"
    if len(ds) == 0:
        raise DataError(f"{d}: holds no records (a dataset with columns {', '.join(ds.column_names)} and no rows)")
    return ds, d


def row_name(p: Path, i: int) -> str:
    return f"{p}: record {i} (0-based index)"


def _rows(batch: dict) -> Iterator[dict]:
    """A ``datasets`` batch (columns) as its rows."""
    return (dict(zip(batch, row)) for row in zip(*batch.values()))


def read_parquet(p: Path) -> Iterator[tuple[str, dict]]:
    """Every row of the Parquet file ``p`` in order, as (its name, the record)."""
    i = 0
    for batch in open_parquet(p).iter_batches(batch_size=4096):
        for rec in batch.to_pylist():
            yield row_name(p, i), rec
            i += 1


def read_hf_disk(d: Path) -> Iterator[tuple[str, dict]]:
    """Every row of the ``save_to_disk`` dataset at ``d`` in order, as (its name, the record)."""
    ds, named = open_hf_disk(d)
    i = 0
    for batch in ds.iter(batch_size=4096):
        for rec in _rows(batch):
            yield row_name(named, i), rec
            i += 1


@dataclass(frozen=True)
class RowRange:
    """Rows ``first`` to ``stop - 1`` (0-based) of the input ``path`` of format ``fmt`` (``FORMATS``), whose
    records are named by ``named`` (a DatasetDict's: ``<path>/train``)."""

    path: str
    first: int
    stop: int
    fmt: str
    named: str

    def names(self) -> tuple[str, str]:
        """The names of its first and its last record."""
        return row_name(Path(self.named), self.first), row_name(Path(self.named), self.stop - 1)


def cut(path: str | Path, fmt: str, rows: int) -> tuple[list[str], list[RowRange]] | None:
    """(the fields of the input's records, the input cut into ranges of ``rows`` rows), from one look at
    it, no row parsed; None when it is not read in ranges: a format not in ``FORMATS``, or a Parquet file
    with a row group of more than ``GROUP_CHUNKS`` ranges' rows. The fields: a Parquet file's schema; a
    dataset's first row as it reads (a dataset saved with ``set_format(columns=...)`` yields those columns
    only, whatever ``column_names`` says)."""
    if fmt not in FORMATS:
        return None
    p = Path(path)
    if fmt == "parquet":
        pf = open_parquet(p)
        meta = pf.metadata
        if max(meta.row_group(g).num_rows for g in range(meta.num_row_groups)) > GROUP_CHUNKS * rows:
            return None
        n, named, fields = meta.num_rows, p, list(pf.schema_arrow.names)
    else:
        ds, named = open_hf_disk(p)
        n, fields = len(ds), list(next(_rows(ds[:1])))
    return fields, [RowRange(str(p), first, min(n, first + rows), fmt, str(named)) for first in range(0, n, rows)]


def read_range(r: RowRange) -> Iterator[tuple[str, dict]]:
    """The rows of ``r``, named as the whole input's reader names them, reading only those rows."""
    p = Path(r.path)
    if r.fmt == "hf_disk":
        ds, named = open_hf_disk(p)
        for k, rec in enumerate(_rows(ds[r.first : r.stop])):
            yield row_name(named, r.first + k), rec
        return
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

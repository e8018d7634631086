"""Parquet files and save_to_disk datasets read in row ranges (``data/prepare/row_ranges.py``): each range
is exactly its rows of the whole input, a worker reads only the row groups that hold its range, and a
prepare that hands row ranges to its workers (and ranks) makes the store the in-memory path makes, byte
for byte."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from in_memory_prepare import in_memory

import densebatch.data.prepare.documents as documents
import densebatch.data.prepare.sources as sources
from densebatch.config import CleanConfig
from densebatch.data.prepare.pipeline import prepare
from densebatch.data.prepare.row_ranges import GROUP_CHUNKS, RowRange, cut, read_parquet, read_range
from densebatch.errors import DataError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def _write(path, records: list[dict], row_group_size: int):
    pq.write_table(pa.Table.from_pylist(records), path, row_group_size=row_group_size)
    return path


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 60), group=st.integers(1, 17), rows=st.integers(1, 20))
@example(n=30, group=17, rows=1)  # more than GROUP_CHUNKS ranges a group: not cut
@example(n=30, group=8, rows=1)  # exactly GROUP_CHUNKS: cut
def test_the_ranges_read_back_the_whole_file_in_order_touching_only_their_row_groups(tmp_path, n, group, rows):
    path = _write(tmp_path / "r.parquet", [{"i": i, "text": f"row {i}"} for i in range(n)], group)
    cuts = cut(path, "parquet", rows)
    if min(group, n) > GROUP_CHUNKS * rows:  # a range would decode its whole, far larger, row group
        assert cuts is None
        return
    fields, ranges = cuts or pytest.fail("not cut")
    assert fields == ["i", "text"]
    assert [(r.first, r.stop) for r in ranges] == [(a, min(n, a + rows)) for a in range(0, n, rows)]
    read: list[int] = []
    original = pq.ParquetFile.read_row_group

    def spy(self, g, *a, **k):
        read.append(g)
        return original(self, g, *a, **k)

    pq.ParquetFile.read_row_group = spy
    try:
        pieces = []
        for r in ranges:
            read.clear()
            pieces += list(read_range(r))
            assert read == list(range(r.first // group, (r.stop - 1) // group + 1))  # its row groups, no other
    finally:
        pq.ParquetFile.read_row_group = original
    assert pieces == list(read_parquet(path))  # the same records under the same names


def _records(n: int, seed: int = 0) -> list[dict]:
    """Alpaca records with exact duplicates, whitespace and HTML that cleaning changes, overlong answers
    and rows without an instruction (skipped as bad records)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        r = rng.random()
        if r < 0.05:
            out.append({"instruction": None, "input": "", "output": "no instruction"})
        elif r < 0.15:
            out.append({"instruction": "Repeat.", "input": "", "output": "the same answer"})
        else:
            words = " ".join(rng.choice(["alpha", "beta  ", "gamma", "<b>delta</b>"]) for _ in range(rng.randint(1, 90)))
            out.append({"instruction": f"Task {i}.", "input": "", "output": words})
    return out


def _prepare(data_cfg, path, cache, **kw):
    clean = CleanConfig(dedupe=True, collapse_whitespace=True, strip_html=True)
    cfg = data_cfg(
        path=str(path), cache_dir=str(cache), eval_fraction=0.1, max_seq_len=300, on_bad_record="skip", clean=clean, **kw
    )
    return prepare(cfg)


def _counts(prepared) -> dict:
    """The summary but for where the entry lies and how long it took."""
    return {k: v for k, v in prepared.summary.as_dict().items() if k not in ("seconds", "cache_path")}


def _files(entry) -> dict[str, bytes]:
    return {str(p.relative_to(entry)): p.read_bytes() for p in sorted(entry.rglob("*")) if p.is_file()}


def _write_input(tmp_path, fmt: str, records: list[dict], group: int):
    """The records as a Parquet file (row groups of ``group``) or a save_to_disk DatasetDict; its path and
    the path its records are named by."""
    if fmt == "parquet":
        path = _write(tmp_path / "r.parquet", records, group)
        return path, path
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(records)}).save_to_disk(str(tmp_path / "hf"))
    return tmp_path / "hf", tmp_path / "hf" / "train"


@pytest.mark.parametrize("fmt", ["parquet", "hf_disk"])
def test_a_row_addressable_input_streams_in_row_ranges_to_the_in_memory_store_byte_for_byte(data_cfg, tmp_path, monkeypatch, fmt):
    path, named = _write_input(tmp_path, fmt, _records(500), group=37)  # ranges of 64 straddle row groups
    with monkeypatch.context() as m:  # the in-memory path, the reference
        in_memory(m)
        ref = _prepare(data_cfg, path, tmp_path / "ref")
    ranges = []
    real = documents.read_range
    monkeypatch.setattr(documents, "read_range", lambda r: ranges.append(r) or real(r))
    for whole in ("read_parquet", "read_hf_disk"):
        monkeypatch.setattr(sources, whole, lambda p: pytest.fail("the whole input was read in this process"))
    got = _prepare(data_cfg, path, tmp_path / "n1", num_proc=1, chunk_records=64)
    assert _files(got.cache_dir) == _files(ref.cache_dir)
    assert ranges == [RowRange(str(path), a, min(500, a + 64), fmt, str(named)) for a in range(0, 500, 64)]
    assert ref.summary.skipped and ref.summary.cleaning_dropped["dedupe"] > 10 and _counts(got) == _counts(ref)
    monkeypatch.undo()  # the workers of a pool are other processes: the stores alone are compared
    two = _prepare(data_cfg, path, tmp_path / "n2", num_proc=2, chunk_records=64)
    assert _files(two.cache_dir) == _files(ref.cache_dir)


def test_each_rank_reads_only_the_rows_of_its_own_chunks(data_cfg, tmp_path, monkeypatch):
    from densebatch.data.prepare.parts import prepare_share

    path = _write(tmp_path / "r.parquet", _records(300, seed=1), row_group_size=50)
    one = _prepare(data_cfg, path, tmp_path / "one", chunk_records=64)
    real = documents.read_range
    clean = CleanConfig(dedupe=True, collapse_whitespace=True, strip_html=True)
    cfg = data_cfg(
        path=str(path), cache_dir=str(tmp_path / "ranks"), eval_fraction=0.1, max_seq_len=300, on_bad_record="skip",
        num_proc=1, chunk_records=64, clean=clean,
    )  # fmt: skip
    for rank in (1, 0):
        ranges: list[RowRange] = []
        with monkeypatch.context() as m:
            m.setattr(documents, "read_range", lambda r, ranges=ranges: ranges.append(r) or real(r))
            m.setattr(sources, "read_parquet", lambda p: pytest.fail("a rank read the whole file"))
            prepare_share(cfg, rank, 2)
        assert [r.first for r in ranges] == [a for k, a in enumerate(range(0, 300, 64)) if k % 2 == rank]
    got = _prepare(data_cfg, path, tmp_path / "ranks", chunk_records=64, num_proc=1)
    assert _files(got.cache_dir) == _files(one.cache_dir)


def _bad_input(tmp_path, case: str):
    rows = [{"instruction": "a", "input": "", "output": "b"}] * 5
    if case == "parquet without output":
        return _write(tmp_path / "r.parquet", [{"instruction": "a", "answer": "b"}] * 5, row_group_size=2)
    if case == "empty parquet file":
        (tmp_path / "r.parquet").write_bytes(b"")
        return tmp_path / "r.parquet"
    if case == "a file as hf_disk":  # format hf_disk given for a file: not "a directory, but ..."
        (tmp_path / "r.jsonl").write_text('{"instruction": "a", "output": "b"}\n')
        return tmp_path / "r.jsonl"
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(rows if case == "dataset formatted without output" else [{"instruction": "a"}] * 5)
    if case == "dataset formatted without output":  # column_names still lists output; its rows do not hold it
        ds.set_format(type=None, columns=["instruction", "input"])
    ds.save_to_disk(str(tmp_path / "hf"))
    return tmp_path / "hf"


@pytest.mark.parametrize(
    "case",
    [
        "parquet without output",
        "empty parquet file",
        "dataset without output",
        "dataset formatted without output",
        "a file as hf_disk",
    ],
)
def test_a_bad_input_is_the_in_memory_paths_one_line_error_before_any_range_is_read(data_cfg, tmp_path, monkeypatch, case):
    path = _bad_input(tmp_path, case)
    messages = []
    for streamed in (True, False):
        with monkeypatch.context() as m:
            if not streamed:
                in_memory(m)
            m.setattr(documents, "read_range", lambda r: pytest.fail("a range was read"))
            with pytest.raises(DataError) as e:
                fmt = {"format": "hf_disk"} if case == "a file as hf_disk" else {}
                _prepare(data_cfg, path, tmp_path / f"s{streamed}", chunk_records=2, **fmt)
        messages.append(str(e.value))
    assert messages[0] == messages[1] and "\n" not in messages[0]
    expected = {"empty parquet file": "the file is empty", "a file as hf_disk": "a file; data.format hf_disk reads"}
    assert expected.get(case, "output") in messages[0]


def test_a_parquet_file_of_row_groups_far_larger_than_a_range_is_read_whole_here(data_cfg, tmp_path, monkeypatch):
    """Each range would decode its whole row group again: one group of 300 rows and ranges of 16 (more
    than ``GROUP_CHUNKS`` ranges a group) are read in order by this process, into the same store."""
    assert 300 > GROUP_CHUNKS * 16
    path = _write(tmp_path / "r.parquet", _records(300, seed=3), row_group_size=300)
    assert cut(path, "parquet", 16) is None and cut(path, "parquet", 300 // GROUP_CHUNKS + 1) is not None
    with monkeypatch.context() as m:
        in_memory(m)
        ref = _prepare(data_cfg, path, tmp_path / "ref")
    monkeypatch.setattr(documents, "read_range", lambda r: pytest.fail("read in ranges"))
    got = _prepare(data_cfg, path, tmp_path / "whole", num_proc=1, chunk_records=16)
    assert _files(got.cache_dir) == _files(ref.cache_dir)

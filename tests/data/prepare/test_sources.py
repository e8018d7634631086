"""Sources: every format read in file order, and every unreadable record reported with its place."""

from __future__ import annotations

import csv
import json

import pytest

from densebatch.data.prepare.sources import BadRecord, detect_format, iter_records
from densebatch.errors import DataError


def _good(items):
    return [rec for item in items if not isinstance(item, BadRecord) for rec in [item[1]]]


def test_detect_format(tmp_path):
    for name, fmt in [("a.json", "json"), ("a.jsonl", "jsonl"), ("a.csv", "csv"), ("a.parquet", "parquet"), ("a.txt", "text")]:
        assert detect_format(tmp_path / name) == fmt
    assert detect_format(tmp_path) == "hf_disk"
    assert detect_format(tmp_path / "a.weird", "jsonl") == "jsonl"
    with pytest.raises(DataError, match="data.format"):
        detect_format(tmp_path / "a.weird")


def test_json_array_and_jsonl(tmp_path, records, write_jsonl):
    RECORDS = records
    (tmp_path / "a.json").write_text(json.dumps(RECORDS))
    assert _good(iter_records(tmp_path / "a.json")) == RECORDS
    assert _good(iter_records(write_jsonl(tmp_path / "a.jsonl", RECORDS))) == RECORDS


def test_jsonl_bad_lines_are_named_by_line(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_bytes(b'{"a": 1}\n\n{"a": \n[1, 2]\n{"a": "\xff"}\n{"a": 2}\n')
    items = list(iter_records(p))
    bad = [i for i in items if isinstance(i, BadRecord)]
    assert [(b.where, b.reason) for b in bad] == [  # a blank line between records is reported too
        (f"{p}:2", "blank_line"),
        (f"{p}:3", "invalid_json"),
        (f"{p}:4", "wrong_type"),
        (f"{p}:5", "undecodable_bytes"),
    ]
    assert _good(items) == [{"a": 1}, {"a": 2}]
    assert items[-1][0] == f"{p}:6"
    p.write_bytes(b'{"a": 1}\n{"a": 2}\n\n\n')  # trailing blank lines are harmless
    assert not [i for i in iter_records(p) if isinstance(i, BadRecord)]


def test_json_array_errors(tmp_path):
    p = tmp_path / "a.json"
    p.write_text('[{"a": 1},\n {"a": 2,,}]')
    with pytest.raises(DataError, match=r"a.json:2: invalid JSON"):
        list(iter_records(p))
    p.write_text('[{"a": 1}, 3]')
    bad = [i for i in iter_records(p) if isinstance(i, BadRecord)]
    assert bad[0].where.endswith("record 1 (0-based index)") and bad[0].reason == "wrong_type"
    p.write_bytes(b'[{"a": "ok"}, {"a": "\xfe"}]')
    bad = [i for i in iter_records(p) if isinstance(i, BadRecord)]
    assert bad[0].reason == "undecodable_bytes" and "record 1" in bad[0].where
    p.write_text('{"a": 1}')
    with pytest.raises(DataError, match="JSON array"):
        list(iter_records(p))


def test_json_nested_past_the_parsers_depth_is_a_bad_record_not_a_traceback(tmp_path):
    """A line nested thousands of levels deep (json raises RecursionError) is skipped and counted as JSONL,
    and one line of error in a JSON array, which cannot be read around it."""
    deep = '{"a": ' + "[" * 5000 + "]" * 5000 + "}"
    p = tmp_path / "a.jsonl"
    p.write_text('{"a": 1}\n' + deep + '\n{"a": 2}\n')
    items = list(iter_records(p))
    assert [(b.where, b.reason) for b in items if isinstance(b, BadRecord)] == [(f"{p}:2", "invalid_json")]
    assert _good(items) == [{"a": 1}, {"a": 2}]
    p = tmp_path / "a.json"
    p.write_text("[" + deep + "]")
    with pytest.raises(DataError, match="nested too deeply"):
        list(iter_records(p))


@pytest.mark.parametrize("content", [b"", b"  \n\n  "])
def test_empty_files_are_errors(tmp_path, content):
    for name in ("a.jsonl", "a.json", "a.csv", "a.txt"):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(DataError, match="empty|no records|JSON"):
            list(iter_records(tmp_path / name))


def test_missing_file_is_an_error(tmp_path):
    with pytest.raises(DataError, match="not found"):
        list(iter_records(tmp_path / "nope.jsonl"))


def test_csv_with_multiline_fields_names_start_lines(tmp_path):
    p = tmp_path / "a.csv"
    with open(p, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["instruction", "input", "output"])
        w.writerow(["two\nlines", "", "x"])  # lines 2-3
        w.writerow(["ok", "", "y"])  # line 4
        f.write("too,many,fields,here\n")  # line 5
    items = list(iter_records(p))
    assert items[0] == (f"{p}:2", {"instruction": "two\nlines", "input": "", "output": "x"})
    assert items[1][0] == f"{p}:4"
    assert isinstance(items[2], BadRecord) and items[2].where == f"{p}:5" and items[2].reason == "wrong_field_count"


def test_text_paragraphs_with_line_numbers(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("first para\nline two\n\n\nsecond para\n")
    assert list(iter_records(p)) == [(f"{p}:1", {"text": "first para\nline two"}), (f"{p}:5", {"text": "second para"})]


def test_parquet(tmp_path, records):
    RECORDS = records
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(RECORDS), tmp_path / "a.parquet")
    items = list(iter_records(tmp_path / "a.parquet"))
    assert _good(items) == RECORDS and items[2][0].endswith("record 2 (0-based index)")
    (tmp_path / "b.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="Parquet"):
        list(iter_records(tmp_path / "b.parquet"))


def test_hf_save_to_disk_dataset_and_dataset_dict(tmp_path, records):
    RECORDS = records
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(RECORDS * 3)
    ds.save_to_disk(str(tmp_path / "ds"))
    assert _good(iter_records(tmp_path / "ds")) == RECORDS * 3
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "dd"))
    assert len(_good(iter_records(tmp_path / "dd"))) == 9
    datasets.DatasetDict({"validation": ds}).save_to_disk(str(tmp_path / "nv"))
    with pytest.raises(DataError, match="train"):
        list(iter_records(tmp_path / "nv"))


def test_directory_that_is_not_a_dataset(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.txt").write_text("hi")
    with pytest.raises(DataError, match="save_to_disk"):
        list(iter_records(tmp_path / "d"))


def test_jsonl_error_reports_the_real_column(tmp_path):
    """A cut-off line used to read "column 1" (json counted from the line break at its end)."""
    p = tmp_path / "a.jsonl"
    cut = '{"instruction": "abc", "output": "b"'  # 36 characters: the error is at column 37
    p.write_text('{"a": 1}\n' + cut + "\n" + '{"a": 2, "b": x}\r\n' + '{"a": 3}\n', encoding="utf-8")
    bad = [i for i in iter_records(p) if isinstance(i, BadRecord)]
    assert [b.where for b in bad] == [f"{p}:2", f"{p}:3"]
    assert "column 37" in bad[0].message and "line ends before" in bad[0].message
    assert "column 15" in bad[1].message and "line ends" not in bad[1].message  # \r\n lines too
    p.write_text('{"é": "ü", "x": ]}\n', encoding="utf-8")  # columns count characters, not bytes
    assert "column 17" in next(iter(iter_records(p))).message


def test_jsonl_read_as_json_says_to_set_data_format(tmp_path, records, write_jsonl):
    p = write_jsonl(tmp_path / "mine.json", records)  # JSONL content under a .json name / format: json
    for fmt in ("auto", "json"):
        with pytest.raises(DataError, match=r"looks like JSONL.*data\.format: jsonl") as e:
            list(iter_records(p, fmt))
        assert "Extra data" not in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "one.json").write_text(json.dumps(records[0]) + "\n")
    with pytest.raises(DataError, match="data.format: jsonl"):
        list(iter_records(tmp_path / "one.json"))


def test_json_array_read_as_jsonl_says_to_set_data_format(tmp_path, records):
    p = tmp_path / "a.jsonl"
    p.write_text(json.dumps(records, indent=1))
    first = next(iter(iter_records(p)))
    assert isinstance(first, BadRecord) and "data.format: json" in first.message


def test_text_read_line_by_line_gives_the_lines_of_the_whole_text(tmp_path):
    """The text format streams its file (memory: one paragraph) and still splits lines as ``str.splitlines``
    of the whole decoded text does: every separator it knows, a byte-order mark, undecodable bytes."""
    import random

    from densebatch.data.prepare.sources import _text_file_lines

    rng = random.Random(0)
    alphabet = ["a", "b", " ", "\n", "\r", "\r\n", "\x0b", "\x0c", "\x1c", "\x85", "\u2028", "é", "\n\n"]
    for t in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        raw = ("\ufeff" if t % 3 == 0 else "").encode() + text.encode() + (b"\xff\n\xe2\x82\n" if t % 5 == 0 else b"")
        (tmp_path / "t.txt").write_bytes(raw)
        assert list(_text_file_lines(tmp_path / "t.txt")) == raw.decode("utf-8-sig", "surrogateescape").splitlines()

"""A source given as a glob pattern of files (data/prepare/parts.py): each file prepared on its own, so
adding a file prepares that file alone; the documents are the files' end to end; the eval split is
taken in each file; dedupe spans the files; a mixture's pattern source keeps one source id."""

from __future__ import annotations

import json

import numpy as np
import pytest

import densebatch.data.prepare.pipeline as pipeline
from densebatch.config import CleanConfig, SourceConfig
from densebatch.data.prepare.parts import prepare_share
from densebatch.data.prepare.pipeline import prepare
from densebatch.errors import DataError


def _write(path, records) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def _records(first: int, n: int) -> list[dict]:
    return [{"instruction": f"Task {i}.", "input": "", "output": "word " * (1 + i % 13)} for i in range(first, first + n)]


def _docs(store) -> list[list[int]]:
    tokens, offsets = np.asarray(store.tokens), np.asarray(store.offsets)
    return [tokens[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]


@pytest.fixture
def built(monkeypatch) -> list[str]:
    """The paths of the entries prepared from their records (not read from the cache), in order."""
    made: list[str] = []
    real = pipeline._build_one

    def counting(final, **kw):
        made.append(kw["cfg"].path)
        return real(final, **kw)

    monkeypatch.setattr(pipeline, "_build_one", counting)
    return made


def test_a_pattern_reads_as_its_files_end_to_end_and_adding_a_file_prepares_only_that_file(data_cfg, tmp_path, built):
    corpus = tmp_path / "corpus"
    for k in range(3):
        _write(corpus / f"part-{k}.jsonl", _records(40 * k, 40))
    _write(tmp_path / "all.jsonl", _records(0, 160))
    cfg = data_cfg(path=str(corpus / "part-*.jsonl"), num_proc=1)
    first = prepare(cfg)
    assert built == [str(corpus / f"part-{k}.jsonl") for k in range(3)]
    assert first.summary.parts == [3, 3] and first.summary.records_read == 120
    assert len(first.summary.sources) == 1 and first.source_names == ["corpus"]
    _write(corpus / "part-3.jsonl", _records(120, 40))
    built.clear()
    second = prepare(cfg)
    assert built == [str(corpus / "part-3.jsonl")]  # the three others come from the cache
    assert second.summary.parts == [1, 4] and "1 of 4 inputs (files, sources) prepared now" in str(second.summary)
    whole = prepare(data_cfg(path=str(tmp_path / "all.jsonl")))  # the same records as one file
    assert _docs(second.train) == _docs(whole.train)
    assert np.array_equal(np.asarray(second.train.loss_mask), np.asarray(whole.train.loss_mask))
    assert _docs(second.train)[: len(first.train)] == _docs(first.train)
    assert set(np.asarray(second.train.source).tolist()) == {0}
    built.clear()
    assert prepare(cfg).summary.cache_hit and built == []


def test_the_eval_split_is_taken_in_each_file_and_a_new_file_moves_no_record_of_another(data_cfg, tmp_path):
    corpus = tmp_path / "corpus"
    sizes = (30, 50, 20)
    for k, n in enumerate(sizes):
        _write(corpus / f"{k}.jsonl", _records(100 * k, n))
    cfg = data_cfg(path=str(corpus / "*.jsonl"), eval_fraction=0.1)
    got = prepare(cfg)
    assert got.summary.eval_documents == 3 + 5 + 2  # round(0.1 x n) of each file
    apart = [
        prepare(data_cfg(path=str(corpus / f"{k}.jsonl"), eval_fraction=0.1, cache_dir=str(tmp_path / "c"))) for k in range(3)
    ]
    assert _docs(got.eval) == [d for p in apart for d in _docs(p.eval)]
    _write(corpus / "3.jsonl", _records(900, 70))
    more = prepare(cfg)
    assert _docs(more.eval)[: len(got.eval)] == _docs(got.eval)
    assert "in each of its 4 files" in str(more.summary)


def test_exact_dedupe_spans_the_files_and_an_edited_file_is_prepared_again_with_those_after_it(data_cfg, tmp_path, built):
    corpus = tmp_path / "corpus"
    same = {"instruction": "Repeat.", "input": "", "output": "the same answer"}
    _write(corpus / "a.jsonl", [*_records(0, 10), same])
    _write(corpus / "b.jsonl", [*_records(10, 10), same])
    _write(corpus / "c.jsonl", _records(20, 10))
    cfg = data_cfg(path=str(corpus / "*.jsonl"), clean=CleanConfig(dedupe="exact"))
    got = prepare(cfg)
    assert got.summary.train_documents == 31 and got.summary.cleaning_dropped == {"dedupe_cross_file": 1}
    _write(corpus / "b.jsonl", _records(100, 12))  # edited: it and the file deduped against it are made again
    built.clear()
    assert prepare(cfg).summary.train_documents == 11 + 12 + 10
    assert built == [str(corpus / "b.jsonl"), str(corpus / "c.jsonl")]
    _write(corpus / "b.jsonl", _records(100, 11))  # without dedupe only the edited file is
    plain = data_cfg(path=str(corpus / "*.jsonl"))
    prepare(plain)
    _write(corpus / "b.jsonl", _records(100, 9))
    built.clear()
    assert prepare(plain).summary.train_documents == 11 + 9 + 10 and built == [str(corpus / "b.jsonl")]


def test_a_pattern_source_of_a_mixture_keeps_one_source_id_and_ranks_share_its_chunks(data_cfg, tmp_path, built):
    corpus = tmp_path / "corpus"
    for k in range(2):
        _write(corpus / f"{k}.jsonl", _records(50 * k, 50))
    _write(tmp_path / "other.jsonl", _records(500, 30))
    sources = [SourceConfig(path=str(corpus / "*.jsonl")), SourceConfig(path=str(tmp_path / "other.jsonl"), name="other")]
    cfg = data_cfg(sources=sources, chunk_records=16, num_proc=1)
    assert sum(prepare_share(cfg, rank, 2) for rank in (1, 0)) == 4 + 4 + 2  # 16-record chunks of 50, 50, 30
    got = prepare(cfg)
    assert got.source_names == ["corpus", "other"]
    assert np.bincount(np.asarray(got.train.source)).tolist() == [100, 30]
    assert [x["documents"] for x in got.summary.sources] == [100, 30]
    assert [x["name"] for x in got.summary.sources] == ["corpus", "other"]


def test_a_pattern_with_an_eval_path_holds_it_once_and_a_file_named_like_a_pattern_is_a_file(data_cfg, tmp_path):
    corpus = tmp_path / "corpus"
    for k in range(3):
        _write(corpus / f"{k}.jsonl", _records(40 * k, 40))
    _write(tmp_path / "held.jsonl", _records(900, 5))
    got = prepare(data_cfg(path=str(corpus / "*.jsonl"), eval_path=str(tmp_path / "held.jsonl"), eval_fraction=0.1))
    assert (got.summary.eval_documents, got.summary.train_documents) == (5, 120)  # eval_path's, once; no file holds out
    assert "in each of" not in got.summary.eval_source
    odd = tmp_path / "odd" / "part[1].jsonl"  # an existing file whose name holds pattern characters
    _write(odd, _records(0, 7))
    assert prepare(data_cfg(path=str(odd))).summary.train_documents == 7


def test_a_pattern_that_matches_nothing_is_a_one_line_error(data_cfg, tmp_path):
    with pytest.raises(DataError, match=r"no file matches this pattern"):
        prepare(data_cfg(path=str(tmp_path / "nowhere" / "*.jsonl")))

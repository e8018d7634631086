"""Streaming, parallel prepare (data/prepare/stream.py): the same store, byte for byte, as the in-memory
path for any number of workers; bad records reported as in one process; a dead worker named, and a rerun
that goes on from the chunks already written."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
from in_memory_prepare import in_memory

import densebatch.data.prepare.pipeline as pipeline
import densebatch.data.prepare.stream as stream
from densebatch.config import CleanConfig
from densebatch.data.prepare.pipeline import prepare
from densebatch.errors import DataError


def _records(n: int, seed: int = 0) -> list[bytes]:
    """Alpaca records with exact duplicates, whitespace that cleaning collapses, overlong answers, answers
    emptied to nothing, pre-tokenised records among them and malformed lines (every kind prepare counts)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        r = rng.random()
        if r < 0.05:
            out.append(b'{"instruction": "broken", ')
        elif r < 0.08:
            out.append(json.dumps({"input": "", "output": "no instruction"}).encode())
        elif r < 0.11:
            out.append(json.dumps({"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]}).encode())
        elif r < 0.2:
            out.append(json.dumps({"instruction": "Repeat.", "input": "", "output": "the same answer"}).encode())
        else:
            words = " ".join(rng.choice(["alpha", "beta  ", "gamma", "<b>delta</b>"]) for _ in range(rng.randint(1, 90)))
            out.append(json.dumps({"instruction": f"Task {i}.", "input": "", "output": words}).encode())
    return out


def _files(entry) -> dict[str, bytes]:
    return {str(p.relative_to(entry)): p.read_bytes() for p in sorted(entry.rglob("*")) if p.is_file()}


def _prepare(data_cfg, path, tmp, tag, **kw):
    cfg = data_cfg(
        path=str(path), cache_dir=str(tmp / tag), eval_fraction=0.1, max_seq_len=300, on_bad_record="skip",
        clean=CleanConfig(dedupe=True, collapse_whitespace=True, strip_html=True), **kw,
    )  # fmt: skip
    return prepare(cfg)


def test_the_streamed_store_is_the_in_memory_one_byte_for_byte_for_any_number_of_workers(data_cfg, tmp_path, monkeypatch):
    path = tmp_path / "r.jsonl"
    path.write_bytes(b"\n".join(_records(700)) + b"\n")
    with monkeypatch.context() as m:  # the in-memory path, the reference
        in_memory(m)
        ref = _prepare(data_cfg, path, tmp_path, "ref")
    for n in (1, 2, 3):  # 11 chunks, on 1, 2 and 3 processes
        got = _prepare(data_cfg, path, tmp_path, f"n{n}", num_proc=n, chunk_records=64)
        assert _files(got.cache_dir) == _files(ref.cache_dir), n
        assert not list((tmp_path / f"n{n}").glob(".chunks-*"))  # the chunk files go once the entry is whole
    s = ref.summary
    assert s.cleaning_dropped["dedupe"] > 10 and s.truncated > 10 and sum(s.skipped.values()) > 20 and s.eval_documents > 10
    assert got.eval_records == ref.eval_records == []  # a file's held-out documents are its eval store


@pytest.mark.parametrize("dedupe", ["off", "exact", "near"])
def test_an_eval_path_streams_to_the_in_memory_store_byte_for_byte(data_cfg, tmp_path, monkeypatch, dedupe):
    """data.eval_path is chunked too and assembled first: its documents are the eval split, a training record
    that repeats one of them is dropped with dedupe on (counted as repeats with it off), as in memory."""
    records = _records(500, seed=1)
    train, held = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_bytes(b"\n".join(records[:400]) + b"\n")
    held.write_bytes(b"\n".join(records[380:]) + b"\n")  # 20 records in both files
    kw = {"eval_path": str(held), "dedupe": dedupe}

    def run(tag, **more):
        cfg = data_cfg(
            path=str(train), eval_path=str(held), cache_dir=str(tmp_path / tag), max_seq_len=300, on_bad_record="skip",
            clean=CleanConfig(dedupe=dedupe, collapse_whitespace=True, strip_html=True), **more,
        )  # fmt: skip
        return prepare(cfg)

    with monkeypatch.context() as m:
        in_memory(m)
        ref = run("ref")
    held_chunks = []
    real = pipeline.assemble
    monkeypatch.setattr(pipeline, "assemble", lambda *a, **k: held_chunks.append(k["held_chunks"]) or real(*a, **k))
    got = run("got", num_proc=2, chunk_records=48)
    assert held_chunks == [3]  # streamed: 120 eval records in chunks of 48
    assert _files(got.cache_dir) == _files(ref.cache_dir), kw
    assert got.summary.as_dict() | {"seconds": 0, "cache_path": ""} == ref.summary.as_dict() | {"seconds": 0, "cache_path": ""}
    s = ref.summary
    assert s.eval_documents > 80 and sum(s.skipped.values()) > 5
    assert (s.eval_repeats_train > 0) == (dedupe == "off")
    assert not list(tmp_path.glob("got/.chunks-*"))


def test_running_text_streams_in_blocks_and_gives_the_tokens_of_one_pass(
    data_cfg, tmp_path, monkeypatch, gpt2, gpt2_dir, book_records
):
    """text_split: chunks: the file read in blocks (text_blocks.py, small blocks here), the blocks cut into
    documents across chunk files (stream_cut.py): the in-memory store byte for byte, and with the GPT-2 BPE
    the documents end to end are the tokens of one pass over the whole file."""
    import densebatch.data.prepare.text_blocks as text_blocks

    lines = [f"{r['instruction']}\n{r['output']}\n  indented, never a block's start\n\n" for r in book_records.values()]
    text = "".join(lines * max(2, 40_000 // len("".join(lines)))) + "The end \u2014 \u00e9t\u00e9."  # with or without ../shared
    path = tmp_path / "book.txt"
    path.write_text(text, encoding="utf-8")
    monkeypatch.setattr(text_blocks, "BLOCK_BYTES", 700)
    kw = {"path": str(path), "text_split": "chunks", "chunk_tokens": 64, "tokenizer": str(gpt2_dir), "max_seq_len": 64}
    with monkeypatch.context() as m:
        in_memory(m)
        ref = prepare(data_cfg(cache_dir=str(tmp_path / "ref"), eval_fraction=0.1, **kw))
        whole = prepare(data_cfg(cache_dir=str(tmp_path / "whole"), **kw))
    for n in (1, 2):
        got = prepare(data_cfg(cache_dir=str(tmp_path / f"n{n}"), eval_fraction=0.1, num_proc=n, chunk_records=3, **kw))
        assert _files(got.cache_dir) == _files(ref.cache_dir), n
    got = prepare(data_cfg(cache_dir=str(tmp_path / "all"), num_proc=2, chunk_records=3, **kw))
    assert _files(got.cache_dir) == _files(whole.cache_dir)
    assert got.summary.records_read > 3 * 3  # blocks, over more than three chunks
    assert np.asarray(got.train.tokens).tolist() == gpt2.encode(text) + [gpt2.eos_id]
    assert set(np.asarray(got.train.lengths)[:-1].tolist()) == {64}


@pytest.mark.parametrize("variant", ["crlf", "collapse_whitespace", "jsonl_eval_path"])
def test_running_text_in_blocks_with_crlf_cleaning_or_a_record_eval_file(
    data_cfg, tmp_path, monkeypatch, gpt2, gpt2_dir, book_records, variant
):
    """Blocks of a CRLF file still end at line starts (the "\\n" of a "\\r\\n" opens the next block: the tokens
    of one pass); collapse_whitespace keeps a block's edges (no line break lost between blocks); an eval_path
    of records is not cut into blocks. The streamed store is the in-memory one in each case."""
    import densebatch.data.prepare.text_blocks as text_blocks
    from densebatch.data.prepare.clean import collapse_whitespace

    newline = "\r\n" if variant == "crlf" else "\n"
    one = "".join(f"{r['instruction']}{newline}{r['output']}  x{newline}{newline}" for r in book_records.values())
    text = one * max(2, 20_000 // len(one)) + "End."  # many blocks, with or without ../shared
    path = tmp_path / "book.txt"
    path.write_bytes(text.encode("utf-8"))
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"text": "word " * k}) + "\n" for k in (3, 90, 5)))
    monkeypatch.setattr(text_blocks, "BLOCK_BYTES", 500)
    clean = CleanConfig(collapse_whitespace=variant == "collapse_whitespace")
    kw = {
        "path": str(path),
        "text_split": "chunks",
        "chunk_tokens": 64,
        "tokenizer": str(gpt2_dir),
        "max_seq_len": 64,
        "clean": clean,
    }
    if variant == "jsonl_eval_path":
        kw.update(eval_path=str(held), template="raw", format="auto")
    with monkeypatch.context() as m:
        in_memory(m)
        ref = prepare(data_cfg(cache_dir=str(tmp_path / "ref"), **kw))
    got = prepare(data_cfg(cache_dir=str(tmp_path / "got"), num_proc=2, chunk_records=2, **kw))
    assert _files(got.cache_dir) == _files(ref.cache_dir)
    assert got.summary.records_read > 10  # blocks
    if variant == "jsonl_eval_path":
        assert got.summary.eval_documents == 3 and got.summary.truncated == 1  # records, each its own document
        return
    one_pass = collapse_whitespace(text) if variant == "collapse_whitespace" else text
    assert np.asarray(got.train.tokens).tolist() == gpt2.encode(one_pass) + [gpt2.eos_id]


def test_a_learned_bpe_is_trained_from_the_records_as_read_then_the_chunks_stream(data_cfg, tmp_path, monkeypatch):
    """data.tokenizer bpe:N: the tokenizer is learned from a first pass over the records (not a list of
    them), then the chunks are tokenised with it: the entry, the learned tokenizer's files included, is
    the in-memory path's byte for byte."""
    path = tmp_path / "r.jsonl"
    path.write_bytes(b"\n".join(r for r in _records(400, seed=2) if b"input_ids" not in r) + b"\n")  # ids: refused
    (tmp_path / "ids.jsonl").write_text('{"input_ids": [1, 2, 3]}\n{"instruction": "a", "input": "", "output": "b"}\n')
    with monkeypatch.context() as m:
        in_memory(m)
        ref = _prepare(data_cfg, path, tmp_path, "ref", tokenizer="bpe:300")
    got = _prepare(data_cfg, path, tmp_path, "got", tokenizer="bpe:300", num_proc=2, chunk_records=64)
    assert _files(got.cache_dir) == _files(ref.cache_dir)
    assert (got.cache_dir / "tokenizer").is_dir() and got.tokenizer.vocab_size == ref.tokenizer.vocab_size
    with pytest.raises(DataError, match=r"bpe:300 learns a new tokenizer from text, but 1 of 2 records are pre-tokenised"):
        prepare(data_cfg(path=str(tmp_path / "ids.jsonl"), tokenizer="bpe:300", cache_dir=str(tmp_path / "ids")))


def test_the_embedded_dataset_streams_too_with_its_held_out_records(data_cfg, tmp_path, monkeypatch):
    from densebatch.config import DefaultDataConfig

    cfg = {"default": DefaultDataConfig(num_records=900), "eval_fraction": 0.05}
    with monkeypatch.context() as m:
        in_memory(m)
        ref = prepare(data_cfg(cache_dir=str(tmp_path / "ref"), **cfg))
    got = prepare(data_cfg(cache_dir=str(tmp_path / "got"), num_proc=2, chunk_records=128, **cfg))
    assert _files(got.cache_dir) == _files(ref.cache_dir)
    assert got.eval_records == ref.eval_records and len(ref.eval_records) == 45  # what the accuracy check answers


def test_a_bad_record_in_a_workers_chunk_is_named_as_in_one_process(data_cfg, tmp_path, monkeypatch):
    lines = [json.dumps({"instruction": f"t{i}", "input": "", "output": "a"}).encode() for i in range(300)]
    lines[250] = json.dumps({"input": "", "output": "no instruction"}).encode()  # in the fourth chunk
    lines[260] = b'{"instruction": '  # malformed JSON: found while reading, so named first, as in one process
    path = tmp_path / "r.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(DataError, match=rf"{path.name}:261"):
        prepare(data_cfg(path=str(path), num_proc=2, chunk_records=64))
    lines[260] = lines[0]
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(DataError, match=rf"{path.name}:251: .*instruction"):
        prepare(data_cfg(path=str(path), num_proc=2, chunk_records=64))


def _die_on_chunk_3(cfg, **kw):
    if kw["index"] == 3:
        os._exit(9)  # a worker killed in the middle of its chunk
    return _real_prepare_chunk(cfg, **kw)


_real_prepare_chunk = stream._prepare_chunk


def test_a_dead_worker_is_one_line_and_the_rerun_prepares_only_the_missing_chunks(data_cfg, tmp_path, monkeypatch):
    path = tmp_path / "r.jsonl"
    path.write_bytes(b"\n".join(_records(500, seed=1)) + b"\n")
    monkeypatch.setattr(stream, "_prepare_chunk", _die_on_chunk_3)  # the forked workers inherit the patch
    with pytest.raises(DataError, match=r"r\.jsonl:\d+ to .*r\.jsonl:\d+ \(chunk 3\): a worker process died; run again"):
        _prepare(data_cfg, path, tmp_path, "c", num_proc=2, chunk_records=64)
    stage = next((tmp_path / "c").glob(".chunks-*"))
    done = sorted(p.name for p in stage.glob("chunk-*.npz"))
    assert "chunk-000003.npz" not in done and len(done) >= 2  # a chunk cut short left at most a temporary file
    redone = []
    monkeypatch.setattr(stream, "_prepare_chunk", lambda cfg, **kw: redone.append(kw["index"]) or _real_prepare_chunk(cfg, **kw))
    got = _prepare(data_cfg, path, tmp_path, "c", num_proc=1, chunk_records=64)
    assert 3 in redone and not any(f"chunk-{i:06d}.npz" in done for i in redone)  # no completed chunk redone
    with monkeypatch.context() as m:
        in_memory(m)
        ref = _prepare(data_cfg, path, tmp_path, "ref")
    assert _files(got.cache_dir) == _files(ref.cache_dir)


def test_ranks_each_prepare_a_disjoint_share_and_rank_0_assembles_the_same_store(data_cfg, tmp_path, monkeypatch):
    """Under torchrun every rank tokenises its share of the chunks (``prepare_share``) before rank 0 assembles:
    here 3 ranks in turn, in one process; the store is the one-process store, and no chunk was made twice."""
    from densebatch.data.prepare.parts import prepare_share

    path = tmp_path / "r.jsonl"
    path.write_bytes(b"\n".join(_records(600, seed=2)) + b"\n")
    one = _prepare(data_cfg, path, tmp_path, "one", chunk_records=64)
    made = []
    monkeypatch.setattr(stream, "_prepare_chunk", lambda cfg, **kw: made.append(kw["index"]) or _real_prepare_chunk(cfg, **kw))
    cfg = dict(cache_dir=str(tmp_path / "ranks"), eval_fraction=0.1, max_seq_len=300, on_bad_record="skip", num_proc=1)
    shares = []
    for rank in (2, 0, 1):
        made.clear()
        clean = CleanConfig(dedupe=True, collapse_whitespace=True, strip_html=True)
        assert prepare_share(data_cfg(path=str(path), chunk_records=64, clean=clean, **cfg), rank, 3) == len(made)
        shares.append(set(made))
    assert all(i % 3 == r for share, r in zip(shares, (2, 0, 1)) for i in share) and sum(map(len, shares)) == 10
    made.clear()
    got = _prepare(data_cfg, path, tmp_path, "ranks", chunk_records=64, num_proc=1)
    assert made == [] and _files(got.cache_dir) == _files(one.cache_dir)  # rank 0 only assembled

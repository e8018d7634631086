"""DocumentStore: round trips, memory mapping, and never trusting an incomplete directory."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from densebatch.data.store.store import MARKER, DocumentStore, take
from densebatch.errors import DataError

docs_strategy = st.lists(st.lists(st.tuples(st.integers(0, 50_000), st.integers(0, 1)), min_size=1, max_size=30), max_size=20)


@given(docs_strategy, st.sampled_from([1, 7, 40, 1 << 27]), st.data())
@settings(max_examples=40, deadline=None, derandomize=True)
def test_round_trip_through_disk_in_shards(tmp_path_factory, docs, shard_tokens, data):
    """Any shard size (1 token: a shard a document) reads back the same documents, spans, per-document loss
    tokens and gathered lengths as the store in memory; shards hold whole documents, at most shard_tokens
    each unless one document is longer; lengths are uint32 on disk."""
    documents = [([t for t, _ in d], [m for _, m in d]) for d in docs]
    store = DocumentStore.from_documents(documents, {"eos_id": 1, "pad_id": 1})
    opened = store.save(tmp_path_factory.mktemp("s") / "store", shard_tokens=shard_tokens)
    assert len(opened) == len(documents)
    assert [int(x) for x in opened.lengths] == [len(t) for t, _ in documents] and opened.lengths.dtype == np.uint32
    for i, (t, m) in enumerate(documents):
        tokens, mask = opened.document(i)
        assert tokens.tolist() == t and mask.tolist() == m
    assert opened.tokens.dtype == np.int32 and opened.loss_mask.dtype == np.uint8
    assert opened.meta["num_documents"] == len(documents) and opened.eos_id == 1 and opened.pad_id == 1
    index = json.loads((opened.path / "index.json").read_text())["shards"]
    assert sum(e["documents"] for e in index) == len(documents)
    assert all(e["tokens"] <= shard_tokens or e["documents"] == 1 for e in index)
    if documents:
        docs_asked = np.array(data.draw(st.lists(st.integers(0, len(documents) - 1), max_size=12)), np.int64)
        first, n = opened.doc_spans(docs_asked)
        assert first.tolist() == store.offsets[docs_asked].tolist() and n.tolist() == store.lengths[docs_asked].tolist()
        assert take(opened.lengths, docs_asked).tolist() == store.lengths[docs_asked].tolist()
        assert np.array_equal(opened.doc_loss_tokens, store.doc_loss_tokens)
    assert np.array_equal(opened.offsets, store.offsets) and opened.max_length == store.max_length


def test_document_spans_from_disk_cross_blocks_and_windows(tmp_path, monkeypatch):
    """Spans of documents far apart (other 64-document blocks, other windows of the lengths, other shards)
    from the offsets held every 64 documents, against the offsets in memory."""
    import densebatch.data.store.store as store_mod

    monkeypatch.setattr(store_mod, "WINDOW_TOKENS", 256)  # the held offsets computed over 4 windows
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 9, 1000)
    store = DocumentStore.from_documents([(np.ones(k, np.int32), np.ones(k, np.uint8)) for k in lengths])
    opened = store.save(tmp_path / "s", shard_tokens=500)
    asked = np.array([0, 63, 64, 65, 511, 512, 999, 998, 0, 700])
    first, n = opened.doc_spans(asked)
    assert first.tolist() == store.offsets[asked].tolist() and n.tolist() == lengths[asked].tolist()
    perm = rng.permutation(1000)
    assert take(opened.lengths, perm).tolist() == lengths[perm].tolist()
    monkeypatch.setattr(store_mod, "_SPANS", 100)  # scattered and repeated documents, in ascending batches of 100
    asked = np.concatenate([perm, perm[:300], [5, 5]]).reshape(-1, 2)
    first, n = opened.doc_spans(asked)
    assert first.tolist() == store.offsets[asked].tolist() and n.tolist() == lengths[asked].tolist()


def test_a_store_of_an_older_format_is_refused_in_one_line(tmp_path):
    """A store written before shards (flat tokens.npy, offsets.npy) is never misread: one line says to prepare again."""
    d = tmp_path / "old"
    d.mkdir()
    np.save(d / "tokens.npy", np.array([1, 2, 3], np.int32))
    np.save(d / "offsets.npy", np.array([0, 3], np.int64))
    (d / "meta.json").write_text("{}")
    sizes = {n: (d / n).stat().st_size for n in ("tokens.npy", "offsets.npy", "meta.json")}
    (d / MARKER).write_text(json.dumps({"sizes": sizes}))
    with pytest.raises(DataError, match="older densebatch.*prepare it again") as e:
        DocumentStore.open(d)
    assert "\n" not in str(e.value)


def test_tokens_take_two_bytes_when_the_vocabulary_fits(tmp_path):
    """uint16 tokens for a vocabulary of at most 65,536 ids (GPT-2's, the byte-level default's), int32 above;
    read back and collated as the same ids."""
    from densebatch.data.load.collate import CausalCollator

    docs = [([5, 65535, 7, 1], [0, 1, 1, 1]), ([9, 8, 1], [0, 0, 1])]
    for vocab, dtype in ((65_536, np.uint16), (128_256, np.int32)):
        store = DocumentStore.from_documents(docs, {"eos_id": 1, "pad_id": 0, "vocab_size": vocab}).save(tmp_path / str(vocab))
        tokens_file = tmp_path / str(vocab) / "shard-000000" / "tokens.npy"
        assert store.tokens.dtype == dtype and tokens_file.stat().st_size == 128 + 7 * dtype().itemsize
        batch = CausalCollator(pad_id=0)(store, [[(0, 0, 4), (1, 0, 3)]])
        assert batch.input_ids.tolist() == [[5, 65535, 7, 1, 9, 8, 1]] and batch.labels.tolist() == [
            [65535, 7, 1, -100, -100, 1, -100]
        ]


def test_opened_arrays_are_memory_mapped(tmp_path):
    store = DocumentStore.from_documents([([1, 2, 3], [0, 1, 1])]).save(tmp_path / "s")
    assert isinstance(store.tokens, np.memmap) and isinstance(store.loss_mask, np.memmap)
    assert not list(tmp_path.glob(".tmp-*")), "the temporary directory is removed"


def test_directory_without_marker_is_not_trusted(tmp_path):
    store = DocumentStore.from_documents([([1, 2, 3], [0, 1, 1])]).save(tmp_path / "s")
    (store.path / MARKER).unlink()
    assert not DocumentStore.is_complete(store.path)
    with pytest.raises(DataError, match="not a complete document store"):
        DocumentStore.open(store.path)


def test_truncated_file_is_not_trusted(tmp_path):
    store = DocumentStore.from_documents([([1, 2, 3, 4], [0, 1, 1, 1])]).save(tmp_path / "s")
    path = store.path / "shard-000000" / "tokens.npy"
    del store
    path.write_bytes(path.read_bytes()[:-4])  # a crash mid-write of one file
    assert not DocumentStore.is_complete(tmp_path / "s")


def test_save_replaces_an_incomplete_directory(tmp_path):
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "tokens.npy").write_bytes(b"garbage")
    store = DocumentStore.from_documents([([5, 6], [0, 1])]).save(tmp_path / "s")
    assert store.document(0)[0].tolist() == [5, 6]
    assert json.loads((tmp_path / "s" / "meta.json").read_text())["num_tokens"] == 2


def test_mismatched_document_is_rejected():
    with pytest.raises(ValueError, match="mask"):
        DocumentStore.from_documents([([1, 2], [1])])


def test_sources_round_trip_and_offsets(tmp_path):
    docs = [([1, 2], [0, 1]), ([3], [0]), ([4, 5, 6], [0, 1, 1]), ([7, 8], [0, 1])]
    store = DocumentStore.from_documents(docs, {"sources": ["a", "b", "c"]}, source=[0, 0, 2, 2])
    opened = store.save(tmp_path / "s")
    assert opened.source.tolist() == [0, 0, 2, 2] and opened.source.dtype == np.int16
    assert opened.source_names == ["a", "b", "c"] and opened.source_offsets().tolist() == [0, 2, 2, 4]
    assert opened.meta["source_documents"] == [2, 0, 2]
    (opened.path / "shard-000001" / "lengths.npy").write_bytes(b"x")  # the index covers every shard's files
    assert not DocumentStore.is_complete(opened.path)
    plain = DocumentStore.from_documents(docs)
    assert plain.source is None and plain.source_names == ["data"] and plain.source_offsets().tolist() == [0, 4]
    with pytest.raises(ValueError, match="source after source"):
        DocumentStore.from_documents(docs, source=[1, 0, 0, 0])

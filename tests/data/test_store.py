"""DocumentStore: round trips, memory mapping, and never trusting an incomplete directory."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from densebatch.data.prepare.store import MARKER, DocumentStore
from densebatch.errors import DataError

docs_strategy = st.lists(st.lists(st.tuples(st.integers(0, 50_000), st.integers(0, 1)), min_size=1, max_size=30), max_size=20)


@given(docs_strategy)
@settings(max_examples=30, deadline=None, derandomize=True)
def test_round_trip_through_disk(tmp_path_factory, docs):
    documents = [([t for t, _ in d], [m for _, m in d]) for d in docs]
    store = DocumentStore.from_documents(documents, {"eos_id": 1, "pad_id": 1})
    opened = store.save(tmp_path_factory.mktemp("s") / "store")
    assert len(opened) == len(documents)
    assert opened.lengths.tolist() == [len(t) for t, _ in documents]
    for i, (t, m) in enumerate(documents):
        tokens, mask = opened.document(i)
        assert tokens.tolist() == t and mask.tolist() == m
    assert opened.tokens.dtype == np.int32 and opened.offsets.dtype == np.int64 and opened.loss_mask.dtype == np.uint8
    assert opened.meta["num_documents"] == len(documents) and opened.eos_id == 1 and opened.pad_id == 1


def test_tokens_take_two_bytes_when_the_vocabulary_fits(tmp_path):
    """uint16 tokens for a vocabulary of at most 65,536 ids (GPT-2's, the byte-level default's), int32 above;
    read back and collated as the same ids."""
    from densebatch.data.load.collate import CausalCollator

    docs = [([5, 65535, 7, 1], [0, 1, 1, 1]), ([9, 8, 1], [0, 0, 1])]
    for vocab, dtype in ((65_536, np.uint16), (128_256, np.int32)):
        store = DocumentStore.from_documents(docs, {"eos_id": 1, "pad_id": 0, "vocab_size": vocab}).save(tmp_path / str(vocab))
        assert store.tokens.dtype == dtype and (tmp_path / str(vocab) / "tokens.npy").stat().st_size == 128 + 7 * dtype().itemsize
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
    path = store.path / "tokens.npy"
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
    (opened.path / "source.npy").write_bytes(b"x")  # the marker covers the source array too
    assert not DocumentStore.is_complete(opened.path)
    plain = DocumentStore.from_documents(docs)
    assert plain.source is None and plain.source_names == ["data"] and plain.source_offsets().tolist() == [0, 4]
    with pytest.raises(ValueError, match="source after source"):
        DocumentStore.from_documents(docs, source=[1, 0, 0, 0])

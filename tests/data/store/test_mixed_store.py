"""MixedStore: sources' stores read as one, against a store holding copies of their documents (any parts, any reads)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from densebatch.data.load.collate import CausalCollator
from densebatch.data.plan.planner import PlanSettings, plan_epoch
from densebatch.data.plan.steps import rows_of
from densebatch.data.store.mixed import MixedStore
from densebatch.data.store.store import DocumentStore, read_ranges

torch = pytest.importorskip("torch")

document = st.lists(st.integers(0, 300), min_size=1, max_size=12).flatmap(
    lambda ids: st.tuples(st.just(ids), st.lists(st.integers(0, 1), min_size=len(ids), max_size=len(ids)))
)
parts = st.lists(st.tuples(st.integers(0, 2), st.lists(document, max_size=6)), min_size=1, max_size=5).filter(
    lambda ps: any(docs for _, docs in ps)
)


@settings(max_examples=150, deadline=None)
@given(parts, st.data())
def test_a_mixed_store_reads_as_the_store_of_its_parts_documents_laid_source_after_source(drawn, data):
    drawn = sorted(drawn, key=lambda p: p[0])  # stable: a source's parts keep their order
    meta = {"eos_id": 0, "pad_id": 0, "vocab_size": 301, "sources": ["a", "b", "c"]}
    stores = [(DocumentStore.from_documents(docs, dict(meta)), s) for s, docs in drawn]
    mixed = MixedStore(stores, meta)
    docs = [d for _, ds in drawn for d in ds]
    source = [s for s, ds in drawn for _ in ds]
    copy = DocumentStore.from_documents(docs, dict(meta), source=source)
    n = len(copy)
    assert len(mixed) == n and mixed.source_names == ["a", "b", "c"]
    assert mixed.source_offsets().tolist() == copy.source_offsets().tolist()
    assert mixed.sources_of(np.arange(n)).tolist() == source and mixed.source.tolist() == source
    assert np.array_equal(np.asarray(mixed.lengths), copy.lengths)
    assert np.array_equal(np.asarray(mixed.doc_loss_tokens), np.asarray(copy.doc_loss_tokens))
    assert mixed.num_tokens == copy.num_tokens and mixed.max_length == max(len(t) for t, _ in docs)
    assert mixed.meta["num_loss_tokens"] == int(np.sum(copy.doc_loss_tokens))
    picked = np.array(data.draw(st.lists(st.integers(0, n - 1), max_size=20)), np.int64)  # any order, repeats
    a, k = mixed.doc_spans(picked)
    b, m = copy.doc_spans(picked)
    assert np.array_equal(k, m)
    for arr_mixed, arr_copy in ((mixed.tokens, copy.tokens), (mixed.loss_mask, copy.loss_mask)):
        assert np.array_equal(read_ranges(arr_mixed, a, a + k), read_ranges(arr_copy, b, b + m))
    for i in picked[:3].tolist():
        assert all(np.array_equal(x, y) for x, y in zip(mixed.document(i), copy.document(i)))


def test_collated_batches_equal_the_copys():
    rng = np.random.default_rng(0)
    meta = {"eos_id": 0, "pad_id": 0, "vocab_size": 50, "sources": ["a", "b"]}
    drawn = [(s, [(rng.integers(1, 50, int(k)).tolist(), [1] * int(k)) for k in rng.integers(2, 40, 30)]) for s in (0, 0, 1)]
    mixed = MixedStore([(DocumentStore.from_documents(d, dict(meta)), s) for s, d in drawn], meta)
    copy = DocumentStore.from_documents([x for _, d in drawn for x in d], dict(meta), source=[s for s, d in drawn for _ in d])
    plan = plan_epoch(
        np.asarray(mixed.lengths, np.int64), settings=PlanSettings(seq_len=48, max_tokens_per_batch=192), seed=0, epoch=0
    )
    collate = CausalCollator(pad_id=0)
    for b in range(plan.num_batches):
        rows = rows_of(plan, np.arange(plan.batch_ptr[b], plan.batch_ptr[b + 1]))
        x, y = collate(mixed, rows), collate(copy, rows)
        for f in ("input_ids", "labels", "positions", "source_ids"):
            assert torch.equal(getattr(x, f), getattr(y, f)), f


def test_parts_out_of_source_order_are_refused():
    one = DocumentStore.from_documents([([1, 2], [0, 1])], {"eos_id": 0})
    with pytest.raises(ValueError, match="source after source"):
        MixedStore([(one, 1), (one, 0)], {"sources": ["a", "b"]})


def test_arrays_read_as_one_keep_every_id_in_one_integer_type():
    """joined.read_as_one, which a mixture's stores and a foreign corpus's files share: the widest integer type of
    the parts, int64 where numpy's rule gives float64 (uint64 beside int64: the ids of a uint64 corpus beside
    int64 ones), the dtype asked for, and a single array as it is when it has that dtype."""
    from densebatch.data.store.joined import read_as_one

    big, signed = np.array([2**40, 7], np.uint64), np.array([3, 4], np.int64)
    both = read_as_one([big, signed])
    assert both.dtype == np.int64 and read_ranges(both, np.array([0]), np.array([4])).tolist() == [2**40, 7, 3, 4]
    assert read_as_one([np.zeros(2, np.uint16), np.zeros(1, np.uint32)]).dtype == np.uint32
    assert read_as_one([signed]) is signed and read_as_one([signed], np.uint32).dtype == np.uint32

"""ForeignStore's pieces, no writer needed: the computed loss mask against a dense one, the eval rule."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from densebatch.data.prepare.foreign import held_out
from densebatch.data.store.formats.view import FirstTokenMask
from densebatch.data.store.store_io import read_ranges


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=40), st.data())
def test_first_token_mask_equals_the_dense_mask_on_any_ranges(lengths, data):
    """Ones but at each document's start, on any ranges (within or across documents), with or without the writer's mask."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    total = int(sum(lengths))
    base = np.array(data.draw(st.lists(st.integers(0, 1), min_size=total, max_size=total)), np.uint8)
    for writer in (None, base):
        dense = np.ones(total, np.uint8) if writer is None else writer.copy()
        dense[starts] = 0
        mask = FirstTokenMask(starts, total, writer)
        k = data.draw(st.integers(1, 6))
        a = np.array(data.draw(st.lists(st.integers(0, total), min_size=k, max_size=k)), np.int64)
        b = np.minimum(a + np.array(data.draw(st.lists(st.integers(0, total), min_size=k, max_size=k)), np.int64), total)
        want = np.concatenate([dense[x:y] for x, y in zip(a, b)])
        assert (read_ranges(mask, a, b) == want).all()
        assert (np.asarray(mask) == dense).all() and (mask[3:9] == dense[3:9]).all()


@given(st.integers(0, 3000), st.floats(0.0, 0.5))
def test_eval_rule_is_a_prefix_property_and_near_the_fraction(n, fraction):
    """Appending documents never moves one between train and eval; about the fraction is held out."""
    ev = held_out(n, fraction)
    more = held_out(n + 500, fraction)
    if ev.sum() > 1:  # picked by the hash threshold, not the one-document fallback of a tiny split
        assert (more[:n] == ev).all()
    if n >= 2000 and fraction > 0:
        assert abs(ev.mean() - fraction) <= 4 * np.sqrt(fraction * (1 - fraction) / n) + 1 / n


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 20), min_size=1, max_size=30), st.randoms(use_true_random=False), st.integers(1, 3), st.booleans())
def test_a_split_written_with_its_starts_out_of_order_reads_the_same_masks(tmp_path_factory, lengths, rnd, blocks, local):
    """Documents whose starts the writer's order leaves unsorted (a format mapped once per id alignment: within
    each input file, ``local``, or anywhere): the store keeps their sorted copy (first_tokens.npy), so each
    document's mask is still 0 then 1s."""
    from densebatch.data.store.formats.view import ForeignStore, SplitWriter

    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    groups = np.array_split(np.arange(len(lengths)), blocks)  # the input files, a block each
    if local:
        for g in groups:
            rnd.shuffle(g)
    else:
        order = np.concatenate(groups)
        rnd.shuffle(order)
        groups = np.array_split(order, blocks)
    order = np.concatenate(groups).tolist()
    d = tmp_path_factory.mktemp("split") / "train"
    w = SplitWriter(d, {})
    for g in groups:
        w.add(starts[g], np.array(lengths)[g], np.array(lengths)[g] - 1)
    w.close()
    assert (d / "first_tokens.npy").exists() == (order != sorted(order))
    if order != sorted(order):
        assert (np.load(d / "first_tokens.npy") == starts).all()
    store = ForeignStore(d, np.zeros(int(sum(lengths)), np.uint16))
    s, n = store.doc_spans(np.arange(len(store)))
    assert (s == starts[order]).all()
    got = read_ranges(store.loss_mask, s, s + n)
    assert got.tolist() == [x for k in n for x in [0] + [1] * (int(k) - 1)]

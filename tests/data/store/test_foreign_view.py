"""ForeignStore's pieces, no writer needed: the computed loss mask against a dense one, the eval rule."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from densebatch.data.prepare.foreign import held_out
from densebatch.data.store.formats.view import FirstTokenMask
from densebatch.data.store.store_io import read_ranges


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=40), st.data())
def test_first_token_mask_equals_the_dense_mask_on_any_ranges(lengths, data):
    """Ones but at each document's start, on any ranges (within or across documents), with or without the writer's mask,
    whichever starts it holds in memory (``every``)."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    total = int(sum(lengths))
    base = np.array(data.draw(st.lists(st.integers(0, 1), min_size=total, max_size=total)), np.uint8)
    for writer in (None, base):
        dense = np.ones(total, np.uint8) if writer is None else writer.copy()
        dense[starts] = 0
        mask = FirstTokenMask(starts, total, writer, every=data.draw(st.sampled_from([1, 2, 3, 7, 64])))
        k = data.draw(st.integers(1, 6))
        a = np.array(data.draw(st.lists(st.integers(0, total), min_size=k, max_size=k)), np.int64)
        b = np.minimum(a + np.array(data.draw(st.lists(st.integers(0, total), min_size=k, max_size=k)), np.int64), total)
        want = np.concatenate([dense[x:y] for x, y in zip(a, b)])
        assert (read_ranges(mask, a, b) == want).all()
        assert (np.asarray(mask) == dense).all() and (mask[3:9] == dense[3:9]).all()


def _resident_mb(path: Path) -> float:
    """This process's resident MB of the mappings of ``path`` (Linux's smaps)."""
    kb, here = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0] and not line.split(" ", 1)[0].endswith(":"):
            here = line.rstrip().endswith(str(path))
        elif here and line.startswith("Rss:"):
            kb += int(line.split()[1])
    return kb / 1024


@pytest.mark.skipif(not Path("/proc/self/smaps").is_file(), reason="reads Linux's /proc/self/smaps")
def test_first_token_mask_leaves_the_starts_file_unmapped(tmp_path):
    """Reading scattered ranges keeps no page of a memory-mapped starts file resident (issue 46: a search of the
    mapping faulted it all in, 8 bytes a document held while training)."""
    starts = np.arange(0, 8 << 20, 2, dtype=np.int64)  # 4M documents of 2 tokens: a 32 MB file
    np.save(tmp_path / "starts.npy", starts)
    mapped = np.load(tmp_path / "starts.npy", mmap_mode="r")
    mask = FirstTokenMask(mapped, 8 << 20)
    a = np.random.default_rng(0).integers(0, (8 << 20) - 100, 2000)
    got = read_ranges(mask, a, a + 100)
    assert (got == (np.arange(100) % 2 != a[:, None] % 2).reshape(-1)).all()
    assert _resident_mb(tmp_path / "starts.npy") < 1


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

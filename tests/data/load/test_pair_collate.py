"""The pair collator: the layout drawn in data/load/pair_collate.py, the same answer targets with the prompt once
or twice, the prompt's targets once (ORPO), segment bounds, a cut pair refused, and a batch's rows sliced."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from densebatch.batch import IGNORE_INDEX
from densebatch.data.load.pair_collate import PairCollator, laid_lengths
from densebatch.data.store.pair_layout import pair_document, pair_spans
from densebatch.data.store.store import DocumentStore
from densebatch.errors import DataError


def _store(raw):
    docs = [pair_document(np.array(p), np.array(c), np.array(r), chosen_loss=lc, rejected_loss=lr) for p, c, r, lc, lr in raw]
    return DocumentStore.from_documents(docs, meta={"eos_id": 0, "pad_id": 0, "pairs": True})


def test_the_drawn_layout():
    store = _store([([10, 11, 12], [20, 21, 9], [30, 9], [1, 1, 1], [1, 1])])
    b = PairCollator(0, prompt_targets=True)(store, [[(0, 0, 9)]])
    assert b.input_ids.tolist() == [[10, 11, 12, 20, 21, 9, 12, 30, 9]]
    assert b.positions.tolist() == [[0, 1, 2, 3, 4, 5, 2, 3, 4]]
    assert b.pairs.branches.tolist() == [[0, 0, 1, 1, 1, 1, 2, 2, 2]]
    assert b.labels.tolist() == [[11, 12, 20, 21, 9, -100, 30, 9, -100]]
    assert b.pairs.answer.tolist() == [[-1, -1, 0, 0, 0, -1, 1, 1, -1]]
    assert b.pairs.prompt.tolist() == [[0, 0, -1, -1, -1, -1, -1, -1, -1]]
    twice = PairCollator(0, shared=False)(store, [[(0, 0, 11)]])  # planned as laid: two prompt tokens more
    assert twice.input_ids.tolist() == [[10, 11, 12, 20, 21, 9, 10, 11, 12, 30, 9]]
    assert twice.positions.tolist() == [[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4]]
    assert twice.pairs.branches is None and twice.cu_seqlens.tolist() == [0, 6, 11]
    assert b.single_doc_rows is False and b.cu_seqlens.tolist() == [0, 9]


@settings(max_examples=40, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(1, 6), st.integers(1, 5), st.integers(1, 5)), min_size=1, max_size=6),
    per_row=st.integers(1, 3),
    seed=st.integers(0, 1000),
)
def test_prompt_once_or_twice_gives_each_pair_the_same_targets(shapes, per_row, seed):
    """Each pair's answer targets (the token, its position, its side) are the same in both layouts and in any
    packing; loss-free answer tokens are no target; the laid lengths are what the planner is told."""
    rng = np.random.default_rng(seed)
    raw = [
        (rng.integers(3, 40, p).tolist(), rng.integers(3, 40, c).tolist(), rng.integers(3, 40, r).tolist(),
         rng.integers(0, 2, c).tolist(), rng.integers(0, 2, r).tolist())
        for p, c, r in shapes
    ]  # fmt: skip
    store = _store(raw)
    lengths = [int(x) for x in store.lengths]
    rows = [[(i, 0, lengths[i]) for i in range(k, min(len(raw), k + per_row))] for k in range(0, len(raw), per_row)]

    def targets(b):
        out = {}
        keep = b.pairs.answer >= 0
        for slot, tok, pos in zip(b.pairs.answer[keep].tolist(), b.labels[keep].tolist(), b.positions[keep].tolist()):
            out.setdefault(slot, []).append((tok, pos))
        return out

    prefixes = pair_spans(np.asarray(store.loss_mask), store.lengths)[:, 0]
    laid = laid_lengths(store.lengths, prefixes, False)
    rows_twice = [[(d, 0, int(laid[d])) for d, _, _ in row] for row in rows]
    shared, twice = PairCollator(0)(store, rows), PairCollator(0, shared=False)(store, rows_twice)
    assert targets(shared) == targets(twice)
    for k, (p, c, _r, lc, _lr) in enumerate(raw):  # the chosen answer's loss tokens, at prompt length on
        want = [(t, len(p) - 1 + j) for j, (t, flag) in enumerate(zip(c, lc)) if flag]
        assert targets(shared).get(2 * k, []) == want
    assert shared.num_real_tokens == sum(laid_lengths(store.lengths, prefixes, True))
    assert twice.num_real_tokens == sum(laid_lengths(store.lengths, prefixes, False))
    assert shared.num_loss_tokens == twice.num_loss_tokens == int((shared.labels != IGNORE_INDEX).sum())


def test_a_pair_is_collated_whole_or_not_at_all():
    store = _store([([1, 2], [3, 4], [5], [1, 1], [1])])
    with pytest.raises(DataError, match="a pair is collated whole"):
        PairCollator(0)(store, [[(0, 0, 3)]])


def test_a_batch_of_pairs_sliced_by_rows_renumbers_its_pairs():
    store = _store([([1, 2], [3, 4], [5], [1, 1], [1]), ([6], [7], [8, 9], [1], [1, 1]), ([2, 3, 4], [5], [6], [1], [1])])
    n = [int(x) for x in store.lengths]
    b = PairCollator(0, prompt_targets=True, reference=np.arange(6.0).reshape(3, 2))(
        store, [[(0, 0, n[0]), (1, 0, n[1])], [(2, 0, n[2])]]
    )
    tail = b.pairs.row_slice(1, 2)
    assert tail.count == 1 and tail.ids == (2,) and tail.rows.tolist() == [0]
    assert set(tail.answer[tail.answer >= 0].tolist()) == {0, 1} and tail.reference.tolist() == [[4.0, 5.0]]
    assert torch.equal(tail.prompt >= 0, b.pairs.prompt[1:2] >= 0)


@pytest.mark.parametrize("strategy", ["random", "length_grouped", "token_budget", "packed"])
def test_every_strategy_plans_pairs_whole_and_counts_them_as_laid(strategy):
    """Every strategy keeps a pair whole in one row of one batch, each pair once an epoch, and a budget holds
    the pairs as laid (prompt once): what the collator lays is what the planner counted."""
    from densebatch.data.plan.planner import PlanSettings, plan_epoch

    rng = np.random.default_rng(3)
    raw = [(rng.integers(3, 40, p).tolist(), rng.integers(3, 40, c).tolist(), rng.integers(3, 40, r).tolist(), [1] * c, [1] * r)
           for p, c, r in rng.integers(1, 12, (40, 3))]  # fmt: skip
    store = _store(raw)
    settings = PlanSettings(strategy=strategy, seq_len=64, max_tokens_per_batch=128, rows_per_batch=4)
    plan = plan_epoch(np.asarray(store.lengths), settings, seed=0, epoch=0)
    assert sorted(plan.doc.tolist()) == list(range(len(raw)))
    assert (plan.start == 0).all() and (plan.stop == np.asarray(store.lengths)[plan.doc]).all()
    for b in range(plan.num_batches):
        batch = PairCollator(0)(store, plan.batch(b))
        assert batch.pairs.count == sum(len(row) for row in plan.batch(b))
        if strategy in ("token_budget", "packed"):
            assert batch.num_slots <= 128

"""Rows cut over context ranks (train/parallel/shards.py): each rank's columns, counts, padding, and the steps source.

No process group is needed: cutting is host work, and each rank's share is computed here for every rank.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from hypothesis import given
from hypothesis import strategies as st

from densebatch.batch import IGNORE_INDEX, Batch, Step, shard_columns
from densebatch.testing.batches import pack
from densebatch.train.parallel.mesh import ContextRanks
from densebatch.train.parallel.shards import ShardedSteps, pad_columns, shard_batch


def _rows(draw_lengths: list[list[int]], T: int) -> Batch:
    gen = torch.Generator().manual_seed(sum(map(sum, draw_lengths)))
    return pack([[torch.randint(1, 50, (n,), generator=gen).tolist() for n in row] for row in draw_lengths], seq_len=T)


@st.composite
def split_rows(draw):
    N = draw(st.sampled_from([2, 3, 4]))
    T = draw(st.integers(1, 40))  # rows of any length: 2N need not divide it (padding is added)
    rows = []
    for _ in range(draw(st.integers(1, 3))):
        left, row = T, []
        while left and draw(st.booleans()):
            n = draw(st.integers(1, left))
            row.append(n)
            left -= n
        rows.append(row or [T])
    return N, _rows(rows, T)


@given(split_rows())
def test_the_ranks_columns_are_the_rows_once_with_their_labels_positions_and_counts(case):
    N, batch = case
    shards = [shard_batch(batch, ContextRanks(N, i)) for i in range(N)]
    padded = pad_columns(batch, 2 * N)
    T = padded.seq_len
    assert T % (2 * N) == 0 and T - batch.seq_len < 2 * N
    assert torch.equal(padded.input_ids[:, : batch.seq_len], batch.input_ids)
    assert (padded.labels[:, batch.seq_len :] == IGNORE_INDEX).all()  # the padding run carries no target
    for i, s in enumerate(shards):
        cols = shard_columns(T, N, i)
        for field in ("input_ids", "labels", "positions"):
            assert torch.equal(getattr(s, field), getattr(padded, field)[:, cols])
        assert s.num_loss_tokens == int((s.labels != IGNORE_INDEX).sum())
        assert s.shard is not None and (s.shard.index, s.shard.degree) == (i, N)
        assert torch.equal(s.shard.positions, padded.positions) and s.shard.seq_len == T
        assert s.shard.cu_seqlens[-1] == padded.num_slots and s.cu_seqlens is None
        assert shard_batch(s, ContextRanks(N, i)) is s  # cut once
        assert s.single_doc_rows is bool(batch.single_doc_rows)  # unknown (None) is False: never guessed from columns
    # the context ranks hold disjoint targets: the step's denominator over ranks is the batch's loss tokens
    assert sum(s.num_loss_tokens for s in shards) == batch.num_loss_tokens
    assert sum(s.num_real_tokens for s in shards) == batch.num_real_tokens
    assert sum(s.num_slots for s in shards) == padded.num_slots


def test_padding_is_a_segment_of_its_own():
    batch = pack([[[1, 2, 3], [4, 5]]], seq_len=7)  # a a a b b P P
    padded = pad_columns(batch, 4)  # one more column, its own segment
    assert padded.positions.tolist() == [[0, 1, 2, 0, 1, 0, 1, 0]]
    assert padded.cu_seqlens.tolist() == [0, 3, 5, 7, 8] and padded.max_seqlen == 3
    assert pad_columns(replace(batch, max_position=2), 4).max_position == 2
    assert pad_columns(padded, 4) is padded


def test_an_idle_ranks_null_batch_is_cut_into_null_shards():
    shards = [shard_batch(Batch.null(0), ContextRanks(2, i)) for i in range(2)]
    assert all(s.is_null and s.num_loss_tokens == 0 and s.seq_len == 2 for s in shards)


def test_head_and_tail_chunks_even_out_causal_work():
    """Rank i holds chunks i and 2N-1-i: over a row-long document each rank's causal pairs (sum over its columns
    of position + 1) are equal; every column is held once, each rank's in row order."""
    for N in (1, 2, 3, 4, 8):
        for T in (2 * N, 6 * N, 64 * N):
            cols = [shard_columns(T, N, i) for i in range(N)]
            assert torch.equal(torch.sort(torch.cat(cols)).values, torch.arange(T))
            work = {int((c + 1).sum()) for c in cols}
            assert len(work) == 1 and work.pop() * N == T * (T + 1) // 2
            assert all(torch.equal(c, torch.sort(c).values) for c in cols)
    assert shard_columns(8, 2, 0).tolist() == [0, 1, 6, 7] and shard_columns(8, 2, 1).tolist() == [2, 3, 4, 5]


class _Source:
    """A minimal step source: two steps of one batch each, with a state and a close()."""

    def __init__(self, batch):
        self.batch, self.max_epochs, self.step_fraction, self.loss_tokens_per_step = batch, None, None, None
        self.loaded, self.closed, self.fraction = None, False, "unset"

    def __iter__(self):
        source = self

        class It:
            n = 0

            def __iter__(self):
                return self

            def __next__(self):
                if self.n == 2:
                    raise StopIteration
                self.n += 1
                return Step((source.batch,), epoch=0.5 * self.n)

            def close(self):
                source.closed = True

        return It()

    def steps_per_epoch(self):
        return 2

    def state_dict(self):
        return {"steps": 7}

    def load_state_dict(self, state):
        self.loaded = state

    def set_step_fraction(self, fraction):
        self.fraction = fraction

    def invalidate(self):
        pass


def test_sharded_steps_are_the_sources_steps_cut_and_its_state_is_the_sources():
    batch = pack([[[1, 2, 3, 4, 5, 6, 7], [8]]], seq_len=8)
    source = _Source(batch)
    steps = ShardedSteps(source, ContextRanks(2, 1))
    got = list(steps)
    assert [s.epoch for s in got] == [0.5, 1.0]
    assert all(s.batches[0].shard.index == 1 and s.batches[0].seq_len == 4 for s in got)
    assert source.closed  # the source's iterator is closed with this one (the loader's prefetch thread)
    assert steps.state_dict() == {"steps": 7} and steps.steps_per_epoch() == 2
    steps.load_state_dict({"steps": 3})
    steps.set_step_fraction(None)
    steps.max_epochs = 2.0
    assert source.loaded == {"steps": 3} and source.fraction is None and source.max_epochs == 2.0

"""Loader over a corpus larger than one shard: it reads the sharded plan row by row (``EpochRows``) and
hands out exactly the steps a loader over the whole, materialised plan hands out, on every rank."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support import random_store

from densebatch.data.load.collate import CausalCollator
from densebatch.data.load.loader import StepLoader
from densebatch.data.plan.planner import Plan, PlanSettings
from densebatch.data.plan.shards import EpochRows, plan_epoch_sharded
from densebatch.data.plan.steps import StepSettings
from densebatch.data.plan.store_epochs import materialise


class MaterialisedLoader(StepLoader):
    """The reference: the same loader holding the whole epoch's pieces (the sharded plan laid end to end)."""

    def plan(self, epoch):
        p = super().plan(epoch)
        return materialise(p.sharded) if isinstance(p, EpochRows) else p


def _pair(strategy, store, shard_docs=16, fraction=1.0, **steps):
    s = PlanSettings(
        strategy=strategy, seq_len=64, max_tokens_per_batch=128, rows_per_batch=4, mega_batch_mult=2, shard_docs=shard_docs
    )
    out = []
    for cls in (StepLoader, MaterialisedLoader):
        ld = cls(store, settings=s, collator=CausalCollator(pad_id=0), seed=5, steps=StepSettings(**steps), prefetch=0)
        ld.set_step_fraction(lambda step, f=fraction: f if step < 3 else 1.0)  # a ramp: the first steps are partial
        out.append(ld)
    return out


def _same_step(a, b):
    fields = ("input_ids", "labels", "positions")
    same = all(torch.equal(getattr(x, f), getattr(y, f)) for x, y in zip(a.batches, b.batches) for f in fields)
    return same and len(a.batches) == len(b.batches) and a.documents == b.documents and a.epoch == b.epoch


@pytest.mark.parametrize("strategy", ["packed", "token_budget", "random", "length_grouped"])
def test_the_loader_never_materialises_a_sharded_epoch_and_gives_the_same_steps(strategy):
    store = random_store(90)
    lazy, ref = _pair(strategy, store, grad_accum_batches=2)
    plan = lazy.plan(0)
    assert isinstance(plan, EpochRows) and plan.sharded.num_shards > 3
    assert isinstance(ref.plan(0), Plan)
    n = 2 * lazy.steps_per_epoch() + 2  # across an epoch boundary
    assert lazy.steps_per_epoch() == ref.steps_per_epoch()
    assert all(_same_step(a, b) for a, b in zip(itertools.islice(lazy, n), itertools.islice(ref, n), strict=True))
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(lazy.iter_epoch(1), ref.iter_epoch(1), strict=True))


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(
    strategy=st.sampled_from(["packed", "token_budget", "random"]),
    n=st.integers(20, 120),
    shard_docs=st.integers(4, 40),
    world=st.integers(1, 3),
    accum=st.integers(1, 3),
    fraction=st.sampled_from([0.3, 1.0, 1.7]),
    loss_tokens=st.sampled_from([None, 150]),
    seed=st.integers(0, 5),
)
def test_every_rank_gets_the_share_it_would_get_from_the_whole_plan(
    strategy, n, shard_docs, world, accum, fraction, loss_tokens, seed
):
    store = random_store(n, seed)
    for rank in range(world):
        steps = dict(world_size=world, rank=rank, grad_accum_batches=accum, loss_tokens_per_step=loss_tokens)
        lazy, ref = _pair(strategy, store, shard_docs, fraction, **steps)
        lazy.max_epochs = ref.max_epochs = 1.5
        got, want = list(lazy), list(ref)
        assert len(got) == len(want) and all(_same_step(a, b) for a, b in zip(got, want))


def test_rows_spanning_shards_are_the_materialised_rows():
    lengths = np.random.default_rng(0).integers(1, 300, 500)
    sharded = plan_epoch_sharded(
        lengths, settings=PlanSettings(strategy="packed", seq_len=128, max_tokens_per_batch=512, shard_docs=64), seed=1, epoch=0
    )
    rows, whole = EpochRows(sharded), materialise(sharded)
    assert np.array_equal(rows.batch_ptr, whole.batch_ptr) and rows.num_rows == whole.num_rows
    bounds = rows.shard_rows.tolist()
    for a, b in [(0, whole.num_rows), (bounds[1] - 2, bounds[3] + 1), (5, 5), (bounds[2], bounds[2] + 1)]:
        got, want = rows.rows(a, b), whole.rows(a, b)
        fields = ("doc", "start", "stop", "row_ptr")
        assert all(np.array_equal(getattr(got, f), getattr(want, f)) for f in fields), (a, b)
    with pytest.raises(IndexError):
        rows.rows(0, whole.num_rows + 1)
    assert dataclasses.is_dataclass(rows.rows(0, 3))

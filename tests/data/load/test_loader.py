"""Loader: exact resume (also across an epoch boundary and with prefetch), evaluation passes, errors."""

from __future__ import annotations

import itertools

import pytest
import torch
from support import random_store

from densebatch.data.load.collate import CausalCollator
from densebatch.data.load.loader import StepLoader
from densebatch.data.plan.planner import PlanSettings
from densebatch.data.plan.steps import StepSettings
from densebatch.errors import DataError


def _loader(prefetch, strategy="packed", seed=3, store=None, **steps):
    s = PlanSettings(strategy=strategy, seq_len=64, max_tokens_per_batch=128, rows_per_batch=4)
    return StepLoader(
        store or random_store(60),
        settings=s,
        collator=CausalCollator(pad_id=0),
        seed=seed,
        steps=StepSettings(**steps),
        prefetch=prefetch,
    )


def _same(a, b):
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("input_ids", "labels", "positions"))


def _same_step(a, b):
    return len(a.batches) == len(b.batches) and all(_same(x, y) for x, y in zip(a.batches, b.batches))


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("strategy", ["packed", "token_budget", "random"])
def test_resume_gives_exactly_the_next_step(prefetch, strategy):
    ref = _loader(prefetch, strategy, grad_accum_batches=2)
    n = ref.steps_per_epoch()
    stream = list(itertools.islice(iter(ref), 2 * n + 3))
    assert stream[n - 1].epoch == 1.0 and 1.0 < stream[n].epoch < 2.0  # steps end at the epoch's end
    for cut in (1, n - 1, n, n + 2):  # includes the epoch boundary
        a = _loader(prefetch, strategy, grad_accum_batches=2)
        it = iter(a)
        for _ in range(cut):
            next(it)
        state = a.state_dict()
        it.close()
        b = _loader(prefetch, strategy, grad_accum_batches=2)
        b.load_state_dict(state)
        got = list(itertools.islice(iter(b), 3))
        assert all(_same_step(x, y) for x, y in zip(got, stream[cut : cut + 3])), f"cut {cut}"
    assert ref.state_dict()["epoch"] == 2 and ref.state_dict()["steps"] == 2 * n + 3


def test_epochs_differ_and_iter_epoch_is_deterministic_and_stateless():
    a = _loader(2)
    e0 = list(a.iter_epoch(0))
    assert a.state_dict() == {"seed": 3, "epoch": 0, "row": 0, "steps": 0}
    assert all(_same(x, y) for x, y in zip(e0, a.iter_epoch(0)))
    assert len(e0) == a.batches_per_epoch
    e1 = list(a.iter_epoch(1))
    assert not all(_same(x, y) for x, y in zip(e0, e1))
    assert sum(b.num_real_tokens for b in e0) == int(a.store.lengths.sum())


def test_load_state_dict_restarts_a_running_iterator():
    a = _loader(2)
    it = iter(a)
    first = next(it)
    a.load_state_dict({"seed": 3, "epoch": 0, "row": 0, "steps": 0})
    assert next(it, None) is None  # the stale iterator stops
    assert _same_step(next(iter(a)), first)
    with pytest.raises(ValueError, match="seed"):
        a.load_state_dict({"seed": 4, "epoch": 0, "row": 0, "steps": 0})


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_batch_that_fails_names_its_documents(prefetch):
    store = random_store(60)
    store.tokens = store.tokens[:-3]  # a damaged store: the last document runs past the token array
    a = _loader(prefetch, "random", store=store)
    with pytest.raises(DataError, match=r"documents \[.*59\]\) could not be collated"):
        list(a.iter_epoch(0))


@pytest.mark.parametrize("strategy", ["token_budget", "random"])
def test_ranks_take_the_same_steps_and_together_see_every_token_once(strategy):
    store = random_store(60)
    loaders = [_loader(0, strategy, store=store, world_size=3, rank=r, grad_accum_batches=2) for r in range(3)]
    loaders[0].max_epochs = loaders[1].max_epochs = loaders[2].max_epochs = 1.0
    steps = [list(ld) for ld in loaders]
    assert len({len(s) for s in steps}) == 1
    for parts in zip(*steps):
        assert len({len(p.batches) for p in parts}) == 1  # idle shares are null batches
        assert len({p.documents for p in parts}) == 1 and len({p.epoch for p in parts}) == 1
    assert sum(b.num_real_tokens for s in steps for step in s for b in step.batches) == int(store.lengths.sum())
    one = _loader(0, strategy, store=store, grad_accum_batches=6)
    one.max_epochs = 1.0
    assert [s.documents for s in one] == [p.documents for p in steps[0]]  # 3 ranks x 2 = 1 rank x 6


def test_max_epochs_ends_the_iteration_inside_an_epoch():
    a = _loader(0, "random")
    a.max_epochs = 1.5
    steps = list(a)
    n = a.batches_per_epoch
    assert len(steps) == n + -(-n // 2) and 1.5 <= steps[-1].epoch < 1.5 + 1 / n  # ceil: never short of the limit


def _real(batches):
    return [b for b in batches if b.num_real_tokens]


@pytest.mark.parametrize("world", [2, 3])
def test_an_evaluation_cap_is_global_so_n_ranks_score_exactly_what_one_does(world):
    """eval.max_batches counts the plan's batches over all ranks: ranks together score the same batches as
    one process (each batch on one rank; the others padded with null batches, so every rank runs as many
    forward passes), never world x the cap."""
    one = list(_loader(0, "token_budget").iter_epoch(0, 5))
    assert len(one) == 5 and len(_real(one)) == 5
    ranks = [list(_loader(0, "token_budget", world_size=world, rank=r).iter_epoch(0, 5)) for r in range(world)]
    assert len({len(b) for b in ranks}) == 1  # as many passes on every rank
    got = sorted((b.input_ids.tolist() for r in ranks for b in _real(r)), key=str)
    assert got == sorted((b.input_ids.tolist() for b in one), key=str)
    everything = list(_loader(0, "token_budget").iter_epoch(0))
    assert len(everything) > 5 and all(_same(a, b) for a, b in zip(one, everything[:5]))


def test_eval_max_tokens_selects_the_same_documents_every_time_whatever_the_ranks():
    import numpy as np

    from densebatch.data.plan.store_epochs import eval_documents

    lengths = np.random.default_rng(0).integers(5, 400, 1000)
    docs = eval_documents(lengths, 20_000, seed=3)
    assert docs is not None and np.array_equal(docs, eval_documents(lengths, 20_000, seed=3))  # fixed by the seed
    assert (np.diff(docs) > 0).all() and 19_000 < lengths[docs].sum() <= 20_000  # store order, filled to the cap
    assert not np.array_equal(docs, eval_documents(lengths, 20_000, seed=4))
    assert eval_documents(lengths, int(lengths.sum()), seed=3) is None and eval_documents(lengths, None, 3) is None
    assert len(eval_documents(lengths, 1, seed=3)) == 1  # at least one document
    store = random_store(60)
    sub = store.subset(np.array([3, 7, 40]))
    assert len(sub) == 3 and all(
        np.array_equal(sub.document(i)[0], store.document(d)[0]) and np.array_equal(sub.document(i)[1], store.document(d)[1])
        for i, d in enumerate([3, 7, 40])
    )

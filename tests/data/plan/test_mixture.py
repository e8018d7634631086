"""Mixture selection: token shares per source, passes without repetition, determinism, through every planner."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from densebatch.data.plan.mixture import mixture_epoch, plan_source_stats, select_mixture
from densebatch.data.plan.planner import PlanSettings
from densebatch.data.plan.shards import plan_epoch_sharded
from densebatch.data.plan.strategies import STRATEGIES


def sources(n: int = 2000, k: int = 2, seed: int = 0, cap: int = 700) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.clip(rng.lognormal(np.log(150), 1.0, n).astype(np.int64), 1, cap) for _ in range(k)]


def counts(docs: np.ndarray, n: int) -> np.ndarray:
    return np.bincount(docs, minlength=n)


@pytest.mark.parametrize("shard_docs", [1 << 20, 700], ids=["one shard", "shards"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_weights_3_to_1_give_75_25_of_tokens_for_every_strategy(strategy, shard_docs):
    a, b = sources()
    sel = select_mixture([a, b], weights=[3, 1], seed=1, epoch=0, names=["a", "b"])
    s = PlanSettings(strategy=strategy, seq_len=512, max_tokens_per_batch=2048, shard_docs=shard_docs)
    plan = plan_epoch_sharded(np.concatenate([a, b]), settings=s, seed=1, epoch=0, selection=sel)
    shares = plan_source_stats(plan, sel)
    assert abs(shares["a"]["share"] - 0.75) <= 0.02 and abs(shares["b"]["share"] - 0.25) <= 0.02
    natural = plan_epoch_sharded(np.concatenate([a, b]), settings=s, seed=1, epoch=0)
    assert abs(plan.stats()["fill_rate"] - natural.stats()["fill_rate"]) <= 0.01, "the mixture keeps the fill rate"
    if shard_docs > len(a) * 2:  # one shard: the plan's pieces, summed here, agree with the index
        assert plan_source_stats(plan.shard(0), sel) == shares


def test_selection_shares_and_counts():
    a, b = sources()
    sel = select_mixture([a, b], weights=[3, 1], seed=1, epoch=0)
    tok = sel.source_tokens()
    assert abs(tok[0] / tok.sum() - 0.75) < 0.005 and tok.sum() == pytest.approx(a.sum() + b.sum(), rel=0.005)
    docs, src = mixture_epoch([a, b], [3, 1], 1, 0)
    assert np.array_equal(src, (docs >= len(a)).astype(np.int64))
    lengths = np.concatenate([a, b])
    assert np.array_equal(np.bincount(src, weights=lengths[docs]).astype(np.int64), tok)
    assert np.array_equal(np.bincount(src), sel.source_documents())
    assert sel.stats()["source0"]["tokens"] == tok[0]


def test_natural_weights_are_every_document_once_each_epoch():
    a, b = sources(300, seed=2)
    for w in (None, [int(a.sum()), int(b.sum())], [1, 1] if a.sum() == b.sum() else None):
        for epoch in (0, 5):
            docs, _ = mixture_epoch([a, b], w, 3, epoch)
            assert np.array_equal(np.sort(docs), np.arange(600))


def test_upsampled_source_repeats_whole_passes_then_samples_without_repetition():
    a, b = sources(400, seed=3)
    w = [1.5 * a.sum(), b.sum()]  # a at 1.5 passes per epoch, b at one (the epoch grows to hold both)
    per_epoch = [select_mixture([a, b], weights=w, seed=7, epoch=e, epoch_tokens=sum(w)).arrays()[0] for e in range(4)]
    c0 = counts(per_epoch[0][per_epoch[0] < 400], 400)
    assert c0.min() >= 1 and c0.max() <= 2, "one whole pass, then part of the next: nobody twice in the part"
    assert 0.3 < (c0 == 2).mean() < 0.7
    two = counts(np.concatenate(per_epoch[:2]), 800)[:400]
    assert (two == 3).all(), "two epochs at 1.5 passes: exactly three passes, every document three times"
    assert (counts(np.concatenate(per_epoch), 800)[400:] == 4).all()


def test_downsampled_source_covers_every_document_once_before_repeating():
    a, b = sources(500, seed=4)
    w = [0.5 * a.sum(), b.sum()]  # a at half a pass per epoch, b at one
    ep = [select_mixture([a, b], weights=w, seed=11, epoch=e, epoch_tokens=sum(w)).arrays()[0] for e in range(4)]
    first = [e[e < 500] for e in ep]
    assert len(np.intersect1d(first[0], first[1])) == 0, "no repeats inside a pass"
    assert (counts(np.concatenate(first[:2]), 500) == 1).all(), "two epochs at half a pass: every document once"
    assert (counts(np.concatenate(first), 500) == 2).all()
    assert not np.array_equal(np.sort(first[0]), np.sort(first[2])), "the next pass is another permutation"
    assert abs(a[first[0]].sum() - a.sum() / 2) <= a.max()


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(0, 60), min_size=1, max_size=4),
    st.lists(st.floats(0, 10), min_size=4, max_size=4),
    st.integers(0, 2**32),
    st.integers(0, 6),
)
def test_token_targets_hold_to_a_document_and_selection_is_deterministic(sizes, weights, seed, epoch):
    rng = np.random.default_rng(seed)
    src = [rng.integers(1, 50, n) for n in sizes]
    w = [wi if n else 0.0 for wi, n in zip(weights, sizes)]
    if sum(w) == 0:
        with pytest.raises(ValueError, match="weight"):
            select_mixture(src, weights=w, seed=seed, epoch=epoch)
        return
    sel = select_mixture(src, weights=w, seed=seed, epoch=epoch)
    total = sum(int(x.sum()) for x in src)
    target = np.array([total * wi / sum(w) for wi in w])
    assert (np.abs(sel.source_tokens() - target) <= 2 * 50 + 1).all()  # one document at each end of the window
    docs, source = sel.arrays()
    again, _ = select_mixture(src, weights=w, seed=seed, epoch=epoch).arrays()
    assert np.array_equal(docs, again)
    off = np.concatenate([[0], np.cumsum(sizes)])
    assert ((docs >= off[source]) & (docs < off[source + 1])).all()


def test_seed_changes_the_sample_and_bad_weights_are_value_errors():
    a, b = sources(300, seed=5)
    x, y = (mixture_epoch([a, b], [1, 3], s, 0)[0] for s in (0, 1))
    assert not np.array_equal(np.sort(x), np.sort(y))
    with pytest.raises(ValueError, match="weight must be"):
        select_mixture([a, b], weights=[1, -1], seed=0, epoch=0)
    with pytest.raises(ValueError, match="one per source"):
        select_mixture([a, b], weights=[1], seed=0, epoch=0)
    with pytest.raises(ValueError, match="no documents"):
        select_mixture([a, np.zeros(0, np.int64)], weights=[1, 1], seed=0, epoch=0)
    zero = select_mixture([a, b], weights=[1, 0], seed=0, epoch=0)
    assert zero.source_documents()[1] == 0
    assert abs(zero.source_tokens()[0] - (a.sum() + b.sum())) <= 700, "a alone fills the epoch (to a document)"


def test_epoch_tokens_sets_the_epoch_size():
    a, b = sources(300, seed=6)
    sel = select_mixture([a, b], weights=[1, 1], seed=0, epoch=0, epoch_tokens=10_000)
    assert abs(int(sel.source_tokens().sum()) - 10_000) <= 2 * 700

"""The strategies' rules beyond their planners (``data/plan/rules.py``): full-context evaluation never cuts a
document, the worst batch is the plan's largest, budget ranges and row lengths follow the strategy, and
settings a strategy cannot run are refused naming the key."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from densebatch.config import BatchingConfig
from densebatch.data.plan.planner import PlanSettings, plan_epoch
from densebatch.data.plan.rules import (
    budget_range,
    check_batching,
    full_context_settings,
    longest_train_row,
    loss_tokens_cut,
    sized_by_budget,
    truncation_cap,
    worst_batches,
)
from densebatch.data.plan.strategies import STRATEGIES
from densebatch.data.store.store import DocumentStore
from densebatch.errors import ConfigError

lengths_st = st.lists(st.integers(1, 300), min_size=1, max_size=60).map(lambda v: np.array(v, dtype=np.int64))


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_st, strategy=st.sampled_from(list(STRATEGIES)), seq_len=st.integers(8, 64), m=st.sampled_from([1, 8]))
def test_full_context_settings_never_split_or_truncate_a_document(lengths, strategy, seq_len, m):
    train = PlanSettings(strategy=strategy, seq_len=seq_len, max_tokens_per_batch=4 * -(-seq_len // m) * m, pad_to_multiple_of=m)
    plan = plan_epoch(lengths, settings=full_context_settings(train, int(lengths.max())), seed=0, epoch=0)
    assert len(plan.split) == len(plan.truncated) == len(plan.dropped) == 0
    assert sorted(plan.doc.tolist()) == list(range(len(lengths)))  # every document once, whole
    assert np.array_equal(plan.stop - plan.start, lengths[plan.doc])


@settings(max_examples=40, deadline=None)
@given(lengths=lengths_st, strategy=st.sampled_from(["token_budget", "packed"]), budget_rows=st.integers(1, 6))
def test_the_worst_batch_has_the_most_slots_of_the_plan(lengths, strategy, budget_rows):
    s = PlanSettings(strategy=strategy, seq_len=64, max_tokens_per_batch=64 * budget_rows + 320)
    (rows, first), *longest = worst_batches(lengths, s, seed=3)
    _, slots = plan_epoch(lengths, settings=s, seed=3, epoch=0).batch_stats()
    mine = len(rows) * max(sum(stop - start for _, start, stop in row) for row in rows)
    assert mine == slots.max()
    if strategy == "token_budget":  # the longest documents, as many as the budget holds
        (whole, _) = longest[0]
        assert [stop for ((_, _, stop),) in whole] == sorted(lengths.tolist(), reverse=True)[: len(whole)]


def test_longest_train_row_and_budget_range_follow_the_strategy():
    b = BatchingConfig(strategy="packed", seq_len=100, max_tokens_per_batch=400, pad_to_multiple_of=8)
    assert longest_train_row(b, 999) == (100, "batching.seq_len")
    assert budget_range(b, np.array([10, 20, 30])) == (104, 104, 104 * (60 // 104 + 0 + 2))
    b = BatchingConfig(strategy="token_budget", max_tokens_per_batch=256, long_docs="split")
    assert longest_train_row(b, 999) == (256, "data.max_seq_len")
    assert longest_train_row(BatchingConfig(strategy="token_budget", max_tokens_per_batch="auto"), 999) == (
        999,
        "data.max_seq_len",
    )
    assert budget_range(b, np.array([10, 20, 30])) == (1, 30, 90)
    assert longest_train_row(BatchingConfig(strategy="random"), 77) == (77, "data.max_seq_len")
    with pytest.raises(ConfigError, match="token_budget and packed"):
        budget_range(BatchingConfig(strategy="random"), np.array([5]))
    assert [sized_by_budget(s) for s in STRATEGIES] == [False, False, True, True]


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(strategy="packed", seq_len=256, max_tokens_per_batch=128), "batching.max_tokens_per_batch: expected at least"),
        (dict(strategy="length_grouped", max_tokens_per_batch="auto"), "auto sizes token_budget and packed"),
        (dict(strategy="packed", seq_len=100, max_tokens_per_batch=100, pad_to_multiple_of=64), "batching.max_tokens_per_batch"),
    ],
)
def test_settings_a_strategy_cannot_run_are_refused_naming_the_key(fields, match):
    with pytest.raises(ConfigError, match=match):
        check_batching(SimpleNamespace(**{**vars(BatchingConfig()), **fields}))
    check_batching(BatchingConfig(strategy="packed", seq_len=128, max_tokens_per_batch="auto"))  # auto: found later


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=30).map(lambda v: np.array(v, dtype=np.int64)),
    cap=st.integers(1, 45),
    seed=st.integers(0, 10),
)
def test_loss_tokens_cut_are_the_targets_in_the_truncated_tails(lengths, cap, seed):
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    mask = np.random.default_rng(seed).integers(0, 2, int(offsets[-1])).astype(np.uint8)
    expected = sum(int(mask[offsets[d] + cap : offsets[d + 1]].sum()) for d in range(len(lengths)) if lengths[d] > cap)
    store = DocumentStore(np.zeros(int(offsets[-1]), np.int32), offsets=offsets, loss_mask=mask, meta={})
    assert loss_tokens_cut(store, cap) == (expected, int((lengths > cap).sum()))


def test_truncation_cap_follows_the_strategy():
    assert truncation_cap(BatchingConfig(strategy="packed", seq_len=64, long_docs="truncate")) == (64, "batching.seq_len")
    assert truncation_cap(BatchingConfig(strategy="packed", seq_len=64, long_docs="split")) is None
    tb = BatchingConfig(strategy="token_budget", max_tokens_per_batch=100, pad_to_multiple_of=8, long_docs="truncate")
    assert truncation_cap(tb) == (96, "batching.max_tokens_per_batch")
    assert truncation_cap(BatchingConfig(strategy="token_budget", max_tokens_per_batch="auto", long_docs="truncate")) is None
    assert truncation_cap(BatchingConfig(strategy="random", long_docs="truncate")) is None

"""Step planning: steps decided globally, shared out to ranks, the same documents for N ranks x k as 1 x N·k."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from densebatch.data.plan.planner import PlanSettings, plan_epoch
from densebatch.data.plan.steps import StepSettings, cumulative_row_loss_tokens, micro_batches, share, step_stop
from densebatch.data.store.store import DocumentStore, document_loss_tokens


def _plan(lengths, strategy="token_budget", seed=0, **kw):
    s = PlanSettings(strategy=strategy, **{"max_tokens_per_batch": 64, "seq_len": 32, "rows_per_batch": 3, **kw})
    return plan_epoch(np.asarray(lengths), settings=s, seed=seed, epoch=0)


def _steps(plan, settings, fraction=1.0, cum=None, stop_row=None):
    row, out = 0, []
    end = plan.num_rows if stop_row is None else stop_row
    while row < end:
        stop = step_stop(plan, start=row, settings=settings, fraction=fraction, cum_tokens=cum, stop_row=stop_row)
        out.append((row, stop))
        row = stop
    return out


lengths_st = st.lists(st.integers(1, 90), min_size=1, max_size=60)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(
    lengths=lengths_st,
    world=st.integers(1, 5),
    accum=st.integers(1, 3),
    strategy=st.sampled_from(["random", "token_budget", "packed"]),
)
@example(lengths=[5], world=4, accum=1, strategy="random")  # one document, four ranks: three idle
@example(lengths=[40, 40, 40, 1], world=3, accum=2, strategy="packed")
def test_every_row_once_and_n_ranks_equal_one_rank_with_n_times_the_accumulation(lengths, world, accum, strategy):
    plan = _plan(lengths, strategy)
    many = StepSettings(grad_accum_batches=accum, world_size=world)
    one = StepSettings(grad_accum_batches=world * accum)
    steps = _steps(plan, many)
    assert steps == _steps(plan, one)  # the same rows in every step
    seen = []
    for start, stop in steps:
        shares = [share(plan, start=start, stop=stop, rank=r, world_size=world) for r in range(world)]
        rows = [int(x) for s in shares for part in s for x in part]
        assert sorted(rows) == list(range(start, stop))  # the step's rows, each on exactly one rank
        seen += rows
        bounds = set(plan.batch_ptr.tolist())
        for s in shares:
            for part in s:  # a share never mixes two planned batches: it stays within one budget
                b = int(np.searchsorted(plan.batch_ptr, part[0], side="right")) - 1
                assert part[-1] < plan.batch_ptr[b + 1] and len(part) > 0
        if stop - start >= world and len(micro_batches(plan, start, stop)) < world:
            assert all(shares), "enough rows for every rank, yet one idles"
        assert start in bounds and (stop in bounds or stop == plan.num_rows)  # full steps keep whole batches
    assert sorted(seen) == list(range(plan.num_rows))


def test_a_full_step_is_world_times_accum_batches():
    plan = _plan(np.arange(1, 41) % 17 + 3, "random", rows_per_batch=2)  # 20 batches of 2 rows
    steps = _steps(plan, StepSettings(grad_accum_batches=3, world_size=2))
    assert [b - a for a, b in steps] == [12, 12, 12, 4]  # 6 batches a step; the epoch's last is short
    assert [len(share(plan, start=36, stop=40, rank=r, world_size=2)) for r in range(2)] == [1, 1]


def test_token_driven_steps_take_the_whole_batches_nearest_the_target_on_every_rank():
    lengths = [9, 3, 17, 5, 30, 2, 2, 8, 11, 6] * 3
    plan = _plan(lengths, "random", rows_per_batch=2)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    cum = _cum(plan, offsets, np.ones(offsets[-1], np.uint8))
    assert cum[-1] == sum(L - 1 for L in lengths)  # every token but the first of each document
    s = StepSettings(loss_tokens_per_step=40, world_size=3)
    steps = _steps(plan, s, cum=cum)
    ptr = plan.batch_ptr.tolist()
    held_back = 0
    for a, b in steps[:-1]:
        assert b in set(ptr)
        miss = abs(cum[b] - cum[a] - 40)
        less, more = ptr[ptr.index(b) - 1], ptr[ptr.index(b) + 1]
        assert less == a or miss <= abs(cum[less] - cum[a] - 40)  # one batch fewer is no nearer
        assert miss < abs(cum[more] - cum[a] - 40)  # one batch more is farther
        held_back += cum[b] - cum[a] < 40
    assert held_back  # some steps stop short of the target, when the next batch would overshoot it more
    got = [cum[b] - cum[a] for a, b in steps[:-1]]
    assert abs(np.mean(got) - 40) < 0.25 * 40, got  # on average, steps hold the target
    assert steps == _steps(plan, StepSettings(loss_tokens_per_step=40, world_size=1), cum=cum)


def test_row_loss_tokens_count_targets_as_the_collator_labels_them():
    """A split document keeps the target at every cut: 10 tokens split 4/4/2 carry 9 targets, not 7."""
    plan = _plan([10], "packed", seq_len=4, max_tokens_per_batch=4)
    offsets = np.array([0, 10])
    cum = _cum(plan, offsets, np.ones(10, np.uint8))
    assert plan.num_rows == 3 and cum[-1] == 9


def _cum(plan, offsets, mask, rate=None):
    return cumulative_row_loss_tokens(
        plan, DocumentStore(np.zeros(len(mask), np.int32), offsets=offsets, loss_mask=mask, meta={}), rate
    )


def _reference(plan, offsets, mask):
    """The loss tokens of each row's pieces, counted target by target as the causal collator labels them."""
    per_row = []
    for r in range(plan.num_rows):
        n = 0
        for p in range(plan.row_ptr[r], plan.row_ptr[r + 1]):
            d, a, b = int(plan.doc[p]), int(plan.start[p]), int(plan.stop[p])
            length = offsets[d + 1] - offsets[d]
            n += int(mask[offsets[d] + a + 1 : offsets[d] + min(b + 1, length)].sum())
        per_row.append(n)
    return np.concatenate([[0], np.cumsum(per_row)])


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    lengths=st.lists(st.integers(1, 70), min_size=1, max_size=40),
    strategy=st.sampled_from(["random", "token_budget", "packed", "length_grouped"]),
    density=st.floats(0.0, 1.0),
    window=st.sampled_from([8, 64, 1 << 22]),
    seed=st.integers(0, 3),
)
def test_row_loss_tokens_from_per_document_counts_equal_the_token_by_token_count(lengths, strategy, density, window, seed):
    """Whole documents counted from their per-document totals, split ones from the mask read window by
    window (windows of 8 and 64 tokens cut documents and pieces): the same prefix sums as counting every
    target, for every strategy, so step boundaries are today's."""
    import densebatch.data.plan.steps as steps_mod
    import densebatch.data.store.store_io as store_mod

    plan = _plan(lengths, strategy, seed=seed, seq_len=24, max_tokens_per_batch=48)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    mask = (np.random.default_rng(seed).random(offsets[-1]) < density).astype(np.uint8)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(steps_mod, "WINDOW_TOKENS", window)
        m.setattr(store_mod, "WINDOW_TOKENS", window)
        assert np.array_equal(_cum(plan, offsets, mask), _reference(plan, offsets, mask))
        doc_loss = document_loss_tokens(offsets, mask)
    assert doc_loss.dtype == np.uint32 and [int(x) for x in doc_loss] == [
        int(mask[offsets[d] + 1 : offsets[d + 1]].sum()) for d in range(len(lengths))
    ]
    rated = _cum(plan, offsets, mask, rate=0.25)  # masked-LM: each target position counts its expected share
    assert np.allclose(rated, _reference(plan, offsets, np.ones_like(mask)) * 0.25)


def test_fractional_steps_take_a_share_of_a_batch_and_resume_inside_it():
    plan = _plan([32] * 16, "packed", seq_len=32, max_tokens_per_batch=256)  # 2 batches of 8 rows
    s = StepSettings()
    assert step_stop(plan, start=0, settings=s, fraction=0.25) == 2
    assert step_stop(plan, start=2, settings=s, fraction=0.25) == 4  # continues inside the batch
    assert step_stop(plan, start=2, settings=s, fraction=1.0) == 8  # a full step inside a batch: its rest (0.75 of a batch) ...
    assert step_stop(plan, start=6, settings=s, fraction=1.0) == 16  # ... or its rest and the next batch (1.25), nearest to 1
    assert step_stop(plan, start=7, settings=s, fraction=0.01) == 8  # at least one row
    steps = _steps(plan, StepSettings(grad_accum_batches=2), fraction=0.5)
    assert steps == [(0, 8), (8, 16)]
    assert step_stop(plan, start=0, settings=s, fraction=2.0) == 16  # a step grown past the target takes whole batches


def test_stop_row_cuts_the_epoch():
    plan = _plan(np.full(20, 10), "random", rows_per_batch=2)
    assert _steps(plan, StepSettings(grad_accum_batches=3), stop_row=8) == [(0, 6), (6, 8)]


def test_bad_arguments():
    plan = _plan([5, 6])
    with pytest.raises(ValueError, match="past the end"):
        step_stop(plan, start=plan.num_rows, settings=StepSettings())
    with pytest.raises(ValueError, match="fraction"):
        step_stop(plan, start=0, settings=StepSettings(), fraction=0.0)
    with pytest.raises(ValueError):
        StepSettings(world_size=2, rank=2)


def test_plan_settings_take_every_field_from_the_config():
    """A config field renamed or added without the planner knowing fails here, not silently."""
    from dataclasses import fields

    from densebatch.config import BatchingConfig

    cfg = BatchingConfig(strategy="token_budget", rows_per_batch=3, max_tokens_per_batch=999, seq_len=77, long_docs="truncate",
                         pad_to_multiple_of=7, mega_batch_mult=5, drop_last=True, shard_docs=1234)  # fmt: skip
    settings = PlanSettings.from_config(cfg)
    for f in fields(PlanSettings):
        assert getattr(settings, f.name) == getattr(cfg, f.name), f.name

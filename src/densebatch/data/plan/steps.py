"""Step planning: cut an epoch's global plan into optimizer steps and share each step out to the ranks.

numpy only, pure functions of the epoch's ``Plan`` (planned for all ranks at once), the settings and
a position; every rank computes the same boundaries, so no rank decides alone when a step, an epoch
or a run ends. A step is a range of the plan's rows ``[start, stop)``::

    plan rows      r0 r1 r2 r3 | r4 r5 | r6 r7 r8 | r9      (| = planned batch boundaries)
    step 0         r0 ......................... r5           2 batches (world 2, grad_accum_batches 1)
      rank 0       batch r0-r3                               one planned batch each
      rank 1       batch r4-r5
    step 1         r6 ......... r9                           the epoch's last step: 2 batches again
    a ramped step  r6 r7                                     fraction 0.25 of 8 batches = 2 rows

- A full step (``fraction`` 1) with fixed accumulation is ``world_size × grad_accum_batches``
  consecutive planned batches; N ranks with k batches each therefore consume, per step, exactly
  the documents one rank with N·k consumes. With ``loss_tokens_per_step`` a step takes whole
  batches, as many as bring the global count of loss tokens nearest the target (at least one), so
  that steps hold the target on average whatever the batches' size.
- ``fraction`` (a batch-size ramp, back-off or growth) scales the step; below one batch the step
  takes a share of a batch's rows, so it can start and end inside a planned batch; at 1 and above
  steps take whole batches. A full step that
  starts inside a batch takes the rest of it and the whole batches that bring it nearest to
  ``world_size × grad_accum_batches``, so full steps are back on batch boundaries at once.
- A step never crosses the end of an epoch (the last step of an epoch may be smaller) nor
  ``stop_row`` (a fractional ``max_epochs``).
- Sharing: the step's micro-batches (its rows cut at planned batch boundaries) are dealt round
  robin; when there are fewer micro-batches than ranks, rows are split so every rank gets some if
  there are enough rows (heaviest batches first, rows dealt longest first); each share stays
  within its planned batch's budget. Ranks whose share is shorter are padded by the loader with
  null batches, so every rank runs the same number of forward/backward passes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from densebatch.data.plan.plan import Plan
from densebatch.data.store.store import WINDOW_TOKENS, read_ranges, take


@dataclass(frozen=True)
class StepSettings:
    """How many planned batches make an optimizer step, and who computes them."""

    grad_accum_batches: int = 1  # per rank: a step is world_size × this many planned batches
    loss_tokens_per_step: int | None = None  # global target; when set, it decides instead
    world_size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        if self.grad_accum_batches < 1 or self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"StepSettings: invalid {self}")
        if self.loss_tokens_per_step is not None and self.loss_tokens_per_step < 1:
            raise ValueError(f"loss_tokens_per_step: expected a positive integer; got {self.loss_tokens_per_step}")

    @property
    def batches_per_step(self) -> int:
        """Planned batches in a full step, over all ranks."""
        return self.world_size * self.grad_accum_batches


def cumulative_row_loss_tokens(plan: Plan, store, rate: float | None = None) -> np.ndarray:
    """Prefix sums of the loss tokens per row of ``plan``: ``out[i]`` = loss tokens of rows ``[0, i)``.

    A piece ``(doc, start, stop)`` has targets at tokens ``start + 1`` up to ``stop`` of its document (the
    last one only when the document continues past the piece), each counted where the loss mask is 1,
    exactly as the causal collator labels them. A whole document counts its ``store.doc_loss_tokens``
    (4 bytes a document, written at prepare time, read by ``take``); only the pieces of split
    documents read the mask, window by window, so memory grows with the plan, never with the tokens.
    ``rate`` (masked-LM): every target position counts ``rate`` (the expected share masked).
    """
    if hasattr(plan, "shard_plans"):  # an ``EpochRows``: shard by shard, never every piece at once
        out = np.zeros(plan.num_rows + 1, np.float64 if rate is not None else np.int64)  # filled in place: one copy
        at = 0
        for part in plan.shard_plans():
            c = cumulative_row_loss_tokens(part, store, rate)
            out[at + 1 : at + len(c)] = c[1:] + out[at]
            at += len(c) - 1
        assert at == plan.num_rows, "the shards' rows are the epoch's"
        return out
    doc = plan.doc
    doc_first, doc_len = store.doc_spans(doc)
    first = doc_first + plan.start + 1
    last = doc_first + np.minimum(plan.stop + 1, doc_len)  # exclusive
    if rate is not None:
        per = (last - first) * float(rate)
    else:
        whole = (plan.start == 0) & (plan.stop >= doc_len)
        per = np.where(whole, take(store.doc_loss_tokens, doc), 0).astype(np.int64)
        _add_split_pieces(per, idx=np.flatnonzero(~whole), first=first, last=last, loss_mask=store.loss_mask)
    return np.concatenate([[0], np.cumsum(per)])[plan.row_ptr]


def _add_split_pieces(per: np.ndarray, *, idx: np.ndarray, first: np.ndarray, last: np.ndarray, loss_mask) -> None:
    """``per[idx]`` = the mask's ones in ``[first, last)`` of each of those pieces: only their ranges are read
    (``read_ranges``, in token order), at most about ``WINDOW_TOKENS`` of them at a time."""
    if not len(idx):
        return
    idx = idx[np.argsort(first[idx], kind="stable")]
    f = first[idx]
    n = np.maximum(last[idx] - f, 0)
    ends = np.cumsum(n)
    i = 0
    while i < len(idx):
        j = max(i + 1, int(np.searchsorted(ends, ends[i] - n[i] + WINDOW_TOKENS, side="right")))
        c = np.concatenate([[0], np.cumsum(read_ranges(loss_mask, f[i:j], f[i:j] + n[i:j]), dtype=np.int64)])
        stop = np.cumsum(n[i:j])
        per[idx[i:j]] = c[stop] - c[stop - n[i:j]]
        i = j


def step_stop(
    plan: Plan,
    *,
    start: int,
    settings: StepSettings,
    fraction: float = 1.0,
    cum_tokens: np.ndarray | None = None,
    stop_row: int | None = None,
) -> int:
    """The row where the step that begins at row ``start`` ends (exclusive).

    ``cum_tokens`` (``cumulative_row_loss_tokens``) is needed when ``loss_tokens_per_step`` is set.
    Always at least one row; never past ``stop_row`` or the epoch's last row. O(batches in the step).
    """
    ptr = plan.batch_ptr
    end = min(plan.num_rows, stop_row if stop_row is not None else plan.num_rows)
    if start >= end:
        raise ValueError(f"step_stop: start row {start} is at or past the end ({end})")
    if not fraction > 0.0:
        raise ValueError(f"fraction: expected a positive number; got {fraction}")
    b = int(np.searchsorted(ptr, start, side="right")) - 1  # the batch holding row `start`
    if settings.loss_tokens_per_step is not None:
        assert cum_tokens is not None, "loss_tokens_per_step needs the loss tokens of every row"
        target = cum_tokens[start] + fraction * settings.loss_tokens_per_step
        # first row whose inclusion reaches the target (rows [start, r] hold >= target tokens); an integer
        # key for integer counts: a float one would convert the whole epoch's array at every step
        key = math.ceil(target) if np.issubdtype(cum_tokens.dtype, np.integer) else target
        r = min(end, int(cum_tokens.searchsorted(cum_tokens.dtype.type(key), side="left")))  # cum_tokens[r] >= target
        if fraction < 1.0:  # a ramped step: rows until the target, whatever the batches
            return max(r, start + 1)
        # whole batches (the first may be the rest of one a ramped step began): as many as bring the
        # step's loss tokens nearest the target, at least one
        last = max(r, start + 1) - 1  # the row that reaches it
        over = int(min(end, ptr[int(np.searchsorted(ptr, last, side="right"))]))  # the batch end at or past it
        under = int(ptr[int(np.searchsorted(ptr, over, side="left")) - 1])  # the batch end before that one
        if under > start and target - cum_tokens[under] < cum_tokens[over] - target:
            return under
        return over
    nb = plan.num_batches
    rest = (min(ptr[b + 1], end) - start) / (ptr[b + 1] - ptr[b])  # share of batch b still to take
    if fraction >= 1.0:  # a full (or larger) step ends on a batch boundary: the rest of b, then whole batches
        extra = max(0, math.floor(fraction * settings.batches_per_step - rest + 0.5))
        return int(min(end, ptr[min(nb, b + 1 + extra)]))
    units = fraction * settings.batches_per_step  # planned batches this step should hold
    row = start
    while row < end and units > 1e-9:
        batch_rows = int(ptr[b + 1] - ptr[b])
        left = int(min(ptr[b + 1], end) - row)
        whole = left / batch_rows  # what the rest of this batch counts for
        if units >= whole - 1e-9:
            row, units, b = row + left, units - whole, b + 1
        else:
            take = max(1 if row == start else 0, int(round(units * batch_rows)))
            row += min(take, left)
            break
    return max(row, start + 1)


def micro_batches(plan: Plan, start: int, stop: int) -> list[tuple[int, int]]:
    """The step's rows ``[start, stop)`` cut at planned batch boundaries: ``(first row, end row)`` each."""
    ptr = plan.batch_ptr
    b0 = int(np.searchsorted(ptr, start, side="right")) - 1
    b1 = int(np.searchsorted(ptr, stop, side="left"))
    return [(max(start, int(ptr[b])), min(stop, int(ptr[b + 1]))) for b in range(b0, b1)]


def share(plan: Plan, *, start: int, stop: int, rank: int, world_size: int) -> list[np.ndarray]:
    """This rank's share of the step ``[start, stop)``: a list of row-index arrays, one per batch.

    Every rank gets ``ceil(micro-batches / world_size)`` or fewer entries (the loader pads with null
    batches); with fewer micro-batches than ranks, rows are split so as few ranks as possible idle.
    """
    parts = micro_batches(plan, start, stop)
    if len(parts) >= world_size or world_size == 1:
        return [np.arange(a, b, dtype=np.int64) for a, b in parts[rank::world_size]]
    lengths = _row_lengths(plan, parts[0][0], parts[-1][1])  # rows [start, stop)
    parts_local = [(a - start, b - start) for a, b in parts]
    slots = [(b - a) * int(lengths[a:b].max()) for a, b in parts_local]
    shares = [1] * len(parts)
    for _ in range(world_size - len(parts)):  # spare ranks go to the heaviest batches first
        cand = [i for i, (a, b) in enumerate(parts) if shares[i] < b - a]
        if not cand:
            break
        i = max(cand, key=lambda i: (slots[i] / shares[i], -i))
        shares[i] += 1
    dealt: list[np.ndarray] = []
    for (a, b), k in zip(parts_local, shares):
        rows = np.arange(a, b, dtype=np.int64) + start
        rows = rows[np.argsort(-lengths[a:b], kind="stable")]  # longest first, dealt round robin
        dealt.extend(np.sort(rows[j::k]) for j in range(k))
    return [dealt[rank]] if rank < len(dealt) else []


def _segment_sum(x: np.ndarray, ptr: np.ndarray) -> np.ndarray:
    c = np.concatenate([[0], np.cumsum(x, dtype=np.int64)])
    return c[ptr[1:]] - c[ptr[:-1]]


def _row_lengths(plan: Plan, a: int, b: int) -> np.ndarray:
    """Real tokens of rows ``[a, b)``."""
    seg = plan.rows(a, b)
    return _segment_sum(seg.stop - seg.start, seg.row_ptr)


def step_documents(plan: Plan, start: int, stop: int) -> np.ndarray:
    """Sorted unique document indices of the step's rows (all ranks)."""
    return np.unique(plan.rows(start, stop).doc)


def rows_of(plan: Plan, rows: np.ndarray) -> list[list[tuple[int, int, int]]]:
    """The pieces ``(doc, start, stop)`` of each of ``rows`` (ascending), as the collators take them."""
    if len(rows) == 0:
        return []
    first = int(rows[0])
    seg = plan.rows(first, int(rows[-1]) + 1)  # a ``Plan`` or an ``EpochRows``: only these rows' pieces
    out = []
    for r in (rows - first).tolist():
        p0, p1 = int(seg.row_ptr[r]), int(seg.row_ptr[r + 1])
        out.append(list(zip(seg.doc[p0:p1].tolist(), seg.start[p0:p1].tolist(), seg.stop[p0:p1].tolist())))
    return out

"""Rows cut over context ranks: a batch as one rank's columns, and a source of steps whose batches come cut.

``shard_batch`` keeps the columns ``batch.shard_columns(T, N, index)`` of every row (a head and a tail chunk
of 2N, so that every rank holds as many early as late tokens of the rows) with their true positions, labels
and sources, and what the model needs to attend across the ranks (``Batch.shard``: the whole rows'
positions and segment bounds, this rank's place, the ranks' group). Its counts are its own: loss tokens
exactly (the step's denominator, all-reduced over every rank as always, is then the step's loss tokens, since
the context ranks hold disjoint targets), real tokens as an exact share of the batch's (the collator does not
say which columns hold padding; summed over the context ranks, the batch's count). Rows whose length 2N does
not divide (a rank's null batch of one token, a short last batch, an evaluation row as long as its longest
document) first get a run of padding at their end: one more segment, no targets, so every loss and gradient
is unchanged. Training rows of a fixed length (``batching.seq_len``) not divisible by 2N are refused up front.

``ShardedSteps`` wraps the trainer's source of steps (the data layer's loader, planned over the data ranks
alone): the same steps, state and position, with every batch cut for this rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import torch

from densebatch.batch import IGNORE_INDEX, Batch, RowShard, Step, segment_bounds, shard_columns
from densebatch.train.contracts import StepFraction, StepSource
from densebatch.train.parallel.mesh import ContextRanks


def pad_columns(batch: Batch, multiple: int) -> Batch:
    """``batch`` with a run of padding after every row (one more segment, no targets) up to a multiple of
    ``multiple`` columns; ``batch`` itself when it is one already. Host tensors (a collated batch)."""
    rows, T = batch.num_rows, batch.seq_len
    k = -T % multiple
    if k == 0:
        return batch

    def widen(x: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, fill.to(x.dtype).expand(rows, k)], dim=1)  # (rows, T + k)

    positions = widen(batch.positions, torch.arange(k, device=batch.positions.device))
    cu, longest = segment_bounds(positions)
    return replace(
        batch,
        input_ids=widen(batch.input_ids, batch.input_ids[:, -1:]),  # any id: its own segment, no target
        labels=widen(batch.labels, torch.tensor(IGNORE_INDEX, device=batch.labels.device)),
        positions=positions,
        source_ids=None
        if batch.source_ids is None
        else widen(batch.source_ids, torch.tensor(-1, device=batch.source_ids.device)),
        max_position=None if batch.max_position is None else max(batch.max_position, k - 1),
        cu_seqlens=cu,
        max_seqlen=longest,
    )


def real_share(total: int, degree: int, index: int) -> int:
    """Context rank ``index``'s share of ``total`` real tokens: the shares of the ``degree`` ranks sum to it."""
    return total * (index + 1) // degree - total * index // degree


def shard_batch(batch: Batch, ranks: ContextRanks) -> Batch:
    """``batch`` (host tensors, whole rows) as context rank ``ranks.index``'s columns; itself when the rows are
    not split, or when it already is a shard."""
    if not ranks.split or batch.shard is not None:
        return batch
    N = ranks.degree
    batch = pad_columns(batch, 2 * N)
    cols = shard_columns(batch.seq_len, N, ranks.index).to(batch.input_ids.device)  # (T / N,)
    labels = batch.labels.index_select(1, cols)  # (rows, T / N)
    whole = RowShard(ranks.index, N, batch.positions, batch.cu_seqlens, batch.max_seqlen, ranks.group)
    if whole.cu_seqlens is None:  # a batch built by hand: the bounds from its positions (host)
        whole = replace(whole, **dict(zip(("cu_seqlens", "max_seqlen"), segment_bounds(batch.positions))))
    out = replace(
        batch,
        input_ids=batch.input_ids.index_select(1, cols),
        labels=labels,
        positions=batch.positions.index_select(1, cols),
        num_loss_tokens=int((labels != IGNORE_INDEX).sum()),
        num_real_tokens=real_share(batch.num_real_tokens, N, ranks.index),
        # a property of the whole rows, which a model could not tell from one rank's columns: unknown is False
        # (the document-masked plan, always exact)
        single_doc_rows=bool(batch.single_doc_rows),
        source_ids=None if batch.source_ids is None else batch.source_ids.index_select(1, cols),
        cu_seqlens=None,  # this rank's columns are no rows of their own: attention plans from the whole rows'
        max_seqlen=None,
        shard=whole,
    )
    return out.pin_memory() if batch.input_ids.is_pinned() else out  # copied to the device as the loader's are


class ShardedSteps:
    """``source``'s steps with every batch cut for this context rank (``shard_batch``); everything else (state,
    position, step sizes) is ``source``'s own, so a checkpoint of it is the loader's, on any mesh."""

    def __init__(self, source: StepSource, ranks: ContextRanks) -> None:
        self.source = source
        self.ranks = ranks

    def __iter__(self) -> Iterator[Step]:
        it = iter(self.source)
        try:
            for step in it:
                yield replace(step, batches=tuple(shard_batch(b, self.ranks) for b in step.batches))
        finally:  # closing this generator stops the loader's prefetch thread
            close = getattr(it, "close", None)
            if close is not None:
                close()

    @property
    def max_epochs(self) -> float | None:
        return self.source.max_epochs

    @max_epochs.setter
    def max_epochs(self, value: float | None) -> None:
        self.source.max_epochs = value

    def steps_per_epoch(self) -> int | None:
        return self.source.steps_per_epoch()

    def state_dict(self) -> dict:
        return self.source.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.source.load_state_dict(state)

    @property
    def step_fraction(self) -> StepFraction | None:
        return self.source.step_fraction

    def set_step_fraction(self, fraction: StepFraction | None) -> None:
        self.source.set_step_fraction(fraction)

    @property
    def loss_tokens_per_step(self) -> int | None:
        return self.source.loss_tokens_per_step

    def invalidate(self) -> None:
        self.source.invalidate()

"""The forward and backward passes of one step, with out-of-memory isolation: a batch that does not fit is split by rows.

``accumulate`` (called by ``Trainer.forward_backward``) runs each batch of a step; when one raises an
out-of-memory error it is cut into two batches of consecutive rows (``split_rows``) and the halves run
in its place, recursively, within the same optimizer step. An error in a forward pass leaves the
gradients untouched, so the halves simply follow; one in a backward pass may have added part of the
batch's gradient already, so the step's gradients are zeroed and its passes replayed, with the
pieces found so far. The loss of every piece is still divided by the loss tokens of the
whole step, so the step's gradient is the unsplit one (up to float summation order). Only a single
row that does not fit stops the run (``RowTooLarge``, a ``UserError``), naming its documents.

What can be caught: on CUDA (and MPS) the caching allocator raises ``torch.OutOfMemoryError`` before
anything is written, reliably. On CPU the allocator raises a ``RuntimeError`` ("can't allocate
memory") only when ``malloc`` itself fails, which under Linux's default overcommit happens for
absurd sizes or under ``ulimit -v``; an ordinary overrun is met by the kernel's OOM killer, which no
process can catch. That is why CPU runs size their budget beforehand (``train/finders/budget_finder.py``).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from densebatch.batch import IGNORE_INDEX, Batch
from densebatch.errors import UserError
from densebatch.train.distributed import Distributed
from densebatch.train.per_source import SourceLosses, SourceWeights, weighted_losses
from densebatch.train.precision import autocast, to_device


class RowTooLarge(UserError):
    """One row does not fit in memory even alone: nothing left to split."""


def is_out_of_memory(exc: BaseException) -> bool:
    """True for an allocator's out-of-memory failure (CUDA / MPS ``OutOfMemoryError``, CPU ``malloc``)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc)
        return "can't allocate memory" in text or "out of memory" in text.lower()
    return False


def free_memory(device: torch.device, collect: bool = True) -> None:
    """Give back what a failed pass left: its tensors die with the traceback; the CUDA cache is emptied
    (on CPU, glibc's free lists are trimmed) so the next pass starts from the memory actually in use.
    ``collect``: also run the garbage collector (reference cycles through a traceback's frames; it
    takes ~0.1-1 s with torch's objects loaded, so only after an error)."""
    if collect:
        gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif _LIBC is not None:
        _LIBC.malloc_trim(0)  # freed heap pages back to the kernel: the resident set is what is live


def _libc():
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 - glibc only
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


def split_rows(batch: Batch) -> list[Batch]:
    """``batch`` as two batches of consecutive rows (the first takes the extra row when odd).

    Counts are exact where the model reads them (``num_loss_tokens`` sizes the fused loss head's
    gather; ``max_position`` the position check). ``single_doc_rows`` stays true for a subset of rows
    that all hold one document; unknown becomes False (the document-masked path, always exact).
    ``num_real_tokens`` is the rows' share of the parent's: the trainer counts tokens per unsplit
    batch, and a piece is never a null batch. ``documents`` stay the parent's (a superset).
    """
    rows = batch.num_rows
    if rows < 2:
        raise RowTooLarge(describe_row(batch))
    half = (rows + 1) // 2
    out = []
    for a, b in ((0, half), (half, rows)):
        labels = batch.labels[a:b]  # (b - a, T)
        out.append(
            replace(
                batch,
                input_ids=batch.input_ids[a:b],
                labels=labels,
                positions=batch.positions[a:b],
                num_loss_tokens=int((labels != IGNORE_INDEX).sum()),
                num_real_tokens=max(1, round(batch.num_real_tokens * (b - a) / rows)),
                single_doc_rows=bool(batch.single_doc_rows),
                max_position=int(batch.positions[a:b].max()),
                source_ids=None if batch.source_ids is None else batch.source_ids[a:b],
                pairs=None if batch.pairs is None else batch.pairs.row_slice(a, b),  # a pair lies in one row
                cu_seqlens=None,  # the halves' bounds are found from their positions
                max_seqlen=None,
            )
        )
    return out


def describe_row(batch: Batch) -> str:
    """The one-line error for a single row that runs out of memory alone."""
    docs = list(batch.documents)
    if len(docs) == 1:
        which = f"document {docs[0]}"
    elif docs:
        which = f"a row of the batch of documents {docs}"
    else:
        which = "a row"
    return (
        f"out of memory on a single row of {batch.seq_len} tokens ({which}, {batch.num_loss_tokens} loss tokens) even "
        f"alone: lower data.max_seq_len (or batching.seq_len for packed rows), or set model.gradient_checkpointing=true"
    )


def refuse_distributed(batch: Batch, rank: int) -> UserError:
    """Under torchrun a rank cannot split alone: DDP reduces gradients in the last backward of a step
    and FSDP all-gathers in every forward, so every rank must make the same passes; an out-of-memory
    error mid-pass has already left the collectives out of step. Stop with a message that says what to set."""
    return UserError(
        f"out of memory on rank {rank} in a batch of {batch.num_rows} rows x {batch.seq_len} tokens: under torchrun "
        f"batches are not split (every rank must run the same forward and backward passes); lower "
        f"batching.max_tokens_per_batch, or set it to auto to fit the budget to each rank's memory"
    )


@dataclass
class _Stage:
    backward: bool = False  # the pass reached backward: an error from here may leave partial gradients


@dataclass
class OOMLog:
    """Whether the run already printed its first out-of-memory split (it is printed once)."""

    printed: bool = False


@dataclass
class Passes:
    """What the forward and backward passes of one step use, handed over by the trainer."""

    forward: Callable[[Batch], Tensor]  # the training module: TokenLosses(model) or its DDP / FSDP wrapper
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    device: torch.device
    precision: str
    dist: Distributed
    sync: Callable[[bool], AbstractContextManager]  # gradients reduced over ranks on the last pass only
    source_losses: SourceLosses | None  # per-source loss sums and loss tokens of the step, accumulated here
    console: Any  # .message(text)
    oom: OOMLog
    source_weights: SourceWeights | None = None  # each source's weight of its loss tokens (None: all alike)
    # An objective's pass (train/objectives/steps.py): batch on the device -> (its share of the step's loss, to
    # back-propagate as it is; what the pass reports, summed over the step's passes); None: the summed CE / denom
    loss_of: Callable[[Batch], tuple[Tensor, Tensor]] | None = None


def accumulate(p: Passes, batches: list[Batch], denom: float) -> tuple[Tensor, int]:
    """Zero the gradients, then back-propagate ``sum(token losses) / denom`` of every batch through
    ``p.forward`` (DDP's reduction on the step's last pass only), or what ``p.loss_of`` says. Returns (the
    summed loss of the step on this rank, a float64 scalar, or the sum of what ``loss_of`` reports; how many
    splits out-of-memory errors caused). The first split of a run is printed once on the trainer's console;
    the step's record counts them."""
    pieces = [[b] for b in batches]  # each batch as the parts it runs in
    splits = 0
    while True:
        p.optimizer.zero_grad(set_to_none=True)
        loss: Tensor | None = None
        if p.source_losses is not None:
            p.source_losses.zero()  # a replayed step counts its sources afresh
        replay = False
        for i, parts in enumerate(pieces):
            j = 0
            while j < len(parts) and not replay:
                stage = _Stage()
                try:
                    last = i == len(pieces) - 1 and j == len(parts) - 1
                    got = _pass(p, batch=parts[j], denom=denom, last=last, stage=stage)
                    loss = got if loss is None else loss + got
                    j += 1
                    continue
                except RuntimeError as e:
                    if not is_out_of_memory(e):
                        raise
                    if p.dist.enabled:
                        raise refuse_distributed(parts[j], p.dist.rank) from None
                free_memory(p.device)  # outside the handler: the failed pass's tensors are gone
                if not p.oom.printed:
                    p.oom.printed = True
                    p.console.message(
                        f"out of memory on a batch of {parts[j].num_rows} rows x {parts[j].seq_len} tokens: split by rows "
                        "and retried within the step (each step's record counts oom_splits; printed once)"
                    )
                parts[j : j + 1] = split_rows(parts[j])
                splits += 1
                replay = stage.backward
            if replay:
                break
        if not replay:
            return (loss if loss is not None else torch.zeros((), dtype=torch.float64, device=p.device)), splits


def _pass(p: Passes, *, batch: Batch, denom: float, last: bool, stage: _Stage) -> Tensor:
    batch = to_device(batch, p.device)
    # the backward too runs inside the sync context: DDP decides at forward time, FSDP2 at backward time
    with p.sync(last):
        if p.loss_of is not None:  # an objective's own loss (train/objectives/)
            with autocast(p.device, p.precision):
                loss, report = p.loss_of(batch)
            stage.backward = True
            p.scaler.scale(loss).backward()
            return report
        with autocast(p.device, p.precision):  # losses: (rows, T) float32, 0 where label == -100
            weighted, losses = weighted_losses(p.forward, batch, p.source_weights)  # the weighted sum, the plain CE
        summed = losses.float().sum()
        if p.source_losses is not None:
            p.source_losses.add(batch, losses)
        stage.backward = True
        p.scaler.scale(weighted / denom).backward()
    return summed.detach().double()

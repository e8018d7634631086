"""The one contract shared by data, model and train: a collated batch and the ignore index.

A ``Batch`` is what the data layer hands to everything downstream. Labels are already shifted
(``labels[r, t]`` is the target for ``input_ids[r, t]``); nothing downstream slices ``[:, 1:]``.

Positions carry document boundaries: ``positions[r, t] == 0`` marks the start of a document
(or of the padding run at the end of a row, which is treated as one more segment so that real
tokens never attend to padding and padding never attends to real tokens). A packed row with
documents ``a0 a1 E`` and ``b0 E`` (E = end-of-text, appended by prepare) and 2 slots of padding::

    input_ids  a0  a1  E     b0  E     P     P
    positions  0   1   2     0   1     0     1
    labels     a1  E   -100  E   -100  -100  -100

The target of a document's last input token would be the next document: it is -100. (When a
document is split across rows, a piece that continues keeps the next token as its last target.)

What the planner knows travels with the batch, so that models need no host synchronisation to
rediscover it: ``single_doc_rows`` (every row is one document piece then padding: plain causal
attention is exact), ``max_position`` (largest position, i.e. the longest piece minus one) and
``documents`` (store indices of the documents in the batch, for logs and error messages). They
are ``None`` / empty when unknown (a batch built by hand); models then fall back to computing.
``source_ids`` (when the data has named sources) gives each real token its source's index, so a
loss can be summed per source exactly over the tokens whose label is not ``IGNORE_INDEX``.

``cu_seqlens`` / ``max_seqlen`` are the segments (documents, pieces and padding runs) of the rows
flattened end to end, as variable-length attention kernels take them: ``cu_seqlens`` (segments + 1,)
int32 holds the first token of every segment and the total, ``max_seqlen`` the longest segment.
The collator computes them from the plan; ``cu_seqlens`` stays on the host (``to`` does not move it,
``pin_memory`` pins it), so a model builds its attention plan without reading the device back and
copies the bounds over asynchronously. For the padded row above: ``cu_seqlens = [0, 3, 5, 7]``.

A batch of preference pairs (``pairs``, a ``Pairs``) lays each pair as its store holds it
(``data/store/pair_layout.py``): the prompt's first tokens, then the chosen branch and the rejected branch,
each opened by the prompt's last token; the rejected branch's positions continue from the prompt's end, so
positions do not restart there, and ``pairs.branches`` says which tokens a model must keep apart (a token of
the rejected branch never attends to one of the chosen branch). A model that cannot honour ``branches``
must not be given such a batch: the collator then lays the prompt twice (``[p c] [p r]``, two plain
segments) and ``branches`` is None. ``single_doc_rows`` is False for pair batches. Labels hold the answers'
targets (and, for an objective that asks, the prompt's: ORPO's), and ``pairs.answer`` / ``pairs.prompt``
say whose they are; a model's per-token losses are all an objective needs of it (``train/objectives/``).
A batch split over context ranks (``train.context_parallel``: N ranks share every row) holds, on each rank,
the columns ``shard_columns(T, N, index)`` of its rows, with the counts of those columns (loss tokens exactly;
real tokens as an exact share of the whole), and in ``shard`` what the model needs to attend across the
ranks: the whole rows' positions and segment bounds, this rank's place and the ranks' process group. Each row
is cut into 2N equal chunks and rank i holds chunks i and 2N-1-i (head and tail), so that every rank's queries
have as much causal work as any other's (over a row-long document, the same number of query-key pairs)::

    T = 8, N = 2: chunks [0 1] [2 3] [4 5] [6 7]    rank 0 holds columns 0 1 6 7, rank 1 holds 2 3 4 5

A batch never has zero rows. A rank with no share of a step gets ``Batch.null(pad_id)``: one row
of one padding token and no loss, so it still runs forward and backward and joins every collective
of the step (DDP's gradient all-reduce, FSDP's all-gathers) with a zero contribution.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import torch
from torch import Tensor

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Pairs:
    """The preference pairs of a batch, one per piece, in row order: whose each target is, and what attention
    keeps apart (the module docstring)."""

    answer: Tensor  # (rows, T) int64: 2k at a target of pair k's chosen answer, 2k + 1 of its rejected one, -1 elsewhere
    branches: Tensor | None  # (rows, T) int8: 1 chosen branch, 2 rejected branch, 0 elsewhere; None: prompts laid twice
    rows: Tensor  # (pairs,) int64 on the host: each pair's row (ascending)
    ids: tuple[int, ...] = ()  # each pair's store index
    prompt: Tensor | None = None  # (rows, T) int64: k at a target of pair k's prompt (its chosen sequence's), -1 elsewhere
    reference: Tensor | None = None  # (pairs, 2) float64: the reference model's summed log-probabilities (chosen, rejected)

    @property
    def count(self) -> int:
        return int(self.rows.numel())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Pairs:
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return replace(self, answer=move(self.answer), branches=move(self.branches), prompt=move(self.prompt), reference=move(self.reference))  # fmt: skip

    def pin_memory(self) -> Pairs:
        pin = lambda t: None if t is None else t.pin_memory()  # noqa: E731
        return replace(self, answer=pin(self.answer), branches=pin(self.branches), prompt=pin(self.prompt), reference=pin(self.reference))  # fmt: skip

    def row_slice(self, a: int, b: int) -> Pairs:
        """The pairs of rows ``[a, b)`` (a pair lies in one row), renumbered from 0."""
        keep = (self.rows >= a) & (self.rows < b)
        idx = torch.nonzero(keep).flatten()
        first = int(idx[0]) if idx.numel() else 0

        def shift(t: Tensor | None, scale: int) -> Tensor | None:
            if t is None:
                return None
            t = t[a:b]
            return torch.where(t >= 0, t - scale * first, t)

        return Pairs(
            answer=shift(self.answer, 2),
            branches=None if self.branches is None else self.branches[a:b],
            rows=self.rows[idx] - a,
            ids=tuple(self.ids[i] for i in idx.tolist()) if self.ids else (),
            prompt=shift(self.prompt, 1),
            reference=None if self.reference is None else self.reference[idx.to(self.reference.device)],
        )


@dataclass(frozen=True)
class Batch:
    input_ids: Tensor  # (rows, T) int64
    labels: Tensor  # (rows, T) int64; IGNORE_INDEX where no loss
    positions: Tensor  # (rows, T) int64; 0 at every document start
    num_loss_tokens: int  # labels != IGNORE_INDEX
    num_real_tokens: int  # non-padding tokens (fill rate, throughput)
    single_doc_rows: bool | None = None  # every row: one piece, then padding (None = unknown)
    max_position: int | None = None  # largest value in positions (None = unknown)
    documents: tuple[int, ...] = ()  # store indices of the documents in this batch (sorted, unique)
    source_ids: Tensor | None = None  # (rows, T) int64: source (of a mixture) of each real token, -1 at padding
    cu_seqlens: Tensor | None = None  # (segments + 1,) int32 on the host: segment starts over the flattened rows, then rows*T
    max_seqlen: int | None = None  # longest segment (None = unknown)
    # (rows, T) float32: each position's weight in the training loss (train.source_balance), set by the
    # trainer on the device; a model whose ``weighs_losses`` is True then returns weight x CE per position
    loss_weights: Tensor | None = None
    pairs: Pairs | None = None  # preference pairs (data.pairs): whose each target is; None for documents
    shard: RowShard | None = None  # the rows are split over context ranks: this batch holds one rank's columns

    @classmethod
    def null(cls, pad_id: int) -> Batch:
        """One row of one padding token, no loss: an idle rank's zero contribution to a step."""
        one = torch.full((1, 1), int(pad_id), dtype=torch.int64)  # (1, 1)
        return cls(
            one,
            torch.full((1, 1), IGNORE_INDEX, dtype=torch.int64),
            torch.zeros((1, 1), dtype=torch.int64),
            num_loss_tokens=0,
            num_real_tokens=0,
            single_doc_rows=True,
            max_position=0,
            cu_seqlens=torch.tensor([0, 1], dtype=torch.int32),
            max_seqlen=1,
        )

    @property
    def is_null(self) -> bool:
        return self.num_real_tokens == 0

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def num_slots(self) -> int:
        """Token slots computed: rows × T (the denominator of the fill rate)."""
        return int(self.input_ids.numel())

    @property
    def fill_rate(self) -> float:
        return self.num_real_tokens / max(1, self.num_slots)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return replace(
            self,
            input_ids=self.input_ids.to(device, non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
            positions=self.positions.to(device, non_blocking=non_blocking),
            source_ids=None if self.source_ids is None else self.source_ids.to(device, non_blocking=non_blocking),
            loss_weights=None if self.loss_weights is None else self.loss_weights.to(device, non_blocking=non_blocking),
            pairs=None if self.pairs is None else self.pairs.to(device, non_blocking=non_blocking),
            shard=None if self.shard is None else self.shard.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> Batch:
        return replace(
            self,
            input_ids=self.input_ids.pin_memory(),
            labels=self.labels.pin_memory(),
            positions=self.positions.pin_memory(),
            source_ids=None if self.source_ids is None else self.source_ids.pin_memory(),
            cu_seqlens=None if self.cu_seqlens is None else self.cu_seqlens.pin_memory(),
            pairs=None if self.pairs is None else self.pairs.pin_memory(),
            shard=None if self.shard is None else self.shard.pin_memory(),
        )


@dataclass(frozen=True)
class RowShard:
    """What a rank's model needs of rows split over ``degree`` context ranks beyond its own columns: the whole
    rows' positions (documents and the attention plan come from them) and segment bounds (host), and where
    the other columns are (``index`` among the ``group``'s ranks, which hold the rows' other chunks)."""

    index: int  # this rank's place among the context ranks: it holds chunks index and 2 * degree - 1 - index
    degree: int  # context ranks sharing the rows (N)
    positions: Tensor  # (rows, T) the whole rows' positions
    cu_seqlens: Tensor | None = None  # (segments + 1,) int32 on the host: the whole rows' segment bounds
    max_seqlen: int | None = None  # longest segment of the whole rows
    group: object = None  # torch.distributed process group of the context ranks (the model exchanges over it)

    @property
    def seq_len(self) -> int:
        """T: the whole rows' length."""
        return int(self.positions.shape[-1])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> RowShard:
        return replace(self, positions=self.positions.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> RowShard:
        cu = None if self.cu_seqlens is None else self.cu_seqlens.pin_memory()
        return replace(self, positions=self.positions.pin_memory(), cu_seqlens=cu)


def gathered_chunks(degree: int) -> list[int]:
    """The row's chunks as the ranks' columns laid end to end (rank 0's head and tail, rank 1's, ...):
    ``[0, 3, 1, 2]`` for N = 2. What a rank receives when every rank sends it its columns in rank order."""
    return [c for i in range(degree) for c in (i, 2 * degree - 1 - i)]


@lru_cache(maxsize=64)
def _columns(seq_len: int, degree: int, index: int) -> Tensor:
    if seq_len % (2 * degree):
        raise ValueError(f"a row of {seq_len} tokens does not split into {2 * degree} equal chunks")
    c = seq_len // (2 * degree)
    head, tail = index, 2 * degree - 1 - index
    return torch.cat([torch.arange(head * c, head * c + c), torch.arange(tail * c, tail * c + c)])


def shard_columns(seq_len: int, degree: int, index: int) -> Tensor:
    """(seq_len / degree,) int64: the columns of a row of ``seq_len`` tokens that context rank ``index`` of
    ``degree`` holds, in row order (its head chunk, then its tail chunk); ValueError unless 2N divides seq_len."""
    return _columns(seq_len, degree, index)


@dataclass(frozen=True)
class Step:
    """One optimizer step as one rank sees it: its batches (every rank holds the same number of them;
    an idle rank's are null batches) and where the step leaves the data."""

    batches: tuple[Batch, ...]
    epoch: float  # position after this step, in epochs: epoch index + share of the epoch consumed
    documents: tuple[int, ...] = ()  # store indices of the step's documents, over all ranks
    num_batches: int = 0  # micro-batches of the whole step over all ranks (null padding excluded)


def document_ids(positions: Tensor) -> Tensor:
    """Segment index of every token, per row: increments at each ``positions == 0``. (rows, T)

    Two tokens may attend to each other only when they share a segment id (and causally).
    """
    return torch.cumsum((positions == 0).to(torch.int32), dim=-1)


def segment_bounds(positions: Tensor) -> tuple[Tensor, int]:
    """``(cu_seqlens, max_seqlen)`` of ``positions`` (rows, T) on the host: a segment starts at every
    ``positions == 0`` and at every row start. For batches built without a collator (tests, tools)."""
    pos = positions.detach().to("cpu")
    is_start = pos == 0  # (rows, T)
    is_start[:, 0] = True
    starts = torch.nonzero(is_start.reshape(-1)).flatten()  # (S,)
    cu = torch.cat([starts, starts.new_tensor([pos.numel()])]).to(torch.int32)  # (S + 1,)
    return cu, int((cu[1:] - cu[:-1]).max()) if pos.numel() else 0

"""Attention across rows split over context ranks: an all-to-all over heads (Ulysses) on torch's own collectives.

Each of N context ranks holds T/N tokens of every row (``batch.shard_columns``: a head and a tail chunk) for
all H heads. One all-to-all (``torch.distributed``'s functional collective, which has autograd) trades them
for all T tokens of H/N heads, q, k and v in one exchange; the chunks are put back in row order and the
whole rows' attention plan (documents from the rows' true positions: ``attention.plan_attention`` with the
batch's ``RowShard``) runs on whatever backend the layer would run unsplit: varlen, flex, segmented, masked.
A second all-to-all brings each rank its own tokens back for all heads. The backward pass is the same two
exchanges in reverse (the collectives' autograd). So attention is exact by construction: each head sees
exactly the whole rows it sees on one rank.

Memory: what a layer keeps for its backward pass is its kernel's own inputs and output, for H/N heads over T
tokens, 1/N of the unsplit layer's; no rank ever holds keys and values of the whole rows for all heads.
Work: every rank computes whole rows for its heads, so attention's causal work is the same on every rank
whatever the rows hold. Communication per layer and pass: 2 all-to-alls, each rank sending (N-1)/N of its
shard's q, k, v (first) and of its attention output (second).

Grouped-query heads: key/value heads are split like the query heads when N divides their number (each rank's
query heads then read its own key/value heads); when their number divides N, each is repeated first so
that every rank gets the one its query heads share (the repeat's backward sums the gradient back). Other
head counts are refused (``heads_problem``), before any work by the run layer, and here as a safety net.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import torch
from torch import Tensor

from densebatch import torch_features
from densebatch.batch import RowShard, gathered_chunks
from densebatch.errors import ConfigError


def heads_problem(heads: int, kv_heads: int, degree: int) -> str | None:
    """Why ``heads`` query heads with ``kv_heads`` key/value heads cannot be split over ``degree`` context
    ranks (None: they can)."""
    if heads % degree:
        return f"{heads} attention heads do not split over {degree} context ranks (each takes heads / ranks of them)"
    if kv_heads % degree and degree % kv_heads:
        return (
            f"{kv_heads} key/value heads neither split over {degree} context ranks nor divide them "
            f"(each rank takes its query heads' key/value heads)"
        )
    return None


def exchange(x: Tensor, group) -> Tensor:
    """``x`` (N, ...) contiguous, part j sent to context rank j; returns (N, ...), part i received from rank i.
    torch's functional all-to-all, whose backward is the reverse exchange."""
    fn = torch_features.all_to_all_autograd()
    torch_features.require(fn, "torch.distributed's all_to_all_single_autograd", "train.context_parallel")
    return fn(x, None, None, group)


class _Chunks(torch.autograd.Function):
    """Reorder the chunks of dim 0 (``order``: which chunk goes where); the backward reorders the gradient by
    the inverse order (a gather, where index_select's own backward would scatter-add)."""

    @staticmethod
    def forward(ctx, x: Tensor, order: Tensor, inverse: Tensor) -> Tensor:
        ctx.inverse = inverse
        return x.index_select(0, order)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad.index_select(0, ctx.inverse), None, None


@lru_cache(maxsize=32)
def _orders(degree: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(row order from gathered order, gathered order from row order) of a row's 2N chunks, on ``device``."""
    gathered = torch.tensor(gathered_chunks(degree))
    return torch.argsort(gathered).to(device), gathered.to(device)


def attend_across(
    q: Tensor, k: Tensor, v: Tensor, shard: RowShard, local: Callable[[Tensor, Tensor, Tensor], tuple[Tensor, str]]
) -> tuple[Tensor, str]:
    """Attention of this rank's columns q (rows, H, T/N, D) over k, v (rows, Hkv, T/N, D), the rows' other
    columns being on the other context ranks of ``shard.group``. ``local(q, k, v)`` attends whole rows
    ((rows, h, T, D) in row order) and says which kernel did; returns ((rows, H, T/N, D), what ran)."""
    N = shard.degree
    rows, H, t, D = q.shape
    Hkv = k.shape[1]
    if (problem := heads_problem(H, Hkv, N)) is not None:
        raise ConfigError(f"train.context_parallel: {problem}")
    if Hkv % N:  # fewer key/value heads than ranks: each rank takes the one its query heads share
        k, v = (x.repeat_interleave(N // Hkv, dim=1) for x in (k, v))  # (rows, N, t, D)
        Hkv = N
    hq, hk = H // N, Hkv // N
    T, c = t * N, t // 2  # whole row; tokens of a chunk

    def by_rank(x: Tensor, h: int) -> Tensor:  # (rows, N * h, t, D) -> (N, t, rows, h, D): part j = heads of rank j
        return x.reshape(rows, N, h, t, D).permute(1, 3, 0, 2, 4)

    to_rows, to_ranks = _orders(N, q.device)
    send = torch.cat([by_rank(q, hq), by_rank(k, hk), by_rank(v, hk)], dim=3)  # (N, t, rows, hq + 2 hk, D)
    got = exchange(send, shard.group)  # part i: rank i's columns of this rank's heads
    del send  # each transient goes as soon as it is used: a layer's peak is its kernel's, not these copies'
    whole = _Chunks.apply(got.reshape(2 * N, c, rows, hq + 2 * hk, D), to_rows, to_ranks).reshape(T, rows, hq + 2 * hk, D)
    del got
    out, what = local(*(x.permute(1, 2, 0, 3) for x in whole.split([hq, hk, hk], dim=2)))  # (rows, h, T, D) in row order
    del whole
    back = _Chunks.apply(out.permute(2, 0, 1, 3).reshape(2 * N, c, rows, hq, D), to_ranks, to_rows)  # rank by rank
    del out
    mine = exchange(back.reshape(N, t, rows, hq, D), shard.group)  # part i: this rank's columns of rank i's heads
    del back
    # laid out (rows, T/N, H, D), as the projections made q: the caller's transpose back to it is free
    out = mine.permute(2, 1, 0, 3, 4).reshape(rows, t, H, D).transpose(1, 2)  # (rows, H, T/N, D)
    return out, f"{what}, rows split over {N} context ranks (all-to-all over heads)"

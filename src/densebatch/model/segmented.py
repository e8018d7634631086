"""The segmented attention path: documents gathered into length buckets, causal attention per bucket.

Segments (documents, pieces, padding runs) are grouped into length buckets (geometric bounds, ratio
``BUCKET_RATIO``: a segment is padded by less than that factor above ``MIN_BUCKET``); each bucket is
gathered into ``(segments, H, L, D)`` and run through the causal kernel (``kernels.kernel``), and the
outputs are gathered back. Padding slots sit after a segment's last token, so causal attention keeps
them out of every real token (and out of its gradient). The indices (``SegmentPlan``) are built once
per batch, by the host from the batch's segment bounds when it has them (no device operation until the
finished indices are copied over), else from ``positions``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from densebatch.model.kernels import PLAIN, AttnOptions, kernel

# Bucket bounds grow by this factor (from MIN_BUCKET): a segment is padded to < BUCKET_RATIO x its
# length, i.e. < 20% of a bucket's slots are padding. Finer ratios mean more, smaller SDPA calls.
BUCKET_RATIO = 1.25
MIN_BUCKET = 32  # segments up to this long share one bucket: tiny kernels cost more in overhead


@dataclass
class SegmentPlan:
    """Gather / scatter indices of the segmented backend (no grad; shared by every layer).

    ``gather[s]`` is the flat token (over rows * T) held by slot ``s``; slots are laid out bucket
    after bucket, each bucket ``(n, L)`` being n segments of L slots. ``scatter[t]`` is the slot of
    token t, so ``slots[scatter]`` puts every output back where its token came from.
    """

    gather: Tensor  # (slots,) int64
    scatter: Tensor  # (rows * T,) int64
    pad_slots: Tensor  # (slots - rows * T,) int64: slots after a segment's end
    buckets: list[tuple[int, int]]  # (segments, padded length) per bucket, in slot order
    masks: list[Tensor] | None = None  # per bucket (n, 1, L, L) bool: a pair batch's causal mask without rejected -> chosen


def segment_plan(
    positions: Tensor,
    ratio: float | None = None,
    min_len: int | None = None,
    cu_seqlens: Tensor | None = None,
    branches: Tensor | None = None,
) -> SegmentPlan:
    """Segments of ``positions`` (rows, T), bucketed by length, as gather / scatter indices.

    Vectorised except for a loop over the non-empty buckets (about log(T / min_len) / log(ratio)).
    ``cu_seqlens`` (the batch's segment bounds, on the host: ``Batch.cu_seqlens``) lets the indices be
    built on the host and copied to the device asynchronously: no device synchronisation. Without it
    they are found from ``positions`` (one host sync for the bucket sizes). A row start is a segment
    start even when its position is not 0.
    """
    ratio, min_len = ratio or BUCKET_RATIO, min_len or MIN_BUCKET  # read late: benchmarks tune them
    rows, T = positions.shape
    n_tok = rows * T
    dev = positions.device
    if cu_seqlens is not None:
        plan = _host_segment_plan(cu_seqlens.numpy().astype(np.int64), n_tok, ratio, min_len, dev)
    else:
        is_start = positions == 0  # (rows, T)
        is_start[:, 0] = True
        seg_start = torch.nonzero(is_start.reshape(-1)).flatten()  # (S,)
        seg_len = torch.diff(seg_start, append=seg_start.new_tensor([n_tok]))  # (S,)
        plan = _segment_indices(seg_start, seg_len, n_tok, ratio, min_len)
    if branches is not None:
        plan.masks = _branch_masks(plan, branches)
    return plan


def _branch_masks(seg: SegmentPlan, branches: Tensor) -> list[Tensor]:
    """Each bucket's mask of a pair batch (``Batch.pairs.branches``): causal within a segment, and a query of a
    pair's rejected branch never sees a key of its chosen branch (a pair is one segment: prompt, then both
    branches). Slots past a segment's end come after its tokens: causality keeps them out as keys."""
    br = branches.reshape(-1).index_select(0, seg.gather)  # (slots,) each slot's branch
    out, at = [], 0
    for n, L in seg.buckets:
        b = br[at : at + n * L].view(n, L)
        causal = torch.ones(L, L, dtype=torch.bool, device=br.device).tril()
        out.append((causal & ~((b[:, :, None] == 2) & (b[:, None, :] == 1)))[:, None])  # (n, 1, L, L)
        at += n * L
    return out


def _host_segment_plan(cu: np.ndarray, n_tok: int, ratio: float, min_len: int, dev: torch.device) -> SegmentPlan:
    """``_segment_indices`` computed by the host (numpy) from the batch's bounds ``cu`` (S + 1,): no
    device operation at all until the finished indices are copied over (asynchronously from pinned
    memory on an accelerator)."""
    start, length = cu[:-1], np.diff(cu)  # (S,)
    bucket = np.maximum(np.ceil(np.log(np.maximum(length, 1) / min_len) / math.log(ratio)), 0).astype(np.int64)
    order = np.argsort(bucket, kind="stable")
    counts = np.bincount(bucket)
    longest = np.zeros_like(counts)
    np.maximum.at(longest, bucket, length)
    buckets = [(int(n), int(L)) for n, L in zip(counts, longest) if n > 0]
    slot_base = np.empty_like(start)
    gathers, pads = [], []
    first_seg = first_slot = 0
    for n, L in buckets:
        segs = order[first_seg : first_seg + n]
        base = first_slot + L * np.arange(n)
        slot_base[segs] = base
        gathers.append(np.minimum(start[segs, None] + np.arange(L), n_tok - 1).reshape(-1))
        pad = np.arange(L)[None, :] >= length[segs, None]  # (n, L) slots after a segment's end
        pads.append((base[:, None] + np.arange(L))[pad])
        first_seg, first_slot = first_seg + n, first_slot + n * L
    seg_of_tok = np.repeat(np.arange(len(start)), length)  # (N,)
    scatter = slot_base[seg_of_tok] + np.arange(n_tok) - start[seg_of_tok]
    parts = np.concatenate(gathers), scatter, np.concatenate(pads) if pads else np.zeros(0, np.int64)
    if dev.type == "cpu":
        gather, scatter_t, pad_slots = (torch.from_numpy(np.ascontiguousarray(a)) for a in parts)
    else:
        gather, scatter_t, pad_slots = (torch.from_numpy(a).pin_memory().to(dev, non_blocking=True) for a in parts)
    return SegmentPlan(gather, scatter_t, pad_slots, buckets)


def _segment_indices(seg_start: Tensor, seg_len: Tensor, n_tok: int, ratio: float, min_len: int) -> SegmentPlan:
    """The gather / scatter indices of segments starting at ``seg_start`` (S,) of ``seg_len`` (S,) tokens,
    which tile the ``n_tok`` flattened tokens, on their device."""
    dev = seg_start.device
    # Bucket k holds lengths in (min_len * ratio^(k-1), min_len * ratio^k]; bucket 0 all <= min_len.
    bucket = torch.ceil(torch.log(seg_len.double() / min_len) / math.log(ratio)).clamp_(min=0).long()  # (S,)
    order = torch.argsort(bucket, stable=True)  # (S,) segments bucket by bucket
    counts = torch.bincount(bucket)  # (K,)
    longest = torch.zeros_like(counts).scatter_reduce_(0, bucket, seg_len, "amax")  # (K,)
    # A bucket is padded to its own longest segment, not to its upper bound.
    buckets = [(n, L) for n, L in zip(counts.tolist(), longest.tolist()) if n > 0]
    slot_base = torch.empty_like(seg_start)  # (S,) first slot of each segment
    gathers = []
    first_seg, first_slot = 0, 0
    for n, L in buckets:
        segs = order[first_seg : first_seg + n]  # (n,)
        slot_base[segs] = first_slot + L * torch.arange(n, device=dev)
        # Slots past a segment's end read some other token (clamped into range): only padding
        # queries of this segment can see them, and those outputs are never gathered back.
        idx = seg_start[segs, None] + torch.arange(L, device=dev)  # (n, L)
        gathers.append(idx.clamp_(max=n_tok - 1).reshape(-1))
        first_seg, first_slot = first_seg + n, first_slot + n * L
    seg_of_tok = torch.repeat_interleave(torch.arange(seg_start.numel(), device=dev), seg_len, output_size=n_tok)  # (N,)
    offset = torch.arange(n_tok, device=dev) - seg_start[seg_of_tok]  # (rows * T,) index within segment
    scatter = slot_base[seg_of_tok] + offset  # (rows * T,)
    gather = torch.cat(gathers)  # (slots,)
    is_pad = torch.ones_like(gather, dtype=torch.bool)
    is_pad[scatter] = False
    return SegmentPlan(gather, scatter, torch.nonzero(is_pad).flatten(), buckets)


def _real_slots(seg: SegmentPlan) -> Tensor:
    """(slots,) bool: True at a slot that holds a token of its segment, False at the padding after it."""
    real = torch.ones(seg.gather.shape, dtype=torch.bool, device=seg.gather.device)
    return real.index_fill_(0, seg.pad_slots, False)


class _ToSlots(torch.autograd.Function):
    """tokens (N, ...) -> slots (S, ...) by ``gather``; backward by ``scatter`` (a plain gather too).

    index_select's own backward is a scatter-add (about 10x slower on CPU than a gather). Reading the
    gradient of every token from its one real slot is exact here because the gradient of a padding
    slot is exactly 0: its query's output is never read, and its key and value are seen only by
    padding queries of the same segment (causal), whose incoming gradient is 0.
    """

    @staticmethod
    def forward(ctx, x: Tensor, seg: SegmentPlan) -> Tensor:
        ctx.seg = seg
        return x.index_select(0, seg.gather)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad.index_select(0, ctx.seg.scatter), None


class _ToTokens(torch.autograd.Function):
    """slots (S, ...) -> tokens (N, ...) by ``scatter``; backward writes each token's gradient into its
    slot (every token has exactly one, so a copy suffices) and zeros the padding slots."""

    @staticmethod
    def forward(ctx, x: Tensor, seg: SegmentPlan) -> Tensor:
        ctx.seg = seg
        return x.index_select(0, seg.scatter)

    @staticmethod
    def backward(ctx, grad: Tensor):
        seg = ctx.seg
        out = grad.new_empty((seg.gather.numel(), *grad.shape[1:])).index_copy_(0, seg.scatter, grad)
        return out.index_fill_(0, seg.pad_slots, 0), None


def segmented_attention(
    q: Tensor, k: Tensor, v: Tensor, seg: SegmentPlan, dropout_p: float = 0.0, opts: AttnOptions = PLAIN
) -> Tensor:
    """Causal attention within segments for q (rows, H, T, D) and k, v (rows, Hkv, T, D), bucket by
    bucket. (rows, H, T, D) With ``opts.causal`` False (an encoder) each query sees its whole segment:
    the padding slots after a segment's end are then masked out as keys."""
    rows, H, T, D = q.shape
    Hkv = k.shape[1]
    # (rows, T, H, D) is the layout the projections produced: flattening it is a view, not a copy.
    sizes = [n * L for n, L in seg.buckets]
    # split (not slicing): its backward is one cat, where each slice's would zero-fill all slots.
    q = _ToSlots.apply(q.transpose(1, 2).reshape(rows * T, H, D), seg).split(sizes)
    k, v = (_ToSlots.apply(x.transpose(1, 2).reshape(rows * T, Hkv, D), seg).split(sizes) for x in (k, v))
    outs = []
    valid = None if opts.causal else _real_slots(seg).split(sizes)
    for b, ((n, L), qb, kb, vb) in enumerate(zip(seg.buckets, q, k, v)):
        qb = qb.view(n, L, H, D).transpose(1, 2)  # (n, H, L, D)
        kb, vb = (x.view(n, L, Hkv, D).transpose(1, 2) for x in (kb, vb))  # (n, Hkv, L, D)
        keys = None if valid is None else valid[b].view(n, 1, 1, L)  # a segment's own slots, not its padding
        if seg.masks is not None:  # a pair batch: causal, rejected never sees chosen
            keys = seg.masks[b]
        out = kernel(qb, k=kb, v=vb, mask=keys, dropout_p=dropout_p, opts=opts)  # (n, H, L, D)
        outs.append(out.transpose(1, 2).reshape(n * L, H, D))
    slots = outs[0] if len(outs) == 1 else torch.cat(outs)  # (slots, H, D)
    return _ToTokens.apply(slots, seg).view(rows, T, H, D).transpose(1, 2)  # (rows, H, T, D)

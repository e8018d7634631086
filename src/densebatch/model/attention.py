"""Document-isolating causal attention: one plan per batch from ``positions``, several kernels.

A token may attend to another only when both lie in the same segment (``document_ids``, which
increments at every ``positions == 0``) and the key is not after the query. Backends:

- ``masked``: SDPA with an explicit boolean ``(rows, 1, T, T)`` mask. Exact on every device, but it
  computes all rows x T^2 scores however short the documents are.
- ``segmented``: variable-length attention from standard ops, on any device. Segments are grouped
  into length buckets (geometric bounds, ratio ``BUCKET_RATIO``: a segment is padded by less than
  that factor above ``MIN_BUCKET``); each bucket is gathered into ``(segments, H, L, D)`` and run through
  ``is_causal=True`` SDPA, and the outputs are gathered back. Padding slots sit after a segment's
  last token, so causal attention keeps them out of every real token (and out of its gradient).
- ``causal``: plain ``is_causal=True`` SDPA, chosen when every row is one document followed by
  padding (the caller vouches for that with ``single_doc_rows``) or one segment. Exact for the real
  tokens because padding comes after them; padding outputs differ but carry no loss and no gradient.
- ``flex``: ``flex_attention`` with a block mask of the document ids (compiled on CUDA). On CPU
  torch 2.13 runs it forward-only and unfused, so it is never picked there when gradients flow.
- ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` on the flattened rows (FlashAttention;
  CUDA and fp16/bf16 only; fp32 falls back to ``segmented``).

``auto`` picks varlen, then flex, then segmented on CUDA; segmented on CPU; on rows shorter than
``SEGMENTED_MIN_LEN`` it picks masked instead of segmented. Measured (``benchmarks/model/attention_bench.py``,
torch 2.13, one CPU thread, fp32) on forward+backward of a 4-layer GPT over packed rows of 1024
holding ~5.5 long-tailed documents (median ~210 tokens): segmented takes 0.71 s vs masked 1.28 s
(width 128, 4 rows) and 1.92 s vs 2.75 s (width 256, 4 rows), faster even than the (leaky) plain
causal kernel (0.97 s, 2.35 s); bucket padding is ~5% of slots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from densebatch.batch import IGNORE_INDEX, Batch, document_ids
from densebatch.errors import ConfigError

BACKENDS = ("auto", "flex", "varlen", "segmented", "masked")
# Bucket bounds grow by this factor (from MIN_BUCKET): a segment is padded to < BUCKET_RATIO x its
# length, i.e. < 20% of a bucket's slots are padding. Finer ratios mean more, smaller SDPA calls.
BUCKET_RATIO = 1.25
MIN_BUCKET = 32  # segments up to this long share one bucket: tiny kernels cost more in overhead
# Below this row length the gathers cost as much as the scores they save: auto uses masked there
# (measured on CPU, attention forward+backward: T=64 masked 1.7x faster, T=128 a tie, T=256
# segmented 1.1x faster on one document + padding and 2x on packed rows).
SEGMENTED_MIN_LEN = 256


def document_mask(positions: Tensor) -> Tensor:
    """Same-segment and causal: ``mask[r, 0, q, k]`` is True where q may attend to k. (rows, 1, T, T)"""
    doc = document_ids(positions)  # (rows, T)
    T = positions.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=positions.device).tril()  # (T, T)
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]  # (rows, 1, T, T)


def rows_hold_one_document(batch: Batch) -> bool:
    """``batch.single_doc_rows`` as the planner set it; computed (host synchronisations) only when unknown."""
    if batch.single_doc_rows is not None:
        return batch.single_doc_rows
    return only_padding_after_first_document(batch)


def only_padding_after_first_document(batch: Batch) -> bool:
    """True when every row is one document then (maybe) padding, so causal attention is exact.

    Positions cannot tell padding from a second document, so the counts decide: if no row has more
    than two segments and the first segments hold exactly ``num_real_tokens`` tokens (and every
    first segment carries a loss token, so none is a row of padding alone), the rest is padding.
    Falling back to the masked path is always correct, so any doubt answers False.
    """
    pos = batch.positions
    starts = (pos == 0).to(torch.int32)  # (rows, T)
    if bool((starts.sum(-1) > 2).any()):
        return False
    first = starts.cumsum(-1) == 1  # (rows, T) first segment
    if int(first.sum()) != batch.num_real_tokens:
        return False
    return bool(((batch.labels != IGNORE_INDEX) & first).any(-1).all())


def _varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.9
        return None
    return varlen_attn


@lru_cache(maxsize=1)
def _compiled_flex():
    # flex_attention is only fused (and memory-light) when compiled; eager materialises T x T scores.
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def _flex_available() -> bool:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def available_backends(device: torch.device | str, training: bool = True) -> list[str]:
    """Backends that isolate documents and run on ``device`` (with gradients when ``training``),
    fastest first: the first one is what ``auto`` picks."""
    dev = torch.device(device)
    if dev.type == "cuda":
        fused = (["varlen"] if _varlen_fn() is not None else []) + (["flex"] if _flex_available() else [])
        return fused + ["segmented", "masked"]
    # CPU (and others): segmented skips the scores across documents that masked computes and then
    # discards. flex is forward-only and unfused here (slower than masked SDPA), so it is offered
    # only for inference and never chosen by auto.
    return ["segmented", "masked"] + (["flex"] if _flex_available() and not training else [])


def pick_backend(name: str, device: torch.device | str, training: bool = True, seq_len: int | None = None) -> str:
    """Turn a backend name (``auto`` included) into one that runs here; ValueError if none does.

    ``seq_len`` (the row length T of the batch at hand) lets ``auto`` prefer masked on short rows.
    Called on every forward: a name that cannot run here is a programming error by then, because
    ``resolve_backend`` checked the configuration up front."""
    if name not in BACKENDS:
        raise ValueError(f"model.attention: expected one of {', '.join(BACKENDS)}; got {name!r}")
    avail = available_backends(device, training)
    if name == "auto":
        if avail[0] == "segmented" and seq_len is not None and seq_len < SEGMENTED_MIN_LEN:
            return "masked"
        return avail[0]
    if name not in avail:
        why = {
            "flex": "flex_attention has no backward pass on CPU in this torch",
            "varlen": "varlen_attn needs CUDA (FlashAttention) and torch >= 2.9",
        }.get(name, "")
        raise ValueError(
            f"model.attention: {name!r} cannot run on {torch.device(device).type} here ({why}); "
            f"use one of {', '.join(['auto'] + avail)}"
        )
    return name


def resolve_backend(name: str, device: torch.device | str, training: bool = True, seq_len: int | None = None) -> str:
    """``pick_backend`` for configuration checks: a name that cannot run here is a ``ConfigError``
    (one line naming model.attention and what to use), for the run layer to call before training."""
    try:
        return pick_backend(name, device, training, seq_len)
    except ValueError as e:
        raise ConfigError(str(e)) from None


@dataclass
class AttentionPlan:
    """What every layer needs to attend within documents; built once per forward."""

    backend: str  # masked | causal | segmented | flex | varlen
    mask: Tensor | None = None  # masked: (rows, 1, Tq, Tk) bool
    segments: SegmentPlan | None = None  # segmented (and any backend's fallback to it, built on first use)
    block_mask: object | None = None  # flex: BlockMask
    cu_seqlens: Tensor | None = None  # varlen: (segments + 1,) int32 over the flattened rows, on the device
    max_len: int = 0  # varlen: longest segment
    positions: Tensor | None = None  # (rows, T): what a fallback to the segmented path is built from
    host_cu_seqlens: Tensor | None = None  # the batch's segment bounds on the host (no device sync to use them)
    flex_masks: dict = field(default_factory=dict)  # flex: block masks by sliding window (None: none), built on first use


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


def segment_plan(
    positions: Tensor, ratio: float | None = None, min_len: int | None = None, cu_seqlens: Tensor | None = None
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
        return _host_segment_plan(cu_seqlens.numpy().astype(np.int64), n_tok, ratio, min_len, dev)
    is_start = positions == 0  # (rows, T)
    is_start[:, 0] = True
    seg_start = torch.nonzero(is_start.reshape(-1)).flatten()  # (S,)
    seg_len = torch.diff(seg_start, append=seg_start.new_tensor([n_tok]))  # (S,)
    return _segment_indices(seg_start, seg_len, n_tok, ratio, min_len)


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


def _kernel(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float, opts: AttnOptions) -> Tensor:
    """Causal attention of q (n, H, L, D) over k, v (n, Hkv, L, D) (``mask``, if given, replaces the
    causal one: (.., L, L) bool, True = may attend), with ``opts``' scale, window and soft-cap. (n, H, L, D)

    SDPA where it can (grouped-query heads through ``enable_gqa``, never repeated); soft-capped scores
    are computed explicitly (SDPA cannot cap), which is O(L^2) per call like SDPA's math kernel."""
    L = q.shape[-2]
    if opts.window is not None and opts.window < L:
        causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()  # (L, L)
        idx = torch.arange(L, device=q.device)
        band = causal & (idx[:, None] - idx[None, :] < opts.window)  # q - k < window, as transformers' overlay
        mask = band if mask is None else mask & band
    gqa = k.shape[1] != q.shape[1]
    if opts.softcap:
        return _capped_attention(q, k, v, mask, dropout_p, opts)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=opts.scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=opts.scale, enable_gqa=gqa)


def _capped_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float, opts: AttnOptions) -> Tensor:
    """Attention with soft-capped scores (Gemma 2: ``cap * tanh(s / cap)``), softmax in float32. (n, H, L, D)"""
    n, H, L, D = q.shape
    G = H // k.shape[1]  # query heads per key/value head
    qg = q.view(n, k.shape[1], G, L, D)  # (n, Hkv, G, L, D): no copy of k, v per query head
    scale = opts.scale if opts.scale is not None else 1.0 / math.sqrt(D)
    s = (qg @ k.unsqueeze(2).transpose(-1, -2)).float() * scale  # (n, Hkv, G, L, L)
    s = torch.tanh(s / opts.softcap) * opts.softcap
    if mask is None:
        mask = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    if mask.dim() == 4:  # (rows, 1, L, L): one per row
        mask = mask.unsqueeze(1)
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1).to(v.dtype)
    if dropout_p:
        p = F.dropout(p, dropout_p)
    return (p @ v.unsqueeze(2)).reshape(n, H, L, D)


@dataclass(frozen=True)
class AttnOptions:
    """What an architecture asks of attention beyond documents and causality (transformers passes
    these per layer: ``scaling``, ``sliding_window``, ``softcap``)."""

    scale: float | None = None  # None: 1 / sqrt(head_dim)
    window: int | None = None  # a query sees the keys with q - k < window (within its document)
    softcap: float | None = None  # scores become softcap * tanh(scores / softcap)


PLAIN = AttnOptions()


def segmented_attention(
    q: Tensor, k: Tensor, v: Tensor, seg: SegmentPlan, dropout_p: float = 0.0, opts: AttnOptions = PLAIN
) -> Tensor:
    """Causal attention within segments for q (rows, H, T, D) and k, v (rows, Hkv, T, D), bucket by
    bucket. (rows, H, T, D)"""
    rows, H, T, D = q.shape
    Hkv = k.shape[1]
    # (rows, T, H, D) is the layout the projections produced: flattening it is a view, not a copy.
    sizes = [n * L for n, L in seg.buckets]
    # split (not slicing): its backward is one cat, where each slice's would zero-fill all slots.
    q = _ToSlots.apply(q.transpose(1, 2).reshape(rows * T, H, D), seg).split(sizes)
    k, v = (_ToSlots.apply(x.transpose(1, 2).reshape(rows * T, Hkv, D), seg).split(sizes) for x in (k, v))
    outs = []
    for (n, L), qb, kb, vb in zip(seg.buckets, q, k, v):
        qb = qb.view(n, L, H, D).transpose(1, 2)  # (n, H, L, D)
        kb, vb = (x.view(n, L, Hkv, D).transpose(1, 2) for x in (kb, vb))  # (n, Hkv, L, D)
        out = _kernel(qb, kb, vb, None, dropout_p, opts)  # (n, H, L, D)
        outs.append(out.transpose(1, 2).reshape(n * L, H, D))
    slots = outs[0] if len(outs) == 1 else torch.cat(outs)  # (slots, H, D)
    return _ToTokens.apply(slots, seg).view(rows, T, H, D).transpose(1, 2)  # (rows, H, T, D)


def plan_attention(
    positions: Tensor,
    backend: str,
    single_doc_rows: bool = False,
    past_positions: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
) -> AttentionPlan:
    """Build the plan for ``positions`` (rows, T) with an already-resolved ``backend``.

    ``cu_seqlens`` / ``max_seqlen``: the batch's segment bounds (``Batch.cu_seqlens``, host int32, and
    ``Batch.max_seqlen``), which the collator computed; with them no backend reads the device back
    (varlen copies the bounds over asynchronously, segmented builds its indices on the host). Without
    them (a batch built by hand, generation) the bounds are found from ``positions``.

    ``past_positions`` (rows, S) are the positions already in a KV cache: queries are the new
    tokens, keys are past + new. Decoding always uses an explicit mask (tiny: Tq is 1).
    """
    if past_positions is not None and past_positions.shape[-1] > 0:
        all_pos = torch.cat([past_positions, positions], dim=-1)  # (rows, S + T)
        doc = document_ids(all_pos)  # (rows, S + T)
        S, T = past_positions.shape[-1], positions.shape[-1]
        q_idx = torch.arange(S, S + T, device=positions.device)
        k_idx = torch.arange(S + T, device=positions.device)
        same = doc[:, S:, None] == doc[:, None, :]  # (rows, T, S + T)
        return AttentionPlan("masked", mask=(same & (k_idx[None, :] <= q_idx[:, None]))[:, None], positions=positions)
    host = cu_seqlens if cu_seqlens is not None and cu_seqlens.device.type == "cpu" else None
    if single_doc_rows and backend != "varlen":
        return AttentionPlan("causal", positions=positions, host_cu_seqlens=host)
    if backend == "segmented":
        seg = segment_plan(positions, cu_seqlens=host)
        if len(seg.buckets) == 1 and seg.buckets[0][0] == positions.shape[0]:
            return AttentionPlan(
                "causal", positions=positions, host_cu_seqlens=host
            )  # one segment per row: plain causal is exact
        return AttentionPlan("segmented", segments=seg, positions=positions, host_cu_seqlens=host)
    if backend == "masked":
        return AttentionPlan("masked", mask=document_mask(positions), positions=positions, host_cu_seqlens=host)
    if backend == "flex":
        plan = AttentionPlan("flex", positions=positions, host_cu_seqlens=host)
        plan.block_mask = _flex_mask(plan, None)
        return plan
    if backend == "varlen":
        if host is not None and max_seqlen is not None:
            cu = host.to(positions.device, non_blocking=True)
            return AttentionPlan("varlen", cu_seqlens=cu, max_len=max_seqlen, positions=positions, host_cu_seqlens=host)
        flat = positions.reshape(-1)  # (rows * T,)
        # Every row boundary is a segment boundary too: a row starts with position 0.
        starts = torch.nonzero(flat == 0).flatten().to(torch.int32)
        total = torch.tensor([flat.numel()], dtype=torch.int32, device=flat.device)
        cu = torch.cat([starts, total])  # (segments + 1,)
        return AttentionPlan("varlen", cu_seqlens=cu, max_len=int((cu[1:] - cu[:-1]).max()), positions=positions)
    raise AssertionError(f"unresolved backend {backend}")


def attend(q: Tensor, k: Tensor, v: Tensor, plan: AttentionPlan, dropout_p: float = 0.0, opts: AttnOptions = PLAIN) -> Tensor:
    """Attention of q (rows, H, Tq, D) over k, v (rows, Hkv, Tk, D) under ``plan``. (rows, H, Tq, D)

    ``Hkv`` may divide ``H`` (grouped-query attention: key/value heads are shared, not repeated).
    ``opts`` (scale, sliding window, soft-cap) are honoured by every backend; a kernel that cannot
    compute something hands the layer on: varlen (no fp32, no soft-cap, no dropout in FlashAttention's
    varlen kernel) to flex with a document block mask on CUDA, attention dropout (which flex lacks) to the
    exact segmented path, whose indices are built once per plan."""
    if plan.backend == "causal":
        if opts.window is not None and opts.window < q.shape[-2] or opts.softcap:
            return segmented_attention(q, k, v, _segments(plan), dropout_p, opts)
        return _kernel(q, k, v, None, dropout_p, opts)
    if plan.backend == "masked":
        if q.shape[-2] != k.shape[-2]:  # decoding against a KV cache: the mask already says everything but the window
            mask = plan.mask
            if opts.window is not None:
                Tq, Tk = q.shape[-2], k.shape[-2]
                qi = torch.arange(Tk - Tq, Tk, device=q.device)
                mask = mask & (qi[:, None] - torch.arange(Tk, device=q.device)[None, :] < opts.window)
            if opts.softcap:
                return _capped_attention(q, k, v, mask, dropout_p, opts)
            gqa = k.shape[1] != q.shape[1]
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=opts.scale, enable_gqa=gqa)
        return _kernel(q, k, v, plan.mask, dropout_p, opts)
    if plan.backend == "segmented":
        return segmented_attention(q, k, v, plan.segments, dropout_p, opts)
    if plan.backend == "flex":
        if dropout_p:  # flex has no attention dropout: the segmented path honours it
            return segmented_attention(q, k, v, _segments(plan), dropout_p, opts)
        return _flex_attention(q, k, v, plan, opts)
    if plan.backend == "varlen":
        if q.dtype not in (torch.float16, torch.bfloat16) or opts.softcap or dropout_p:
            # FlashAttention's varlen kernel has no fp32, no soft-cap and no dropout: flex with a document
            # block mask where it runs (CUDA; no dropout), else the exact segmented path.
            if not dropout_p and q.is_cuda and _flex_available():
                return _flex_attention(q, k, v, plan, opts)
            return segmented_attention(q, k, v, _segments(plan), dropout_p, opts)
        rows, H, T, D = q.shape
        Hkv = k.shape[1]
        flat = lambda x, h: x.transpose(1, 2).reshape(rows * T, h, D)  # noqa: E731  (rows*T, h, D)
        left = -1 if opts.window is None else opts.window - 1  # FlashAttention's window counts the keys before q
        out = _varlen_fn()(
            flat(q, H),
            flat(k, Hkv),
            flat(v, Hkv),
            plan.cu_seqlens,
            plan.cu_seqlens,
            plan.max_len,
            plan.max_len,
            scale=opts.scale,
            window_size=(left, 0),  # (-1, 0) = causal in varlen_attn
            enable_gqa=Hkv != H,
        )
        return out.view(rows, T, H, D).transpose(1, 2)  # (rows, H, T, D)
    raise AssertionError(f"unknown plan backend {plan.backend}")


def _flex_mask(plan: AttentionPlan, window: int | None):
    """The plan's document block mask (causal; within ``window`` when given), built once per window."""
    if window not in plan.flex_masks:
        from torch.nn.attention.flex_attention import create_block_mask

        doc = document_ids(plan.positions)  # (rows, T)

        def same_doc_causal(b, h, q, k):
            ok = (doc[b, q] == doc[b, k]) & (q >= k)
            return ok if window is None else ok & (q - k < window)

        rows, T = plan.positions.shape
        pos = plan.positions
        plan.flex_masks[window] = create_block_mask(same_doc_causal, rows, None, T, T, device=pos.device, _compile=pos.is_cuda)
    return plan.flex_masks[window]


def _flex_attention(q: Tensor, k: Tensor, v: Tensor, plan: AttentionPlan, opts: AttnOptions) -> Tensor:
    """FlexAttention over the plan's documents: the window in the block mask, the soft-cap as a score
    modification (after the scale, as Gemma 2), grouped-query heads shared (``enable_gqa``). (rows, H, T, D)"""
    score_mod = None
    if opts.softcap:
        cap = opts.softcap

        def score_mod(score, b, h, q_idx, k_idx):
            return cap * torch.tanh(score / cap)

    if q.is_cuda:
        fn = _compiled_flex()
    else:
        from torch.nn.attention.flex_attention import flex_attention as fn
    block_mask = _flex_mask(plan, opts.window)
    return fn(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=opts.scale, enable_gqa=k.shape[1] != q.shape[1])


def _segments(plan: AttentionPlan) -> SegmentPlan:
    """The plan's segmented indices, built on first use (a backend handing one layer to the segmented path)."""
    if plan.segments is None:
        plan.segments = segment_plan(plan.positions, cu_seqlens=plan.host_cu_seqlens)
    return plan.segments


# What compiled blocks call: attention and its plan stay eager (the plan's Python facts, bucket sizes and
# the longest segment, change every batch; as graph inputs they would recompile every step), and the
# compiled region ends before it and resumes after it.
attend_eagerly = torch.compiler.disable(attend)

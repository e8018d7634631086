"""Document-isolating causal attention: one plan per batch from ``positions``, several kernels (one concept, 441 lines: what a token may see, said once for every kernel).

A token may attend to another only when both lie in the same segment (``document_ids``, which
increments at every ``positions == 0``) and the key is not after the query. Backends:

- ``masked``: SDPA with an explicit boolean ``(rows, 1, T, T)`` mask. Exact on every device, but it
  computes all rows x T^2 scores however short the documents are.
- ``segmented``: variable-length attention from standard ops, on any device (``model/segmented.py``):
  segments gathered into length buckets, causal SDPA per bucket, outputs gathered back.
- ``causal``: plain ``is_causal=True`` SDPA, chosen when every row is one document followed by
  padding (the caller vouches for that with ``single_doc_rows``) or one segment. Exact for the real
  tokens because padding comes after them; padding outputs differ but carry no loss and no gradient.
- ``flex``: ``flex_attention`` with a block mask of the document ids (compiled on CUDA). On CPU
  torch 2.13 runs it forward-only and unfused, so it is never picked there when gradients flow.
- ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` on the flattened rows (FlashAttention;
  CUDA and fp16/bf16 only; fp32 and soft-capped layers go to ``flex``, attention dropout to ``segmented``),
  called with the keywords the installed release's signature takes (``torch_features.varlen_call``).

A batch of preference pairs laid with their prompt once (``Batch.pairs.branches``) adds one rule: a
query of a pair's rejected branch never sees a key of its chosen branch (``branch_conflict``). flex draws
it into its block mask, segmented into each bucket's mask, masked into its mask; the plain causal kernel
and FlashAttention's varlen cannot, so such a batch never takes them (``_pair_plan``: varlen goes to flex
on CUDA, else segmented); a run that asks for varlen lays its prompts twice instead.

Every backend ends in ``kernels.kernel`` (or FlashAttention / flex) with what the layer asks for
(``AttnOptions``: grouped-query heads, a sliding window, a soft-cap, a scale).

``auto`` picks varlen, then flex, then segmented on CUDA; segmented on CPU; on rows shorter than
``SEGMENTED_MIN_LEN`` it picks masked instead of segmented. Measured (``benchmarks/model/attention_bench.py``,
torch 2.13, one CPU thread, fp32) on forward+backward of a 4-layer GPT over packed rows of 1024
holding ~5.5 long-tailed documents (median ~210 tokens): segmented takes 0.71 s vs masked 1.28 s
(width 128, 4 rows) and 1.92 s vs 2.75 s (width 256, 4 rows), faster even than the (leaky) plain
causal kernel (0.97 s, 2.35 s); bucket padding is ~5% of slots.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import lru_cache

import torch
from torch import Tensor

from densebatch import torch_features
from densebatch.batch import IGNORE_INDEX, Batch, RowShard, document_ids
from densebatch.errors import ConfigError
from densebatch.model.context_attention import attend_across
from densebatch.model.kernels import PLAIN, AttnOptions, kernel
from densebatch.model.segmented import SegmentPlan, segment_plan, segmented_attention

BACKENDS = ("auto", "flex", "varlen", "segmented", "masked")
# Below this row length the gathers cost as much as the scores they save: auto uses masked there
# (measured on CPU, attention forward+backward: T=64 masked 1.7x faster, T=128 a tie, T=256
# segmented 1.1x faster on one document + padding and 2x on packed rows).
SEGMENTED_MIN_LEN = 256


def document_mask(positions: Tensor, causal: bool = True, branches: Tensor | None = None) -> Tensor:
    """Same-segment and causal (only same-segment for an encoder): ``mask[r, 0, q, k]`` is True where q may
    attend to k; with ``branches`` (a pair batch's, ``Batch.pairs``) a rejected-branch query never sees a
    chosen-branch key. (rows, 1, T, T)"""
    doc = document_ids(positions)  # (rows, T)
    same = doc[:, :, None] == doc[:, None, :]  # (rows, T, T)
    if causal:
        T = positions.shape[-1]
        same &= torch.ones(T, T, dtype=torch.bool, device=positions.device).tril()  # (T, T)
    if branches is not None:
        same &= ~branch_conflict(branches[:, :, None], branches[:, None, :])
    return same[:, None]  # (rows, 1, T, T)


def branch_conflict(query: Tensor, key: Tensor) -> Tensor:
    """True where a query of a pair's rejected branch would see a key of its chosen branch (``batch.Pairs``)."""
    return (query == 2) & (key == 1)


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


@lru_cache(maxsize=1)
def _compiled_flex():
    # flex_attention is only fused (and memory-light) when compiled; eager materialises T x T scores.
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def _flex_available() -> bool:
    return torch_features.flex_attention() is not None


def available_backends(device: torch.device | str, training: bool = True) -> list[str]:
    """Backends that isolate documents and run on ``device`` (with gradients when ``training``),
    fastest first: the first one is what ``auto`` picks."""
    dev = torch.device(device)
    if dev.type == "cuda":
        fused = (["varlen"] if torch_features.varlen() is not None else []) + (["flex"] if _flex_available() else [])
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
            "varlen": "varlen_attn needs CUDA (FlashAttention) and a torch that has torch.nn.attention.varlen",
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
    causal: bool = True  # False: bidirectional within each document (an encoder's masked-LM attention)
    flex_masks: dict = field(default_factory=dict)  # flex: block masks by sliding window (None: none), built on first use
    branches: Tensor | None = None  # (rows, T) int8 of a pair batch: rejected never attends to chosen (Batch.pairs)
    shard: RowShard | None = None  # rows split over context ranks: the plan is the whole rows', q/k/v this rank's columns


def plan_attention(
    positions: Tensor,
    *,
    backend: str,
    single_doc_rows: bool = False,
    past_positions: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    causal: bool = True,
    branches: Tensor | None = None,
    shard: RowShard | None = None,
) -> AttentionPlan:
    """Build the plan for ``positions`` (rows, T) with an already-resolved ``backend``.

    ``cu_seqlens`` / ``max_seqlen``: the batch's segment bounds (``Batch.cu_seqlens``, host int32, and
    ``Batch.max_seqlen``), which the collator computed; with them no backend reads the device back
    (varlen copies the bounds over asynchronously, segmented builds its indices on the host). Without
    them (a batch built by hand, generation) the bounds are found from ``positions``.

    ``past_positions`` (rows, S) are the positions already in a KV cache: queries are the new
    tokens, keys are past + new. Decoding always uses an explicit mask (tiny: Tq is 1).

    ``causal`` False: each token attends to every token of its own document (an encoder). The padding
    after a row's last document is then a key its queries could see, so the plain ``causal`` plan (one
    document per row, then padding) is not taken; the padding run is a segment of its own.

    ``shard``: the rows are split over context ranks (``Batch.shard``) and ``positions`` are this rank's
    columns; the plan is then the whole rows' (``shard.positions``, ``shard.cu_seqlens``), which ``attend``
    runs on every layer's heads after exchanging them with the other ranks (``context_attention``).
    """
    if shard is not None:
        assert past_positions is None, "a KV cache does not run split over context ranks"
        positions, cu_seqlens, max_seqlen = shard.positions, shard.cu_seqlens, shard.max_seqlen
    if branches is not None:  # a pair batch with its prompt shared: what keeps the branches apart
        return _pair_plan(positions, backend=backend, cu_seqlens=cu_seqlens, branches=branches)
    plan = _plan(
        positions,
        backend=backend,
        single_doc_rows=single_doc_rows and causal,
        past_positions=past_positions,
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        causal=causal,
    )
    plan.causal = causal
    plan.shard = shard
    return plan


PAIR_BACKENDS = ("flex", "segmented", "masked")  # the kernels that keep a pair's rejected branch from its chosen one


def _pair_plan(positions: Tensor, *, backend: str, cu_seqlens: Tensor | None, branches: Tensor) -> AttentionPlan:
    """The plan of a pair batch whose prompts are laid once (``Batch.pairs.branches``): never the plain causal
    kernel (a row of one pair is still two branches) nor FlashAttention's varlen (no mask of this shape):
    varlen goes to flex on CUDA, else to the segmented path; a caller that picks varlen on purpose lays the
    prompts twice instead (the collator's ``shared``)."""
    if backend == "varlen":
        backend = "flex" if positions.is_cuda and _flex_available() else "segmented"
    host = cu_seqlens if cu_seqlens is not None and cu_seqlens.device.type == "cpu" else None
    plan = AttentionPlan(backend, positions=positions, host_cu_seqlens=host, branches=branches)
    if backend == "segmented":
        plan.segments = segment_plan(positions, cu_seqlens=host, branches=branches)
    elif backend == "masked":
        plan.mask = document_mask(positions, True, branches)
    else:
        plan.block_mask = _flex_mask(plan, None)
    return plan


def _plan(positions, *, backend, single_doc_rows, past_positions, cu_seqlens, max_seqlen, causal) -> AttentionPlan:
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
        mask = document_mask(positions, causal)
        return AttentionPlan("masked", mask=mask, positions=positions, host_cu_seqlens=host)
    if backend == "flex":
        plan = AttentionPlan("flex", positions=positions, host_cu_seqlens=host, causal=causal)
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


def attend(q: Tensor, *, k: Tensor, v: Tensor, plan: AttentionPlan, dropout_p: float = 0.0, opts: AttnOptions = PLAIN) -> Tensor:
    """Attention of q (rows, H, Tq, D) over k, v (rows, Hkv, Tk, D) under ``plan``. (rows, H, Tq, D)

    ``Hkv`` may divide ``H`` (grouped-query attention: key/value heads are shared, not repeated).
    ``opts`` (scale, sliding window, soft-cap) are honoured by every backend; a kernel that cannot
    compute something hands the layer on: varlen (no fp32, no soft-cap, no dropout in FlashAttention's
    varlen kernel, or a keyword this torch's ``varlen_attn`` lacks) to flex with a document block mask on
    CUDA, attention dropout (which flex lacks) to the exact segmented path, whose indices are built once per
    plan. A plan with ``causal`` False (an encoder) makes every backend bidirectional within documents.

    Inside autocast, q, k and v enter the kernel in autocast's dtype: a rotary step computed in the fp32
    residual stream (transformers' RoPE next to fp32 master weights) makes q and k fp32 beside a bf16 v, and
    would otherwise push the layer off FlashAttention. Each call is counted in ``torch_features``' record
    of kernels (``varlen (FlashAttention) bf16``, or the fallback and why) for the run's summary. Under a plan
    with a ``shard`` q, k, v are this rank's columns of rows split over context ranks (``context_attention``)."""
    low = torch_features.autocast_dtype(q.device.type)
    if low is not None:
        q, k, v = (x if x.dtype == low else x.to(low) for x in (q, k, v))
    whole = lambda q, k, v: _dispatch(q, k=k, v=v, plan=plan, dropout_p=dropout_p, opts=opts)  # noqa: E731
    # rows split over context ranks: this rank's columns, exchanged for whole rows of a share of the heads
    out, what = whole(q, k, v) if plan.shard is None else attend_across(q, k, v, plan.shard, whole)
    torch_features.record_kernel(f"{what} {_DTYPE_NAMES.get(q.dtype, str(q.dtype))}")
    return out


_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


def _dispatch(q: Tensor, *, k: Tensor, v: Tensor, plan: AttentionPlan, dropout_p: float, opts: AttnOptions) -> tuple[Tensor, str]:
    """``attend``'s work: the output and what computed it (the kernel's name, then any fallback and why)."""
    if opts.causal != plan.causal:
        opts = dataclasses.replace(opts, causal=plan.causal)
    if plan.backend == "causal":  # whole rows (one document each, or no padding): no document mask needed
        windowed = opts.window is not None and opts.window < q.shape[-2] or opts.softcap
        if windowed and plan.positions is not None:  # per document, not over the padding run too
            return segmented_attention(q, k, v, _segments(plan), dropout_p, opts), "segmented (SDPA by length bucket)"
        return kernel(q, k=k, v=v, mask=None, dropout_p=dropout_p, opts=opts), "causal (SDPA, one document per row)"
    if plan.backend == "masked":
        if q.shape[-2] != k.shape[-2]:  # decoding against a KV cache: the mask already says everything but the window
            mask = plan.mask
            if opts.window is not None:
                Tq, Tk = q.shape[-2], k.shape[-2]
                qi = torch.arange(Tk - Tq, Tk, device=q.device)
                mask = mask & (qi[:, None] - torch.arange(Tk, device=q.device)[None, :] < opts.window)
            return kernel(
                q, k=k, v=v, mask=mask, dropout_p=dropout_p, opts=dataclasses.replace(opts, window=None)
            ), "masked (SDPA, KV cache)"
        return kernel(q, k=k, v=v, mask=plan.mask, dropout_p=dropout_p, opts=opts), "masked (SDPA)"
    if plan.backend == "segmented":
        return segmented_attention(q, k, v, plan.segments, dropout_p, opts), "segmented (SDPA by length bucket)"
    if plan.backend == "flex":
        if dropout_p:  # flex has no attention dropout: the segmented path honours it
            return segmented_attention(q, k, v, _segments(plan), dropout_p, opts), "segmented (flex: attention dropout)"
        return _flex_attention(
            q, k=k, v=v, plan=plan, opts=opts
        ), "flex" if torch_features.varlen() else "flex (this torch has no varlen_attn)"
    if plan.backend == "varlen":
        return _varlen_attention(q, k=k, v=v, plan=plan, dropout_p=dropout_p, opts=opts)
    raise AssertionError(f"unknown plan backend {plan.backend}")


def _varlen_attention(
    q: Tensor, *, k: Tensor, v: Tensor, plan: AttentionPlan, dropout_p: float, opts: AttnOptions
) -> tuple[Tensor, str]:
    """FlashAttention's varlen kernel over the flattened rows, called with the keywords this torch's
    ``varlen_attn`` takes (``torch_features.varlen_call``); what it cannot compute goes to flex (CUDA, no
    dropout) or the exact segmented path, named with the reason."""
    features = torch_features.varlen()
    rows, H, T, D = q.shape
    Hkv = k.shape[1]
    kw, why = None, ""
    if features is None:
        why = "this torch has no varlen_attn"
    elif q.dtype not in (torch.float16, torch.bfloat16):
        why = f"FlashAttention has no {_DTYPE_NAMES.get(q.dtype, q.dtype)}"
    elif opts.softcap:
        why = "FlashAttention's varlen kernel has no soft-cap"
    elif dropout_p:
        why = "varlen_attn has no dropout"
    else:
        kw, why = torch_features.varlen_call(
            features, causal=plan.causal, window=opts.window, scale=opts.scale, head_dim=D, gqa=Hkv != H
        )
    if kw is None:
        if not dropout_p and q.is_cuda and _flex_available():
            return _flex_attention(q, k=k, v=v, plan=plan, opts=opts), f"flex (varlen: {why})"
        return segmented_attention(q, k, v, _segments(plan), dropout_p, opts), f"segmented (varlen: {why})"
    what = "varlen (FlashAttention)"
    if Hkv != H and not features.enable_gqa and not torch_features.varlen_takes_grouped_heads(features.fn, str(q.device)):
        # This release's kernel refuses fewer key/value heads: expanded, exact (each query head reads its group's).
        k, v = (x.repeat_interleave(H // Hkv, dim=1) for x in (k, v))  # (rows, H, T, D)
        Hkv, what = H, "varlen (FlashAttention, key/value heads expanded: this torch's varlen_attn takes no enable_gqa)"
    flat = lambda x, h: x.transpose(1, 2).reshape(rows * T, h, D)  # noqa: E731  (rows*T, h, D)
    out = features.fn(flat(q, H), flat(k, Hkv), flat(v, Hkv), plan.cu_seqlens, plan.cu_seqlens, plan.max_len, plan.max_len, **kw)
    return out.view(rows, T, H, D).transpose(1, 2), what  # (rows, H, T, D)


def _flex_mask(plan: AttentionPlan, window: int | None):
    """The plan's document block mask (causal unless the plan is not; within ``window`` when given), built
    once per window."""
    if window not in plan.flex_masks:
        from torch.nn.attention.flex_attention import create_block_mask

        doc = document_ids(plan.positions)  # (rows, T)

        causal = plan.causal
        br = plan.branches  # a pair batch's branches: rejected never sees chosen

        def same_doc_causal(b, h, q, k):
            if causal:
                ok = (doc[b, q] == doc[b, k]) & (q >= k)
                if br is not None:
                    ok = ok & ~branch_conflict(br[b, q], br[b, k])
                return ok if window is None else ok & (q - k < window)
            ok = doc[b, q] == doc[b, k]
            return ok if window is None else ok & ((q - k).abs() < window)

        rows, T = plan.positions.shape
        pos = plan.positions
        plan.flex_masks[window] = create_block_mask(same_doc_causal, rows, None, T, T, device=pos.device, _compile=pos.is_cuda)
    return plan.flex_masks[window]


def _flex_attention(q: Tensor, *, k: Tensor, v: Tensor, plan: AttentionPlan, opts: AttnOptions) -> Tensor:
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
    gqa = k.shape[1] != q.shape[1]
    return fn(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=opts.scale, **({"enable_gqa": True} if gqa else {}))


def _segments(plan: AttentionPlan) -> SegmentPlan:
    """The plan's segmented indices, built on first use (a backend handing one layer to the segmented path)."""
    if plan.segments is None:
        plan.segments = segment_plan(plan.positions, cu_seqlens=plan.host_cu_seqlens, branches=plan.branches)
    return plan.segments


# What compiled blocks call: attention and its plan stay eager (the plan's Python facts, bucket sizes and
# the longest segment, change every batch; as graph inputs they would recompile every step), and the
# compiled region ends before it and resumes after it.
attend_eagerly = torch.compiler.disable(attend)

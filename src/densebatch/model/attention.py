"""Document-isolating causal attention: one plan per batch from ``positions``, several kernels.

A token may attend to another only when both lie in the same segment (``document_ids``, which
increments at every ``positions == 0``) and the key is not after the query. Backends:

- ``masked``: SDPA with an explicit boolean ``(rows, 1, T, T)`` mask. Exact on every device.
- ``causal``: plain ``is_causal=True`` SDPA, chosen only when every row is one document followed
  by padding (the caller vouches for that with ``single_doc_rows``). Exact for the real tokens
  because padding comes after them; padding outputs differ but carry no loss and no gradient.
- ``flex``: ``flex_attention`` with a block mask of the document ids (compiled on CUDA). On CPU
  torch 2.13 runs it forward-only and unfused, so it is never picked there when gradients flow.
- ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` on the flattened rows (FlashAttention;
  CUDA and fp16/bf16 only).

``auto`` picks varlen, then flex, then masked on CUDA; masked on CPU (flex there is forward-only and
unfused: about 2x slower than masked even for inference). Measured on 2 shared CPU cores, torch 2.13,
reference GPT with 4 layers, width 256, forward+backward of 8x1024 rows: packed rows with masked
~2.2 s; single-document rows on the causal path ~1.8 s (masked on the same rows ~2.1 s).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor

from densebatch.batch import IGNORE_INDEX, Batch, document_ids
from densebatch.errors import ConfigError

BACKENDS = ("auto", "flex", "varlen", "masked")


def document_mask(positions: Tensor) -> Tensor:
    """Same-segment and causal: ``mask[r, 0, q, k]`` is True where q may attend to k. (rows, 1, T, T)"""
    doc = document_ids(positions)  # (rows, T)
    T = positions.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=positions.device).tril()  # (T, T)
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]  # (rows, 1, T, T)


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
        return fused + ["masked"]
    # CPU (and others): flex is forward-only and unfused here (slower than masked SDPA), so it is
    # offered only for inference and never chosen by auto.
    return ["masked"] + (["flex"] if _flex_available() and not training else [])


def resolve_backend(name: str, device: torch.device | str, training: bool = True) -> str:
    """Turn a configured backend (``auto`` included) into one that runs here, or raise ConfigError."""
    if name not in BACKENDS:
        raise ConfigError(f"model.attention: expected one of {', '.join(BACKENDS)}; got {name!r}")
    avail = available_backends(device, training)
    if name == "auto":
        return avail[0]
    if name not in avail:
        why = {
            "flex": "flex_attention has no backward pass on CPU in this torch",
            "varlen": "varlen_attn needs CUDA (FlashAttention) and torch >= 2.9",
        }.get(name, "")
        raise ConfigError(
            f"model.attention: {name!r} cannot run on {torch.device(device).type} here ({why}); "
            f"use one of {', '.join(['auto'] + avail)}"
        )
    return name


@dataclass
class AttentionPlan:
    """What every layer needs to attend within documents; built once per forward."""

    backend: str  # masked | causal | flex | varlen
    mask: Tensor | None = None  # masked: (rows, 1, Tq, Tk) bool
    block_mask: object | None = None  # flex: BlockMask
    cu_seqlens: Tensor | None = None  # varlen: (segments + 1,) int32 over the flattened rows
    max_len: int = 0  # varlen: longest segment
    positions: Tensor | None = None  # varlen: kept for the fp32 fallback


def plan_attention(
    positions: Tensor, backend: str, single_doc_rows: bool = False, past_positions: Tensor | None = None
) -> AttentionPlan:
    """Build the plan for ``positions`` (rows, T) with an already-resolved ``backend``.

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
        return AttentionPlan("masked", mask=(same & (k_idx[None, :] <= q_idx[:, None]))[:, None])
    if single_doc_rows and backend != "varlen":
        return AttentionPlan("causal")
    if backend == "masked":
        return AttentionPlan("masked", mask=document_mask(positions))
    if backend == "flex":
        from torch.nn.attention.flex_attention import create_block_mask

        doc = document_ids(positions)  # (rows, T)

        def same_doc_causal(b, h, q, k):
            return (doc[b, q] == doc[b, k]) & (q >= k)

        rows, T = positions.shape
        block_mask = create_block_mask(
            same_doc_causal, rows, None, T, T, device=positions.device, _compile=positions.is_cuda
        )
        return AttentionPlan("flex", block_mask=block_mask)
    if backend == "varlen":
        flat = positions.reshape(-1)  # (rows * T,)
        # Every row boundary is a segment boundary too: a row starts with position 0.
        starts = torch.nonzero(flat == 0).flatten().to(torch.int32)
        total = torch.tensor([flat.numel()], dtype=torch.int32, device=flat.device)
        cu = torch.cat([starts, total])  # (segments + 1,)
        return AttentionPlan("varlen", cu_seqlens=cu, max_len=int((cu[1:] - cu[:-1]).max()), positions=positions)
    raise AssertionError(f"unresolved backend {backend}")


def attend(q: Tensor, k: Tensor, v: Tensor, plan: AttentionPlan, dropout_p: float = 0.0) -> Tensor:
    """Attention of q (rows, H, Tq, D) over k, v (rows, H, Tk, D) under ``plan``. (rows, H, Tq, D)"""
    if plan.backend == "causal":
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    if plan.backend == "masked":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=plan.mask, dropout_p=dropout_p)
    if plan.backend == "flex":
        # Flex has no dropout; attention dropout is skipped there (residual dropout still applies).
        if q.is_cuda:
            return _compiled_flex()(q, k, v, block_mask=plan.block_mask)
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q, k, v, block_mask=plan.block_mask)
    if plan.backend == "varlen":
        if q.dtype not in (torch.float16, torch.bfloat16):
            # FlashAttention has no fp32 kernel: use the exact masked path (mask built once per plan).
            if plan.mask is None:
                plan.mask = document_mask(plan.positions)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=plan.mask, dropout_p=dropout_p)
        rows, H, T, D = q.shape
        flat = lambda x: x.transpose(1, 2).reshape(rows * T, H, D)  # noqa: E731  (rows*T, H, D)
        out = _varlen_fn()(
            flat(q), flat(k), flat(v), plan.cu_seqlens, plan.cu_seqlens, plan.max_len, plan.max_len,
            window_size=(-1, 0),  # (-1, 0) = causal in varlen_attn
        )
        return out.view(rows, T, H, D).transpose(1, 2)  # (rows, H, T, D)
    raise AssertionError(f"unknown plan backend {plan.backend}")

"""Attention over one block of sequences: causal SDPA with what a layer may ask for besides.

``kernel(q, *, k, v, mask, dropout_p, opts)`` is what every densebatch attention path ends in for a set of
equally long sequences (a bucket of documents, rows of one document, a masked row): grouped-query
key/values shared through SDPA's ``enable_gqa`` (never repeated), a sliding window drawn into an (L, L)
mask, a scale, and soft-capped scores (Gemma 2), which SDPA cannot compute, done explicitly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from densebatch import torch_features


def kernel(q: Tensor, *, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float, opts: AttnOptions) -> Tensor:
    """Causal attention of q (n, H, L, D) over k, v (n, Hkv, L, D) (``mask``, if given, replaces the
    causal one: (.., L, L) bool, True = may attend), with ``opts``' scale, window and soft-cap. (n, H, L, D)
    ``opts.causal`` False (an encoder): every query sees every key the mask allows; a window is then
    symmetric (``|q - k| < window``).

    SDPA where it can (grouped-query heads through ``enable_gqa``, never repeated); soft-capped scores
    are computed explicitly (SDPA cannot cap), which is O(L^2) per call like SDPA's math kernel."""
    L = q.shape[-2]
    if opts.window is not None and opts.window < L:
        idx = torch.arange(L, device=q.device)
        dist = idx[:, None] - idx[None, :]  # (L, L) q - k
        band = (dist >= 0) & (dist < opts.window) if opts.causal else dist.abs() < opts.window  # as transformers' overlays
        mask = band if mask is None else mask & band
    if opts.softcap:
        return capped_attention(q, k=k, v=v, mask=mask, dropout_p=dropout_p, opts=opts)
    gqa = {}
    if k.shape[1] != q.shape[1]:  # grouped heads: shared by SDPA where it takes enable_gqa, else repeated (exact)
        if torch_features.sdpa_gqa():
            gqa = {"enable_gqa": True}
        else:
            k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))  # (n, H, L, D)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=opts.causal, scale=opts.scale, **gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=opts.scale, **gqa)


def capped_attention(q: Tensor, *, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float, opts: AttnOptions) -> Tensor:
    """Attention with soft-capped scores (Gemma 2: ``cap * tanh(s / cap)``), softmax in float32. (n, H, L, D)"""
    n, H, L, D = q.shape
    G = H // k.shape[1]  # query heads per key/value head
    qg = q.view(n, k.shape[1], G, L, D)  # (n, Hkv, G, L, D): no copy of k, v per query head
    scale = opts.scale if opts.scale is not None else 1.0 / math.sqrt(D)
    s = (qg @ k.unsqueeze(2).transpose(-1, -2)).float() * scale  # (n, Hkv, G, L, L)
    s = torch.tanh(s / opts.softcap) * opts.softcap
    if mask is None:
        mask = torch.ones(L, L, dtype=torch.bool, device=q.device)
        mask = mask.tril() if opts.causal else mask
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
    causal: bool = True  # False: an encoder's bidirectional attention (within documents all the same)


PLAIN = AttnOptions()

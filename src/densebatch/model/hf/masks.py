"""The 4-D document masks the Hugging Face adapter hands transformers' own kernels (``sdpa``, ``eager``).

``model/hf/adapter.py`` passes no mask at all under ``attn_implementation: densebatch``; under ``sdpa`` and
``eager`` transformers uses a 4-D mask as given, for every layer. So the mask says everything: the
documents (a query sees only keys of its own document), causality (not for an encoder, whose queries
see their whole document), and each layer type's sliding window (``q - k < window`` for a decoder,
``|q - k| <= window`` for an encoder, as transformers' own overlays draw ``config.sliding_window``), one mask per layer type when the
layers differ (``{"full_attention": ..., "sliding_attention": ...}``, which transformers' Gemma 2,
Qwen2/3 and ModernBERT accept in place of a tensor).
"""

from __future__ import annotations

import torch
from torch import Tensor

from densebatch.model.attention import document_mask


def hf_document_mask(
    positions: Tensor,
    *,
    windows: dict[str, int | None],
    how: str,
    dtype: torch.dtype,
    causal: bool = True,
    branches: Tensor | None = None,
) -> Tensor | dict[str, Tensor]:
    """The document mask of ``positions`` (rows, T) as (rows, 1, T, T): boolean (``how`` "bool": True may
    attend) or additive (``how`` "additive": 0 or the dtype's minimum, in ``dtype``, the hidden states'
    dtype outside autocast: eager adds the mask to the scores); per layer type of ``windows``; with a pair
    batch's ``branches``, no rejected-branch query sees a chosen-branch key."""
    mask = document_mask(positions, causal, branches)  # (rows, 1, T, T) bool
    T = positions.shape[-1]
    out = {}
    for layer_type, window in windows.items():
        m = mask
        if window is not None and window < T:
            q = torch.arange(T, device=mask.device)
            dist = q[:, None] - q[None, :]  # (T, T) q - k
            m = mask & (dist < window if causal else dist.abs() <= window)
        out[layer_type] = m if how == "bool" else _additive(m, dtype)
    return out if len(out) > 1 else next(iter(out.values()))


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)

"""densebatch's document attention as a transformers attention implementation (``"densebatch"``).

transformers (>= 4.48, 5.x) looks every layer's attention function up by name in
``AttentionInterface`` and calls it as ``fn(module, query, key, value, attention_mask, *, dropout,
scaling, sliding_window, softcap, **kwargs)`` with query (rows, H, T, D) and key/value
(rows, Hkv, T, D), expecting (rows, T, H, D) back. Keywords given to the model's ``forward`` reach it
unchanged, so the adapter passes the batch's ``AttentionPlan`` as ``densebatch_plan`` and this
function runs ``attention.attend`` on it, with the layer's own scale, window and soft-cap. For a name
it has no mask function for, transformers builds no mask at all (``masking_utils``: "custom attention
without equivalent mask creation"), so no T x T tensor exists anywhere in the forward.

A few architectures drop unknown keywords on the way down (StableLM in transformers 5.24): for them
the plan is also published in ``_ACTIVE`` while the adapter's forward runs, and kept as the last plan
for the backward pass's recomputation under activation checkpointing (which runs before the next
forward). A call with no plan at all comes from code that runs the transformers model directly (its
own ``generate``): it gets what transformers' SDPA computes without a mask (causal attention over one
unpadded sequence; the last queries of a KV cache see every key), since densebatch registers no mask
function for transformers to build T x T masks with.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from densebatch.model.attention import AttentionPlan, AttnOptions, attend_eagerly, pick_backend, plan_attention

NAME = "densebatch"
PLAN_KEY = "densebatch_plan"


class _Active:
    plan: AttentionPlan | None = None  # the plan of the adapter's forward now running
    last: AttentionPlan | None = None  # the plan of the latest forward (for its backward's recomputation)
    from_kwargs: tuple | None = None  # (key, plan) of the latest plan built from packed-row keywords


_ACTIVE = _Active()


@contextmanager
def planned(plan: AttentionPlan, **inputs) -> Iterator[dict]:
    """The model's keyword inputs with ``plan`` attached, and the plan published for models that drop it."""
    _ACTIVE.plan = _ACTIVE.last = plan
    try:
        yield {**inputs, PLAN_KEY: plan}
    finally:
        _ACTIVE.plan = None


def densebatch_attention(
    module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """Attention within documents for one layer: causal, or bidirectional for an encoder's layer (its
    ``is_causal`` False). Returns ((rows, T, H, D), no weights)."""
    causal = bool(getattr(module, "is_causal", True))
    plan = kwargs.get(PLAN_KEY) or _ACTIVE.plan or _plan_from_packed(query, kwargs, causal)
    if plan is None and torch._C._current_graph_task_id() != -1:  # recomputed in a backward pass
        plan = _ACTIVE.last
    opts = AttnOptions(scale=scaling, window=sliding_window or None, softcap=softcap or None, causal=causal)
    if plan is None:  # the transformers model run directly: one unpadded sequence per row
        Tq, Tk = query.shape[-2], key.shape[-2]
        if Tq == Tk:
            plan = AttentionPlan("causal", causal=causal)
        else:  # queries are the last Tq of Tk positions (a KV cache)
            q_at = torch.arange(Tk - Tq, Tk, device=query.device)
            plan = AttentionPlan("masked", mask=(torch.arange(Tk, device=query.device)[None, :] <= q_at[:, None]))
    if plan.causal != causal:
        raise AssertionError(f"a {'causal' if plan.causal else 'bidirectional'} attention plan reached a layer that is not")
    out = attend_eagerly(query, k=key, v=value, plan=plan, dropout_p=dropout, opts=opts)  # (rows, H, T, D)
    return out.transpose(1, 2), None


def _plan_from_packed(query: Tensor, kwargs: dict, causal: bool = True) -> AttentionPlan | None:
    """A plan from the keywords a model is given for packed rows, so a plain transformers model (``Trainer``,
    a user's loop) keeps documents apart on any device: ``cu_seq_lens_q`` with ``position_ids`` (densebatch's
    ``dataloader``, transformers' ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``), or
    ``position_ids`` alone whose positions restart at 0 within a row (a document starts at every 0, as
    transformers' flash path reads them). Built once per forward (every layer gets the same tensors).
    None when there is nothing to keep apart: no positions, or one sequence per row."""
    cu, pos = kwargs.get("cu_seq_lens_q"), kwargs.get("position_ids")
    if pos is None or pos.shape[-1] != query.shape[-2]:
        return None
    rows = query.shape[0]
    given = pos
    # The same tensor objects (not just the same memory: a device allocator hands freed blocks to the next
    # batch), unchanged, in the same grad mode: every layer of one forward gets them.
    grad = torch.is_grad_enabled()
    cached = _ACTIVE.from_kwargs
    stamp = (None if cu is None else cu._version, given._version, rows, grad, causal)
    if cached is not None and cached[1]() is given and cached[2] == stamp:
        if (cached[0] is None) if cu is None else (cached[0] is not None and cached[0]() is cu):
            return cached[3]
    pos = pos.reshape(-1, pos.shape[-1]).expand(rows, -1) if pos.numel() != rows * pos.shape[-1] else pos.reshape(rows, -1)
    plan = None
    if cu is not None or bool((pos[:, 1:] == 0).any()):  # without bounds: only rows that hold several documents
        backend = pick_backend("auto", query.device, grad, pos.shape[-1])
        longest = kwargs.get("max_length_q")
        bounds = None if cu is None else cu.to("cpu", torch.int32)
        plan = plan_attention(
            pos, backend=backend, cu_seqlens=bounds, max_seqlen=None if longest is None else int(longest), causal=causal
        )
    _ACTIVE.from_kwargs = (None if cu is None else weakref.ref(cu), weakref.ref(given), stamp, plan)
    return plan


def register() -> None:
    """Make ``attn_implementation="densebatch"`` known to transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, densebatch_attention)

"""Autoregressive decoding (greedy or sampled) for any densebatch model, one prompt or many at once.

Batched prompts are left-padded, and the padding is its own segment (positions restart at 0 at the
prompt), so the document-isolating attention hides it: a prompt decodes exactly as it would alone.
Models with ``init_kv_cache`` (the reference GPT) decode one token per step from a KV cache; others
rerun the whole sequence each step. Measured: reference GPT (4 layers, width 128), 200 prompts of
~60 tokens, 64 new tokens each, 2 CPU cores: see tests/model/test_generate.py::test_batch_speed.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch import Tensor

from densebatch.errors import UserError


def _pick(logits: Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None) -> Tensor:
    """Next token per row from last-position logits (rows, vocab). (rows,)"""
    if temperature <= 0.0:
        return logits.argmax(dim=-1)
    # Shifted so the largest logit is 0 before the division, by a temperature no smaller than float32 holds: a tiny
    # temperature then sends the others to -inf (the most likely token is sampled) instead of every logit to +-inf
    # or 0/0 (NaN probabilities). Softmax is shift-invariant: the distribution is the same.
    logits = logits.float()
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / max(temperature, torch.finfo(torch.float32).tiny)
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (rows, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def check_sampling(
    temperature: float, top_k: int | None, names: tuple[str, str] = ("generate: temperature", "generate: top_k")
) -> None:
    """``UserError`` (naming ``names``: the arguments as the caller spells them) unless ``temperature`` is a
    finite number >= 0 and ``top_k`` is None or a positive integer."""
    if not (math.isfinite(temperature) and temperature >= 0.0):
        raise UserError(f"{names[0]}: expected a finite number >= 0 (0 = greedy); got {temperature}")
    if top_k is not None and top_k < 1:
        raise UserError(f"{names[1]}: expected a positive integer (sample among the k most likely tokens); got {top_k}")


@torch.no_grad()
def generate_batch(
    model: nn.Module,
    prompts: list[list[int]] | list[Tensor],
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_id: int | None = None,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    pad_id: int = 0,
) -> list[list[int]]:
    """New tokens for every prompt (the prompt and the end-of-text itself are not included).

    ``temperature=0`` is greedy (deterministic). Decoding of a row stops at ``eos_id``; the whole
    batch stops when every row has stopped or after ``max_new_tokens``, or when the longest row
    reaches the model's context length.
    """
    check_sampling(temperature, top_k)
    prompts = [p.tolist() if isinstance(p, Tensor) else list(p) for p in prompts]
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise UserError("generate: every prompt needs at least one token")
    device = next(model.parameters()).device
    longest = max(len(p) for p in prompts)
    limit = getattr(model, "max_positions", None)
    if limit is not None:
        if longest >= limit:
            raise UserError(f"generate: a prompt has {longest} tokens but the model's context is {limit}")
        max_new_tokens = min(max_new_tokens, limit - longest)
    rows = len(prompts)
    ids = torch.full((rows, longest), pad_id, dtype=torch.int64)  # (rows, L) left-padded
    pos = torch.zeros((rows, longest), dtype=torch.int64)  # (rows, L)
    for r, p in enumerate(prompts):
        pad = longest - len(p)
        ids[r, pad:] = torch.tensor(p)
        pos[r, :pad] = torch.arange(pad)  # the padding segment ...
        pos[r, pad:] = torch.arange(len(p))  # ... then the prompt, starting again at 0
    ids, pos = ids.to(device), pos.to(device)
    next_pos = torch.tensor([len(p) for p in prompts], device=device)  # (rows,)

    was_training = model.training
    model.eval()
    cache = model.init_kv_cache() if hasattr(model, "init_kv_cache") else None
    try:
        logits = model(ids, pos, cache=cache) if cache is not None else model(ids, pos)
        out = torch.empty((rows, 0), dtype=torch.int64, device=device)  # (rows, steps)
        done = torch.zeros(rows, dtype=torch.bool, device=device)
        for step in range(max_new_tokens):
            tok = _pick(logits[:, -1], temperature, top_k, generator)  # (rows,)
            if eos_id is not None:
                tok = torch.where(done, torch.full_like(tok, eos_id), tok)
                done |= tok == eos_id
            out = torch.cat([out, tok[:, None]], dim=1)
            if step == max_new_tokens - 1 or bool(done.all()):
                break
            if cache is not None:
                logits = model(tok[:, None], next_pos[:, None], cache=cache)  # (rows, 1, vocab)
            else:
                ids = torch.cat([ids, tok[:, None]], dim=1)
                pos = torch.cat([pos, next_pos[:, None]], dim=1)
                logits = model(ids, pos)
            next_pos = next_pos + 1
    finally:
        model.train(was_training)
    result = []
    for row in out.tolist():
        if eos_id is not None and eos_id in row:
            row = row[: row.index(eos_id)]
        result.append(row)
    return result


def generate(
    model: nn.Module,
    prompt_ids: list[int] | Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_id: int | None = None,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """New tokens after ``prompt_ids`` (greedy when ``temperature == 0``), stopping at ``eos_id``."""
    if isinstance(prompt_ids, Tensor):
        prompt_ids = prompt_ids.flatten().tolist()
    return generate_batch(model, [prompt_ids], max_new_tokens, temperature, eos_id, top_k, generator)[0]

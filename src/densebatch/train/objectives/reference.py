"""The reference model of DPO: the starting weights, as summed log-probabilities of each pair's answers.

``train.reference``:

- ``live``: the reference runs beside the policy, on the same batch, in eval mode without gradients. A
  full model keeps a frozen copy of its starting weights (``LiveReference``); a LoRA model has none to
  keep: its base model with the adapters switched off is the starting weights (``adapters_off``).
- ``precompute``: ``reference_table`` scores every pair once before training, and the collator hands each
  batch its pairs' values (``Batch.pairs.reference``); ``run/`` stores the table beside the prepared pairs,
  keyed by the weights (``weights_key``), so other weights never reuse it.

Either way a pair's values are what the model gave it before its first update, computed through the same
layout, attention and precision as the policy's.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext

import numpy as np
import torch
from torch import Tensor, nn

from densebatch.batch import Batch
from densebatch.train.objectives.pair_logps import pair_logps
from densebatch.train.precision import autocast, to_device


def adapters_off(model: nn.Module) -> AbstractContextManager:
    """A context in which ``model`` (an ``HFCausalLM`` under LoRA) runs its base weights: PEFT's
    ``disable_adapter``; a model without adapters runs as it is."""
    if getattr(model, "lora", False):
        return model.hf.disable_adapter()
    return nullcontext()


class LiveReference:
    """The starting weights, computed beside the policy: a frozen copy, or the LoRA base with adapters off."""

    def __init__(self, model: nn.Module):
        self.lora = bool(getattr(model, "lora", False))
        if self.lora:
            self.model = model  # the base, when its adapters are off: no second copy
        else:
            self.model = copy.deepcopy(model).eval()
            for p in self.model.parameters():
                p.requires_grad_(False)

    @torch.no_grad()
    def logps(self, batch: Batch) -> Tensor:
        """(pairs, 2) the starting weights' summed log-probabilities of ``batch``'s answers (on its device)."""
        was = self.model.training
        self.model.eval()
        try:
            with adapters_off(self.model) if self.lora else nullcontext():
                losses = self.model.token_losses(batch)
        finally:
            self.model.train(was)
        return pair_logps(losses, batch).sums


def reference_of(batch: Batch, live: LiveReference | None) -> Tensor:
    """The reference's values for ``batch``: precomputed (``Batch.pairs.reference``), or from ``live``."""
    if batch.pairs is not None and batch.pairs.reference is not None:
        return batch.pairs.reference
    if live is None:
        raise AssertionError("dpo: the batch carries no reference values and there is no live reference")
    return live.logps(batch)


@torch.no_grad()
def reference_table(
    model: nn.Module,
    batches: Iterable[Batch],
    *,
    num_pairs: int,
    device: torch.device,
    precision: str = "fp32",
    all_reduce_sum: Callable[[Tensor], Tensor] | None = None,
) -> np.ndarray:
    """(num_pairs, 2) float64: each stored pair's summed log-probabilities of (chosen, rejected) under ``model``
    (eval mode, adapters off), from ``batches`` (this rank's share of them: ``all_reduce_sum`` adds the
    ranks' tables; a pair is scored by one rank)."""
    table = torch.zeros((num_pairs, 2), dtype=torch.float64, device=device)
    was = model.training
    model.eval()
    try:
        with adapters_off(model):
            for batch in batches:
                if batch.pairs is None or batch.pairs.count == 0:
                    continue
                batch = to_device(batch, device)
                with autocast(device, precision):
                    losses = model.token_losses(batch)
                ids = torch.tensor(batch.pairs.ids, dtype=torch.int64, device=device)
                table.index_add_(0, ids, pair_logps(losses, batch).sums.double())
    finally:
        model.train(was)
    if all_reduce_sum is not None:
        table = all_reduce_sum(table)
    return table.cpu().numpy()


def weights_key(model: nn.Module, extra: str = "", gather: Callable[[str], list] | None = None) -> str:
    """A digest of ``model``'s weights (every parameter and buffer by name, dtype, shape and bytes) and ``extra``
    (what else changes the values: precision); under FSDP each rank digests its shards and ``gather`` (every
    rank's digest, in rank order) joins them."""
    h = hashlib.sha256(extra.encode())
    for name, t in sorted(model.state_dict().items()):
        local = t.to_local() if hasattr(t, "to_local") else t
        h.update(f"{name}:{local.dtype}:{tuple(local.shape)}".encode())
        h.update(local.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes())
    digest = h.hexdigest()
    if gather is not None:
        digest = hashlib.sha256("".join(gather(digest)).encode()).hexdigest()
    return digest[:24]

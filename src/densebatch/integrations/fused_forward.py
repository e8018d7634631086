"""One training forward of a Hugging Face causal LM that answers per-token losses through densebatch's fused head, leaving nothing on the model.

``token_losses(model, lm, head, inputs, targets)`` calls ``model`` (what the trainer hands ``compute_loss``:
DDP's wrapper, PEFT's ``PeftModel``, a compiled module, or ``lm`` itself) so that DDP's gradient hooks,
LoRA adapters, gradient checkpointing and compilation run as in any forward. For that one call, ``lm``'s
``forward`` (``lm``: the transformers causal LM inside ``model``) is a method that runs the backbone
(``lm.base_model``: its last hidden states, never the logits) and densebatch's fused, chunked head
(``model/loss_head.py``) against ``targets``, and returns the per-token losses (rows, T) float32, 0 where the
target is -100, each times its token weight when given (inside the head: its backward then recomputes
nothing). When the call returns, or raises, ``lm``'s own ``forward`` is back (an instance attribute another
library had set, such as accelerate's mixed-precision wrapper, is put back as it was): between calls the
model holds nothing of densebatch, so ``copy.deepcopy``, ``pickle``, ``torch.save``, ``generate`` and a
reference or EMA copy made at any time see the model's own forward and their own weights.

The method is bound to ``lm`` and answers to keywords that travel through the wrappers (``densebatch_head``,
``densebatch_targets``, ``densebatch_weights``), the same function every call, so a compiled model compiles
the fused forward once. The caller runs it under the autocast the replaced wrapper would have applied
(``accelerator.autocast()`` in ``hf_loss.py``).
"""

from __future__ import annotations

import types
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn

from densebatch.model.loss_head import chunk_tokens_for, head_token_losses

_ABSENT = object()
# Keywords the trainer's batch or the wrappers may pass that the backbone does not take, or that would make it
# build what the fused head replaces (the labels' loss, a cache).
_NOT_FOR_THE_BACKBONE = ("labels", "shift_labels", "num_items_in_batch", "logits_to_keep", "fused_lm_head", "return_dict")


@dataclass(frozen=True)
class FusedHead:
    """How the fused head computes one architecture's logits and loss: positions projected at a time
    (``chunk``), the logit scale of Cohere / Granite (``scale``), the final-logit soft-cap of Gemma 2 / 3
    (``cap``), label smoothing (``smoothing``)."""

    chunk: int
    scale: float = 1.0
    cap: float | None = None
    smoothing: float = 0.0

    @classmethod
    def of(cls, lm: nn.Module, chunk_tokens: int | None, device) -> FusedHead:
        """The head of ``lm`` (a checked causal LM, ``hf_loss.refusal``): ``chunk_tokens``, else 128 MiB of
        float32 logits (1 GiB on CUDA)."""
        text = lm.config.get_text_config()
        chunk = chunk_tokens or chunk_tokens_for(lm.get_output_embeddings().weight.shape[0], device=device)
        return cls(int(chunk), logit_scale(text), getattr(text, "final_logit_softcapping", None))


def logit_scale(text_config) -> float:
    """The constant the architecture multiplies its logits by: Cohere's ``logit_scale``, Granite's
    ``1 / logits_scaling``; 1.0 elsewhere."""
    kind = getattr(text_config, "model_type", None)
    if kind == "cohere":
        return float(getattr(text_config, "logit_scale", 1.0) or 1.0)
    if kind == "granite":
        return 1.0 / float(getattr(text_config, "logits_scaling", 1.0) or 1.0)
    return 1.0


def token_losses(
    model: nn.Module, lm: nn.Module, head: FusedHead, inputs: dict, targets: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """(rows, T) float32: ``model(**inputs)`` with ``lm``'s forward answering the per-token losses against
    ``targets`` (rows, T), times ``weights`` (rows, T) when given (module docstring)."""
    with _answering_losses(lm):
        out = model(**inputs, densebatch_head=head, densebatch_targets=targets, densebatch_weights=weights)
    if not isinstance(out, torch.Tensor) or out.shape != targets.shape:
        raise RuntimeError(
            f"dense_batches: the trainer's model ({type(model).__name__}) did not reach the forward of "
            f"{type(lm).__name__}: pass loss='hf'"
        )
    return out


@contextmanager
def _answering_losses(lm: nn.Module):
    own = lm.__dict__.get("forward", _ABSENT)  # an instance attribute another library set, or none
    lm.forward = types.MethodType(_fused_forward, lm)
    try:
        yield
    finally:
        if own is _ABSENT:
            del lm.forward
        else:
            lm.forward = own


def _fused_forward(self, *args, densebatch_head: FusedHead, densebatch_targets, densebatch_weights=None, **kwargs):
    """``self``'s forward for one call of ``token_losses``: the backbone's last hidden states through the fused head."""
    for k in _NOT_FOR_THE_BACKBONE:
        kwargs.pop(k, None)
    kwargs["use_cache"] = False
    h = self.base_model(*args, **kwargs).last_hidden_state  # (rows, T, C): no logits
    out, hd = self.get_output_embeddings(), densebatch_head
    weights = None if densebatch_weights is None else densebatch_weights.to(h.device)
    return head_token_losses(
        h, densebatch_targets.to(h.device), out.weight, out.bias, chunk_tokens=hd.chunk, label_smoothing=hd.smoothing,
        token_weights=weights, logit_scale=hd.scale, softcap=hd.cap,
    )  # fmt: skip

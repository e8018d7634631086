"""densebatch's loss path inside Hugging Face ``Trainer`` and TRL's ``SFTTrainer``: the ``compute_loss`` that
``dense_batches(trainer)`` installs, or why the trainer's own loss is kept.

During training the trainer's ``compute_loss`` asks the model for per-token losses instead of logits
(``fused_forward.py``): the causal LM's backbone gives its last hidden states (the logits are never built)
and densebatch's fused, chunked head (``model/loss_head.py``) turns them into cross-entropies against the
batch's ``shift_labels`` through the output embedding (tied or not, its bias when it has one, the logit
scale of Cohere / Granite, the final-logit soft-capping of Gemma 2 / 3). At most ``chunk x vocabulary``
logits exist at once (twice that when soft-capped), in forward and backward. The call goes through the
model the trainer hands ``compute_loss`` (DDP's wrapper, PEFT's ``PeftModel``, a compiled module), under
the trainer's mixed-precision autocast, so DDP's gradient hooks, LoRA adapters and gradient checkpointing
run as in any forward; the model's own ``forward`` is back when the call returns (``generate``,
evaluation, copies of the model).

The loss is ``sum(CE) / n`` with ``n`` the step's loss tokens over every micro-batch and rank, as
densebatch's own loop normalises, times the number of processes (DDP averages the gradients). ``n`` is the
trainer's ``num_items_in_batch`` (transformers 5 counts ``shift_labels`` over the accumulated batches and,
with ``average_tokens_across_devices``, sums over ranks); where the trainer leaves it out (a model without
loss keywords) or counts one rank only, ``get_batch_samples`` counts it the same way.
Evaluation, prediction (``return_outputs``) and a batch without labels keep the trainer's own loss.
With source weights (``dense_batches(source_column=...)``: the batches carry each token's source) the loss
is ``sum(w[source] x CE) / sum(w[source])`` over the step's loss tokens, micro-batches and ranks, as
densebatch's loop weighs them (``train/per_source.py``); the logged loss is that weighted mean.

Refused, in one logged line, with the trainer's loss kept, where the fused head could not be exact or
would bypass something: ``loss="hf"``; a trainer class whose ``compute_loss`` is its own; a
``compute_loss_func``; TRL's non-``nll`` losses or MoE auxiliary loss; an architecture whose logits are not
known to be the head over the last hidden state (``SUPPORTED``); a head that is not a plain ``nn.Linear``
(LoRA or trainable tokens on it); DataParallel, tensor / sequence / context parallelism, FSDP and DeepSpeed
(whose sharded head weights this path would read directly).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from densebatch.batch import IGNORE_INDEX
from densebatch.data.torch_loader import SOURCE_KEY
from densebatch.integrations.fused_forward import FusedHead, token_losses
from densebatch.integrations.installed import LINE, Installed, installed
from densebatch.model.hf.adapter import HIDDEN_PATH_TYPES

LOSSES = ("densebatch", "hf")
# The architectures of densebatch's own hidden-state path (model/hf/adapter.py, checked against each model's own
# logits by tests/model/test_hf_architectures.py), two whose logits are the head's times a constant and two
# that soft-cap them (final_logit_softcapping), which the fused head computes as they do.
SUPPORTED = frozenset(HIDDEN_PATH_TYPES | {"cohere", "granite", "gemma2", "gemma3_text"})
# Trainer classes whose compute_loss this module replaces (a subclass with its own keeps it).
_OWN_LOSS = {("transformers.trainer", "Trainer"), ("trl.trainer.sft_trainer", "SFTTrainer")}

logger = logging.getLogger("densebatch.integrations")


@dataclass
class LossPath:
    """The trainer's loss path: the line it logs once at its first training step; the fused head (None: the
    trainer's own loss is kept, ``line`` says why); each source's weight (float64), and the step's summed
    weight over its loss tokens on every rank (``get_batch_samples`` sets it)."""

    line: str
    head: FusedHead | None = None
    source_weights: torch.Tensor | None = None
    weight_n: torch.Tensor | None = None
    logged: bool = False


def plan_loss(trainer, loss: str = "densebatch", chunk_tokens: int | None = None, source_weights=None) -> LossPath:
    """The loss path ``trainer`` would get (``loss="densebatch"``: the fused head, where ``refusal`` allows it;
    ``"hf"``: its own), changing nothing; ``ValueError`` for another ``loss``. ``source_weights``: one weight
    per source, for batches that carry their tokens' sources (the fused path only)."""
    if loss not in LOSSES:
        raise ValueError(f"dense_batches: loss: expected one of {', '.join(LOSSES)}; got {loss!r}")
    lm = _causal_lm(trainer.model)
    why = "loss='hf'" if loss == "hf" else refusal(trainer, lm)
    if why is not None:
        return LossPath(f"Hugging Face loss ({why})")
    head = FusedHead.of(lm, chunk_tokens, trainer.args.device)
    line = f"densebatch fused head, chunk {head.chunk}"
    if source_weights is None:
        return LossPath(line, head)
    line += ", sources weighted " + ", ".join(f"{w:.2f}" for w in source_weights)
    return LossPath(line, head, torch.tensor(source_weights, dtype=torch.float64))


def install_loss(trainer, path: LossPath, into: Installed) -> None:
    """Give ``trainer`` the loss path ``path`` (``plan_loss``), every attribute recorded in ``into``; the line
    is also kept as ``trainer.densebatch_loss``."""
    into.loss = path
    into.bind(trainer, "compute_loss", _compute_loss)
    if path.head is not None:
        into.bind(trainer, "get_batch_samples", _get_batch_samples)
        into.set(trainer, "loss_is_scaled_for_ga", True)  # normalised by the step's loss tokens: no division by accumulation
    setattr(trainer, LINE, path.line)


def refusal(trainer, lm: nn.Module) -> str | None:
    """Why the fused head cannot stand in for ``trainer``'s loss on ``lm`` exactly (one line), or None."""
    cls = next(c for c in type(trainer).__mro__ if "compute_loss" in vars(c))
    if (cls.__module__, cls.__name__) not in _OWN_LOSS:
        return f"{cls.__name__} overrides compute_loss: its loss is kept"
    args = trainer.args
    if getattr(trainer, "compute_loss_func", None) is not None:
        return "the trainer has a compute_loss_func"
    if getattr(args, "loss_type", "nll") not in ("nll", None):
        return f"TRL loss_type {args.loss_type!r} is not plain cross-entropy"
    if getattr(trainer, "aux_loss_enabled", False):
        return "the model's MoE auxiliary loss is TRL's to add"
    if args.n_gpu > 1:
        return "DataParallel over several GPUs in one process (use torchrun / accelerate launch)"
    pc = getattr(trainer.accelerator, "parallelism_config", None)
    if trainer.get_tp_size() > 1 or any(getattr(pc, k, False) for k in ("sp_enabled", "cp_enabled")):
        return "tensor, sequence or context parallelism"
    if getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_deepspeed_enabled", False):
        return "FSDP / DeepSpeed shard the head's weight, which this head reads directly"
    cfg = getattr(lm, "config", None)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    kind = getattr(cfg, "model_type", None)  # the model's own (a vision-language model's is not its text model's)
    if kind not in SUPPORTED or getattr(text, "is_encoder_decoder", False):
        return f"model_type {kind!r}: its logits are not known to be the head over the last hidden state"
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if type(head) is not nn.Linear:
        return f"the output head is a {type(head).__name__}, not a plain Linear (adapters on it?)"
    if getattr(lm, "base_model", lm) is lm:
        return "the model has no separate backbone (base_model)"
    return None


def _causal_lm(model: nn.Module) -> nn.Module:
    """The transformers causal LM inside ``model`` (PEFT's ``PeftModel`` wraps it; adapters are in its layers)."""
    return model.get_base_model() if hasattr(model, "peft_config") and hasattr(model, "get_base_model") else model


def _targets(inputs: dict) -> torch.Tensor | None:
    """The batch's next-token targets (rows, T): ``shift_labels``, else ``labels`` shifted left (-100 last)."""
    if inputs.get("shift_labels") is not None:
        return inputs["shift_labels"]
    labels = inputs.get("labels")
    return None if labels is None else F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def _compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    """The trainer's ``compute_loss`` (bound to it): during training, the fused head's token losses over the
    step's loss tokens; evaluation, prediction and the refused path go to the trainer's own."""
    state = installed(self)
    path = state.loss
    own = state.own(self, "compute_loss")
    sources = inputs.pop(SOURCE_KEY, None)
    targets = _targets(inputs)
    if path.head is None or return_outputs or not model.training or targets is None:
        if model.training:
            _log_once(self, path)
        return own(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
    _log_once(self, path)
    given = {k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")}
    head = replace(path.head, smoothing=float(self.args.label_smoothing_factor or 0.0))
    per = _token_weights(path, sources, targets.device)  # (rows, T), weighed inside the head: no second pass
    with self.accelerator.autocast():  # what accelerate's mixed-precision wrapper of the forward would apply
        losses = token_losses(model, _causal_lm(self.model), head, given, targets, per)  # (rows, T)
    if per is not None:  # sum(w x CE) / sum(w) over the step's loss tokens on every rank (get_batch_samples)
        n = path.weight_n
        n = (per * (targets != IGNORE_INDEX)).sum() if n is None else n
        loss = losses.sum() / torch.as_tensor(n, device=losses.device).clamp(min=1e-12)
        return loss * self.accelerator.num_processes if self.args.world_size > 1 else loss
    n = num_items_in_batch if num_items_in_batch is not None else (targets != IGNORE_INDEX).sum()
    loss = losses.sum() / torch.as_tensor(n, device=losses.device).clamp(min=1)
    if num_items_in_batch is not None and self.args.world_size > 1:
        loss = loss * self.accelerator.num_processes  # n counts every rank's tokens; DDP averages gradients
    return loss


def _token_weights(path: LossPath, sources, device) -> torch.Tensor | None:
    """(rows, T) float32: each token's source weight (padding's is the first source's; its CE is 0), or None."""
    if path.source_weights is None or sources is None:
        return None
    return path.source_weights.to(device, torch.float32)[sources.to(device).clamp(min=0)]


def _log_once(trainer, path: LossPath) -> None:
    if not path.logged:
        path.logged = True
        if trainer.is_world_process_zero():
            logger.warning("densebatch: loss path: %s", path.line)


def _get_batch_samples(self, epoch_iterator, num_batches, device):
    """The trainer's ``get_batch_samples`` (bound to it), whose count is always the step's loss tokens over every
    rank (the trainer's own when it already is; counted from ``shift_labels`` where it left it out or counted
    one rank)."""
    state = installed(self)
    path = state.loss
    samples, n = state.own(self, "get_batch_samples")(epoch_iterator, num_batches, device)
    world = self.args.world_size
    weighted = [(w, b) for b in samples if (w := _token_weights(path, b.get(SOURCE_KEY), device)) is not None]
    if weighted:  # the step's summed source weight over its loss tokens, every micro-batch and rank (float64)
        total = sum((w.double() * (_targets(b).to(device) != IGNORE_INDEX)).sum() for w, b in weighted)
        path.weight_n = self.accelerator.gather(total.reshape(1)).sum() if world > 1 else total
    if n is None or (world > 1 and not self.args.average_tokens_across_devices):
        found = [t for b in samples if (t := _targets(b)) is not None]
        if found:
            n = sum((t != IGNORE_INDEX).sum() for t in found).to(device)
            if world > 1:
                n = self.accelerator.gather(n).sum()
    return samples, n

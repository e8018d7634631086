"""Token-weighted evaluation loss and perplexity of a model over an iterable of ``Batch``.

The loss is ``sum(per-token cross-entropy) / (loss tokens)`` over the whole split, summed in float64,
so it does not depend on how documents were grouped into rows and batches (random, length-grouped,
token-budget or packed give the same number to ~1e-7 relative). Also home of the precision context
shared by training and evaluation (the lowest module that runs the model).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from densebatch import torch_features
from densebatch.batch import IGNORE_INDEX, Batch
from densebatch.errors import ConfigError

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_precision(device: torch.device, precision: str) -> str:
    """``train.precision`` as this device runs it: ``auto`` is bf16 autocast on a CUDA device that
    supports it, fp32 elsewhere (CPU autocast is slower than fp32 there, and a GPU without bf16 would
    need fp16's loss scaling, a choice left to the user). Other values are checked and returned."""
    if precision == "auto":
        cuda_bf16 = device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return "bf16" if cuda_bf16 else "fp32"
    check_precision(device, precision)
    return precision


def allow_tf32(device: torch.device) -> bool:
    """On CUDA, let fp32 matrix products use TF32 tensor cores (what bf16 autocast leaves in fp32:
    the optimizer's and the loss head's own products); True when switched on."""
    if device.type != "cuda":
        return False
    torch_features.allow_tf32()  # the fp32_precision API where the release has it, never mixed with the legacy flags
    return True


def check_precision(device: torch.device, precision: str) -> None:
    """Refuse precisions the device cannot run, with a message saying what to use instead."""
    if precision not in ("fp32", "bf16", "fp16"):
        raise ConfigError(f"train.precision: expected auto, fp32, bf16 or fp16; got {precision!r}")
    # fp16 autocast on CPU is either unsupported or far slower than fp32, and loss scaling exists for
    # GPU tensor cores: refusing it is clearer than a silent slowdown.
    if precision == "fp16" and device.type != "cuda":
        raise ConfigError(f"train.precision: fp16 needs a CUDA device (this run uses {device.type}); use bf16 or fp32")
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("train.precision: this GPU has no bf16 support; use fp16 or fp32")


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """Mixed-precision context for the forward pass (a no-op in fp32; ``auto`` resolved for ``device``)."""
    precision = resolve_precision(device, precision)
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=AUTOCAST_DTYPES[precision])


def to_device(batch: Batch, device: torch.device) -> Batch:
    """Move a batch; asynchronous only when it can be (CUDA target, pinned source)."""
    if batch.input_ids.device == device:
        return batch
    non_blocking = device.type == "cuda" and batch.input_ids.is_pinned()
    return batch.to(device, non_blocking=non_blocking)


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf  # exp overflows a float beyond ~709


def source_sums(batch: Batch, losses: Tensor, num_sources: int) -> Tensor:
    """Per-source loss sums and loss-token counts of one batch: ``(2 * num_sources,)`` float64,
    sums first. Exact over each source's targets (positions whose label is not -100); zeros for a
    batch without ``source_ids`` (a null batch)."""
    out = torch.zeros(2 * num_sources, dtype=torch.float64, device=losses.device)
    if batch.source_ids is None or num_sources == 0:
        return out
    keep = batch.labels != IGNORE_INDEX  # (rows, T)
    src = batch.source_ids[keep]  # (n,)
    out[:num_sources] = torch.bincount(src, weights=losses.detach()[keep].double(), minlength=num_sources)
    out[num_sources:] = torch.bincount(src, minlength=num_sources).double()
    return out


def by_source(sums: list[float], names: list[str]) -> tuple[dict[str, float | None], dict[str, float]]:
    """(loss per source, share of the loss tokens per source) from all-reduced ``source_sums``."""
    k = len(names)
    total = sum(sums[k:]) or 1.0
    loss = {n: (sums[i] / sums[k + i] if sums[k + i] > 0 else None) for i, n in enumerate(names)}
    return loss, {n: sums[k + i] / total for i, n in enumerate(names)}


@dataclass
class EvalResult:
    loss: float  # summed CE / tokens
    ppl: float
    tokens: int  # loss tokens
    real_tokens: int
    batches: int
    loss_by_source: dict | None = None  # source name -> loss over that source's loss tokens (2+ sources)
    tokens_by_source: dict | None = None  # source name -> its loss tokens
    masked_accuracy: float | None = None  # masked LM: share of the masked tokens predicted right (argmax)

    def as_dict(self) -> dict:
        out = asdict(self)
        return {k: v for k, v in out.items() if v is not None}


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[Batch],
    *,
    device: torch.device | str | None = None,
    precision: str = "fp32",
    max_batches: int | None = None,
    all_reduce_sum: Callable[[Tensor], Tensor] | None = None,
    forward: Callable[[Batch], Tensor] | None = None,
    source_names: list[str] | None = None,
) -> EvalResult:
    """Evaluate ``model.token_losses`` over ``batches`` (at most ``max_batches``) in eval mode.

    ``all_reduce_sum`` (identity by default) sums the (loss, tokens) totals over ranks, each rank
    evaluating its own shard (every rank must pass the same number of batches: FSDP gathers weights
    in each forward). ``forward`` replaces ``model.token_losses`` (the trainer passes its DDP / FSDP
    wrapper). With ``source_names`` (two or more sources) the loss is also reported per source. A
    masked LM also reports ``masked_accuracy`` (the masked tokens whose argmax is right, over all masked
    tokens: ``HFCausalLM.eval_hits``). The model's train/eval mode is restored afterwards.
    """
    forward = forward or model.token_losses
    if device is None:
        device = next(model.parameters()).device
    device = torch.device(device)
    was_training = model.training
    model.eval()
    k = len(source_names) if source_names and len(source_names) > 1 else 0
    # loss sum, loss tokens, real tokens, masked tokens predicted right (mlm), then the sources'
    totals = torch.zeros(4 + 2 * k, dtype=torch.float64, device=device)
    hits_of = getattr(model, "module", model)  # an encoder leaves its hits there (HFCausalLM.eval_hits)
    scored = False
    n = 0
    try:
        for batch in batches:
            if max_batches is not None and n >= max_batches:
                break
            batch = to_device(batch, device)
            hits_of.eval_hits = None
            with autocast(device, precision):
                losses = forward(batch)  # (rows, T) float32, 0 where label == -100
            totals[0] += losses.double().sum()
            totals[1] += batch.num_loss_tokens
            totals[2] += batch.num_real_tokens
            if (hits := getattr(hits_of, "eval_hits", None)) is not None:
                totals[3] += hits
                scored = True
            if k:
                totals[4:] += source_sums(batch, losses, k)
            n += 1
    finally:
        model.train(was_training)
    if all_reduce_sum is not None:
        totals = all_reduce_sum(totals)
    values = totals.tolist()
    loss_sum, tokens, real, hits = values[:4]
    loss = loss_sum / tokens if tokens > 0 else math.nan
    result = EvalResult(
        loss=loss, ppl=perplexity(loss) if tokens > 0 else math.nan, tokens=int(tokens), real_tokens=int(real), batches=n
    )
    if scored:
        result.masked_accuracy = hits / tokens if tokens > 0 else math.nan
    if k:
        result.loss_by_source = by_source(values[4:], source_names)[0]
        result.tokens_by_source = {name: int(c) for name, c in zip(source_names, values[4 + k :])}
    return result

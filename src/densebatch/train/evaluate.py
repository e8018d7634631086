"""Token-weighted evaluation loss and perplexity of a model over an iterable of ``Batch``.

The loss is ``sum(per-token cross-entropy) / (loss tokens)`` over the whole split, summed in float64,
so it does not depend on how documents were grouped into rows and batches (random, length-grouped,
token-budget or packed give the same number to ~1e-7 relative). The precision context and device moves
it shares with training are in ``train/precision.py``, the per-source sums in ``train/per_source.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from densebatch.batch import Batch
from densebatch.train.per_source import by_source, source_sums
from densebatch.train.precision import autocast, to_device


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf  # exp overflows a float beyond ~709


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


def eval_record(
    model: nn.Module,
    step: int,
    *,
    data: Iterable[Batch] | Callable[[], Iterable[Batch]] | None,
    max_batches: int | None,
    evaluate_batches: Callable[[Iterable[Batch], int | None], EvalResult],
    extra: Callable[[nn.Module], dict] | None,
) -> dict:
    """The ``"kind": "eval"`` record of one evaluation inside a run, at ``step``: the loss of ``data`` (batches,
    or a function giving a fresh iterable each time) through ``evaluate_batches`` (the trainer's: its
    wrapper, device, precision and ranks), then the entries ``extra(model)`` adds (e.g. accuracy), run in
    eval mode without gradients."""
    rec: dict = {"kind": "eval", "step": step}
    if data is not None:
        source = data() if callable(data) else data
        rec.update(evaluate_batches(source, max_batches).as_dict())
    if extra is not None:
        was_training = model.training
        model.eval()
        with torch.no_grad():
            rec.update(extra(model))
        model.train(was_training)
    return rec

"""AdamW over per-layer-group parameter groups, and learning-rate schedules as pure functions of the step.

Parameter groups come from the model's ``layer_groups()`` (``embeddings`` / ``blocks`` / ``head``),
each split into a decayed and a non-decayed half; with ``layer_lr_decay`` below 1 the blocks are
split further, one pair of groups per block. Every group carries ``lr_mult`` (its layer group's
multiplier, times ``layer_lr_decay ** depth`` for a block); ``set_lrs`` sets
``group["lr"] = group_lr_at(step, ..., its layer group) * scale * group["lr_mult"]`` before each
update, so no schedule lives in optimizer state beyond ``lr_mult`` and a resumed run recomputes
exactly the same learning rates.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from densebatch import torch_features
from densebatch.config import TrainConfig
from densebatch.train.distributed import repeated_blocks

LAYER_GROUPS = ("embeddings", "blocks", "head")


def param_groups(model: nn.Module, cfg: TrainConfig) -> list[dict]:
    """Partition the trainable parameters into AdamW groups: (layer group) × (decay, no decay).

    No weight decay on tensors with ``ndim < 2`` (norm gains, biases), on the embeddings group, nor
    on the output embedding matrix (an untied ``lm_head``, named by the model's optional
    ``output_embeddings()``; it stays in the head group for its learning rate), unless
    ``cfg.optimizer.decay_all``: decaying them pulls scales and token vectors towards zero (rare tokens most),
    which hurts and buys no regularisation. Empty groups are left out. Every parameter appears once.

    With ``cfg.layer_lr_decay`` < 1 each block (``repeated_blocks``: the largest ``nn.ModuleList``)
    has its own groups, ``blocks.{i}.decay`` / ``blocks.{i}.no_decay``, with ``lr_mult`` =
    ``lr_mult_blocks * layer_lr_decay ** (depth from the top)``: the last block has depth 0. A
    parameter of the blocks group outside every block keeps ``blocks.decay`` / ``blocks.no_decay``
    at depth 0.
    """
    groups = model.layer_groups()
    embedding_like = {id(p) for p in getattr(model, "output_embeddings", list)()}
    unknown = set(groups) - set(LAYER_GROUPS)
    if unknown:
        raise ValueError(f"layer_groups(): unexpected group names {sorted(unknown)}; expected {LAYER_GROUPS}")
    mults = {"embeddings": cfg.lr_mult_embeddings, "blocks": cfg.lr_mult_blocks, "head": cfg.lr_mult_head}
    depth = block_depths(model) if cfg.layer_lr_decay != 1.0 else {}
    seen: set[int] = set()
    out = []
    for name in LAYER_GROUPS:
        parts: dict[str, tuple[float, list, list]] = {}  # group name prefix -> (lr_mult, decay, no_decay)
        for p in groups.get(name, []):
            if id(p) in seen:
                raise ValueError(f"layer_groups(): a parameter of shape {tuple(p.shape)} appears twice")
            seen.add(id(p))
            if not p.requires_grad:
                continue
            prefix, mult = name, mults[name]
            if name == "blocks" and id(p) in depth:
                index, d = depth[id(p)]
                prefix, mult = f"blocks.{index}", mults[name] * cfg.layer_lr_decay**d
            decay, no_decay = parts.setdefault(prefix, (mult, [], []))[1:]
            decays = cfg.optimizer.decay_all or (p.ndim >= 2 and name != "embeddings" and id(p) not in embedding_like)
            (decay if decays else no_decay).append(p)
        for prefix in sorted(parts, key=_block_order):
            mult, decay, no_decay = parts[prefix]
            for params, wd, suffix in ((decay, cfg.optimizer.weight_decay, "decay"), (no_decay, 0.0, "no_decay")):
                if params:
                    out.append({"params": params, "weight_decay": wd, "lr_mult": mult, "name": f"{prefix}.{suffix}"})
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in seen]
    if missing:
        raise ValueError(f"layer_groups(): trainable parameters in no group: {missing[:5]}")
    return out


def block_depths(model: nn.Module) -> dict[int, tuple[int, int]]:
    """``id(parameter) -> (block index, depth from the top)`` for the parameters of the repeated blocks."""
    blocks = repeated_blocks(model)
    return {id(p): (i, len(blocks) - 1 - i) for i, block in enumerate(blocks) for p in block.parameters()}


def _block_order(prefix: str) -> tuple[int, int]:
    """Groups in model order: ``blocks`` (outside every block) first, then ``blocks.0``, ``blocks.1``, ..."""
    tail = prefix.partition(".")[2]
    return (1, int(tail)) if tail else (0, 0)


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over ``param_groups``: the fused kernel (one pass per tensor) on CPU and CUDA, multi-tensor
    (foreach) elsewhere and for sharded (DTensor) parameters.

    On CPU the fused step is several times faster than foreach on a 16M-parameter GPT-2 (see
    docs/benchmarks.md, "Where a step's time goes"); it is also Hugging Face Trainer's default
    (``adamw_torch_fused``). Both are deterministic for a fixed device. ``lr`` starts at the peak
    and is overwritten by the loop before every step.
    """
    groups = param_groups(model, cfg)
    params = [p for g in groups for p in g["params"]]
    fused = torch_features.fused_adamw() and bool(params) and all(_fused_ok(p) for p in params)
    impl = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.optimizer.beta1, cfg.optimizer.beta2), eps=cfg.optimizer.eps, **impl)


def _fused_ok(p: torch.Tensor) -> bool:
    plain = type(p) in (torch.Tensor, nn.Parameter)  # DTensor shards (FSDP2) keep the multi-tensor path
    return plain and p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.float16, torch.bfloat16)


def lr_at(step: int, cfg: TrainConfig, total_steps: int | None) -> float:
    """Learning rate of the update with 0-based index ``step`` (a pure function: no state).

    Linear warm-up from ``lr / warmup_steps`` to ``lr`` over ``warmup_steps`` updates, then cosine (or
    linear) decay to ``min_lr_ratio * lr`` at ``total_steps``, flat afterwards; ``constant`` stays at
    ``lr``. With ``total_steps`` unknown (None) there is nothing to decay towards: ``lr`` after warm-up.
    """
    return _curve(
        step, lr=cfg.lr, schedule=cfg.schedule, warmup=cfg.warmup_steps, min_ratio=cfg.min_lr_ratio, total_steps=total_steps
    )


def group_lr_at(step: int, cfg: TrainConfig, total_steps: int | None, group: str) -> float:
    """``lr_at`` with the layer group's own schedule, warm-up and final ratio (``train.<group>.*``,
    each defaulting to the ``train.*`` value): equal to ``lr_at`` when the group sets nothing."""
    g = getattr(cfg, group)
    schedule = cfg.schedule if g.schedule == "same" else g.schedule
    warmup = cfg.warmup_steps if g.warmup_steps is None else g.warmup_steps
    ratio = cfg.min_lr_ratio if g.min_lr_ratio is None else g.min_lr_ratio
    return _curve(step, lr=cfg.lr, schedule=schedule, warmup=warmup, min_ratio=ratio, total_steps=total_steps)


def _curve(step: int, *, lr: float, schedule: str, warmup: int, min_ratio: float, total_steps: int | None) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    if schedule == "constant" or total_steps is None:
        return lr
    min_lr = lr * min_ratio
    span = max(1, total_steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    if schedule == "linear":
        return lr - (lr - min_lr) * progress
    if schedule == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"train.schedule: expected cosine, linear or constant; got {schedule!r}")


def set_lrs(
    optimizer: torch.optim.Optimizer, *, step: int, cfg: TrainConfig, total_steps: int | None, scale: float = 1.0
) -> float:
    """Set every group's ``lr`` for the update ``step``: its layer group's schedule (``group_lr_at``;
    the group's name begins with it) x ``scale`` x ``lr_mult``. Returns ``lr_at(...) x scale``, the
    rate of a group with multiplier 1 under ``train.schedule`` (what the metrics call ``lr``)."""
    base = lr_at(step, cfg, total_steps) * scale
    by_group: dict[str, float] = {}
    for group in optimizer.param_groups:
        layer = str(group.get("name", "")).split(".")[0]
        if layer not in by_group:
            by_group[layer] = group_lr_at(step, cfg, total_steps, layer) * scale if layer in LAYER_GROUPS else base
        group["lr"] = by_group[layer] * group["lr_mult"]
    return base


def has_group_schedules(cfg: TrainConfig) -> bool:
    """True when some layer group departs from ``train.schedule`` or layer-wise decay is on."""
    plain = type(cfg.embeddings)()
    return cfg.layer_lr_decay != 1.0 or any(getattr(cfg, g) != plain for g in LAYER_GROUPS)


def lr_record(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> dict:
    """``{"lr_groups": {group: lr}}`` (a group's decay and no-decay halves share one rate) for a step's
    record when per-group schedules or layer-wise decay are on; otherwise nothing."""
    if not has_group_schedules(cfg):
        return {}
    return {"lr_groups": {g["name"].rsplit(".", 1)[0]: g["lr"] for g in optimizer.param_groups if "name" in g}}


def estimate_total_steps(
    cfg: TrainConfig, steps_per_epoch: int | None, real_tokens_per_step: int, batch_schedule: Any = None
) -> int | None:
    """Schedule horizon: the first of max_steps, max_epochs (one epoch when no limit is set), max_tokens.

    ``steps_per_epoch`` comes from the step planner (the same on every rank); a token limit is
    converted to steps from the size of the first step (all ranks), so it is an estimate; the loop
    stores the horizon in its state so that a resumed run uses the same value. None when nothing
    bounds the run (or the bound cannot be converted to steps). With a ``batch_schedule``
    (``train/schedule.py``) the epoch and token limits are counted in full steps (the first step
    holds ``fraction(0)`` of one) and converted with its ``steps_for``: a ramp's smaller steps make
    more of them; back-offs, decided later from evaluations, cannot be foreseen.
    """
    candidates = []
    if cfg.max_steps is not None:
        candidates.append(cfg.max_steps)
    epochs = cfg.max_epochs
    if epochs is None and cfg.max_steps is None and cfg.max_tokens is None:
        epochs = 1.0
    if epochs is not None and steps_per_epoch:
        full = epochs * steps_per_epoch
        candidates.append(batch_schedule.steps_for(full) if batch_schedule is not None else math.ceil(full - 1e-9))
    if cfg.max_tokens is not None and real_tokens_per_step > 0:
        if batch_schedule is not None:
            candidates.append(batch_schedule.steps_for(cfg.max_tokens * batch_schedule.fraction(0) / real_tokens_per_step))
        else:
            candidates.append(math.ceil(cfg.max_tokens / real_tokens_per_step))
    return max(1, min(candidates)) if candidates else None

"""AdamW over per-layer-group parameter groups, and learning-rate schedules as pure functions of the step.

Parameter groups come from the model's ``layer_groups()`` (``embeddings`` / ``blocks`` / ``head``),
each split into a decayed and a non-decayed half. Every group carries ``lr_mult``; the loop sets
``group["lr"] = lr_at(step, ...) * group["lr_mult"]`` before each update, so the schedule itself never
lives in optimizer state and a resumed run recomputes exactly the same learning rates.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from densebatch.config import TrainConfig

LAYER_GROUPS = ("embeddings", "blocks", "head")


def param_groups(model: nn.Module, cfg: TrainConfig) -> list[dict]:
    """Partition the trainable parameters into AdamW groups: (layer group) × (decay, no decay).

    No weight decay on tensors with ``ndim < 2`` (norm gains, biases), on the embeddings group, nor
    on the output embedding matrix (an untied ``lm_head``, named by the model's optional
    ``output_embeddings()``; it stays in the head group for its learning rate), unless
    ``cfg.decay_all``: decaying them pulls scales and token vectors towards zero (rare tokens most),
    which hurts and buys no regularisation. Empty groups are left out. Every parameter appears once.
    """
    groups = model.layer_groups()
    embedding_like = {id(p) for p in getattr(model, "output_embeddings", list)()}
    unknown = set(groups) - set(LAYER_GROUPS)
    if unknown:
        raise ValueError(f"layer_groups(): unexpected group names {sorted(unknown)}; expected {LAYER_GROUPS}")
    mults = {"embeddings": cfg.lr_mult_embeddings, "blocks": cfg.lr_mult_blocks, "head": cfg.lr_mult_head}
    seen: set[int] = set()
    out = []
    for name in LAYER_GROUPS:
        decay, no_decay = [], []
        for p in groups.get(name, []):
            if id(p) in seen:
                raise ValueError(f"layer_groups(): a parameter of shape {tuple(p.shape)} appears twice")
            seen.add(id(p))
            if not p.requires_grad:
                continue
            decays = cfg.decay_all or (p.ndim >= 2 and name != "embeddings" and id(p) not in embedding_like)
            (decay if decays else no_decay).append(p)
        for params, wd, suffix in ((decay, cfg.weight_decay, "decay"), (no_decay, 0.0, "no_decay")):
            if params:
                out.append({"params": params, "weight_decay": wd, "lr_mult": mults[name], "name": f"{name}.{suffix}"})
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in seen]
    if missing:
        raise ValueError(f"layer_groups(): trainable parameters in no group: {missing[:5]}")
    return out


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
    fused = bool(params) and all(_fused_ok(p) for p in params)
    impl = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **impl)


def _fused_ok(p: torch.Tensor) -> bool:
    plain = type(p) in (torch.Tensor, nn.Parameter)  # DTensor shards (FSDP2) keep the multi-tensor path
    return plain and p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.float16, torch.bfloat16)


def lr_at(step: int, cfg: TrainConfig, total_steps: int | None) -> float:
    """Learning rate of the update with 0-based index ``step`` (a pure function: no state).

    Linear warm-up from ``lr / warmup_steps`` to ``lr`` over ``warmup_steps`` updates, then cosine (or
    linear) decay to ``min_lr_ratio * lr`` at ``total_steps``, flat afterwards; ``constant`` stays at
    ``lr``. With ``total_steps`` unknown (None) there is nothing to decay towards: ``lr`` after warm-up.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant" or total_steps is None:
        return cfg.lr
    min_lr = cfg.lr * cfg.min_lr_ratio
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.schedule == "linear":
        return cfg.lr - (cfg.lr - min_lr) * progress
    if cfg.schedule == "cosine":
        return min_lr + (cfg.lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"train.schedule: expected cosine, linear or constant; got {cfg.schedule!r}")


def estimate_total_steps(cfg: TrainConfig, steps_per_epoch: int | None, real_tokens_per_step: int) -> int | None:
    """Schedule horizon: the first of max_steps, max_epochs (one epoch when no limit is set), max_tokens.

    ``steps_per_epoch`` comes from the step planner (the same on every rank); a token limit is
    converted to steps from the size of the first step (all ranks), so it is an estimate; the loop
    stores the horizon in its state so that a resumed run uses the same value. None when nothing
    bounds the run (or the bound cannot be converted to steps).
    """
    candidates = []
    if cfg.max_steps is not None:
        candidates.append(cfg.max_steps)
    epochs = cfg.max_epochs
    if epochs is None and cfg.max_steps is None and cfg.max_tokens is None:
        epochs = 1.0
    if epochs is not None and steps_per_epoch:
        candidates.append(math.ceil(epochs * steps_per_epoch - 1e-9))
    if cfg.max_tokens is not None and real_tokens_per_step > 0:
        candidates.append(math.ceil(cfg.max_tokens / real_tokens_per_step))
    return max(1, min(candidates)) if candidates else None

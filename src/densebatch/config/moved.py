"""Keys that moved or were renamed: a configuration naming the old key is refused with its new name, and a
configuration a run saved before the move (a checkpoint's, ``output_dir/config.yaml``) is read under the new
names, so older runs still resume."""

from __future__ import annotations

import copy

from densebatch.errors import ConfigError

_SCHEDULE = {
    "ramp_steps": "ramp_steps",
    "ramp_start": "ramp_start",
    "ramp_unit": "ramp_unit",
    "batch_backoff_patience": "backoff_patience",
    "batch_backoff_factor": "backoff_factor",
    "batch_backoff_floor": "backoff_floor",
    "batch_backoff_cap": "backoff_cap",
    "batch_backoff_max": "backoff_max",
    "lr_batch_scaling": "lr_scaling",
}
MOVED: dict[str, str] = {
    **{f"train.{k}": f"train.optimizer.{k}" for k in ("weight_decay", "decay_all", "beta1", "beta2", "eps")},
    **{f"train.{old}": f"train.batch_schedule.{new}" for old, new in _SCHEDULE.items()},
    **{f"train.{k}": f"train.guard.{k}" for k in ("spike_zscore", "spike_window", "max_bad_steps", "rollback_lr_factor")},
    "train.memory_margin": "finder.memory_reserve",  # the budget finder's reserve, not a warning threshold
    "train.health.memory_margin": "train.health.memory_headroom",  # the memory warning's threshold
    # never a batching key, but named so (issue 24): a step's size lives with grad_accum_batches
    "batching.loss_tokens_per_step": "train.loss_tokens_per_step",
}


def refuse_moved(key: str) -> None:
    """``ConfigError`` naming the new key when ``key`` (dotted, unknown in its section) has moved."""
    if key in MOVED:
        raise ConfigError(f"{key} has moved: it is now {MOVED[key]} (see docs/configuration.md)")


# Keys whose default changed what a run computes, with the value a run saved before the key existed
# had: a resumed run keeps computing what it computed.
BEFORE_THE_KEY = {"train.source_balance": "tokens"}  # every loss token alike before issue 21's weighting


def upgrade_saved(data: dict) -> dict:
    """A saved configuration with every moved key at its new place (a copy; unknown keys stay for the checks),
    and the keys of ``BEFORE_THE_KEY`` that it lacks at the value it ran with."""
    out = copy.deepcopy(data)
    for key, value in BEFORE_THE_KEY.items():
        section, last = key.split(".")
        if isinstance(out.get(section), dict) and last not in out[section]:
            out[section][last] = value
    for old, new in MOVED.items():
        *path, last = old.split(".")
        node = out
        for k in path:
            node = node.get(k) if isinstance(node, dict) else None
        if not isinstance(node, dict) or last not in node:
            continue
        value = node.pop(last)
        *path, last = new.split(".")
        node = out
        for k in path:
            node = node.setdefault(k, {})
        node.setdefault(last, value)
    return out

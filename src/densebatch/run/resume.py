"""What a resume continues: the saved run's configuration, with only the changes that keep it exact.

A resume continues *the saved run*. The configuration comes from the checkpoint; of what the command
line (a config file plus ``--section.key=value`` overrides) asks for:

- keys in ``RESUMABLE`` (step limits, logging, checkpoint and evaluation cadence, prefetch, sinks)
  are taken and each change is reported: they change when the run stops or what it records, never
  the updates it computes up to there;
- any other key named explicitly on the command line that differs from the saved run (data,
  batching, model, seed, optimizer, schedule, precision, ...) is refused, listing every one;
- other differences that only the config file carries are ignored (reported): the README's
  ``densebatch train CONFIG --resume`` after ``densebatch train CONFIG --batching.strategy=packed``
  continues the packed run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from densebatch.config import RunConfig, config_from_dict, parse_override, to_dict
from densebatch.errors import ConfigError

RESUMABLE = frozenset(
    {
        "output_dir",
        "train.max_steps",
        "train.max_epochs",
        "train.max_tokens",
        "train.log_every",
        "train.progress",
        "train.report_to",
        "eval.every_steps",
        "eval.max_batches",
        "eval.patience",
        "eval.accuracy_samples",
        "eval.max_new_tokens",
        "checkpoint.every_steps",
        "checkpoint.keep_last",
        "checkpoint.mirror_dir",
        "checkpoint.resume",
        "batching.prefetch",
        "train.distributed",  # ddp and fsdp compute the same updates (≤ 1e-5): a resume may switch
    }
)


@dataclass
class ResumePlan:
    config: RunConfig
    changed: list[str] = field(default_factory=list)  # "key: saved → new", applied
    ignored: list[str] = field(default_factory=list)  # "key: file value (kept saved value)"


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict):
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


def _set(d: dict, key: str, value: Any) -> None:
    *path, last = key.split(".")
    for k in path:
        d = d.setdefault(k, {})
    d[last] = value


def explicit_keys(overrides: list[str]) -> set[str]:
    return {".".join(parse_override(o)[0]) for o in overrides}


def plan_resume(saved: dict, requested: RunConfig, overrides: list[str]) -> ResumePlan:
    """The configuration a resume runs with (see the module docstring); ``ConfigError`` listing every
    explicitly requested change that would make the resumed run differ from the saved one."""
    base = config_from_dict(saved)  # validates, and fills keys a newer version added
    old, new = flatten(to_dict(base)), flatten(to_dict(requested))
    named = explicit_keys(overrides)
    merged = to_dict(base)
    plan = ResumePlan(base)
    refused = []
    for key in sorted(k for k in new if old.get(k) != new[k]):
        if key in RESUMABLE:
            _set(merged, key, new[key])
            if key != "output_dir":
                plan.changed.append(f"{key}: {old.get(key)!r} → {new[key]!r}")
        elif key in named:
            refused.append(f"{key} (saved {old.get(key)!r}, asked {new[key]!r})")
        else:
            plan.ignored.append(f"{key}: {new[key]!r} (the saved run has {old.get(key)!r})")
    if refused:
        raise ConfigError(
            "--resume continues the saved run and cannot change what it computes: "
            + "; ".join(refused)
            + ". Drop these overrides, or start a new run in another output_dir (or with --overwrite)"
        )
    plan.config = config_from_dict(merged)
    return plan

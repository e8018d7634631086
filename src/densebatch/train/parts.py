"""The trainer's parts, grouped as it is handed them, and their saved states read back by name.

What it evaluates, where it runs, what decides each step beyond the optimizer, and what it reports to.
Every field has a default that a single CPU process with no evaluation needs, so
``Trainer(model, data, cfg, output_dir=...)`` is a whole trainer. ``load_parts``: the stateful parts
(``Trainer.parts()``) restored from a checkpoint's ``trainer`` entry."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from densebatch.batch import Batch
from densebatch.config import EvalConfig
from densebatch.train.distributed import Distributed
from densebatch.train.guard import AdaptiveClipper, AnomalyGuard, FixedClipper
from densebatch.train.observe.health import HealthMonitor
from densebatch.train.parallel.mesh import ContextRanks
from densebatch.train.schedule import BatchSchedule


@dataclass
class Evaluation:
    """What the trainer evaluates: ``cfg`` (cadence, cap, early stopping), ``data`` (batches, or a function
    returning a fresh iterable each time) and ``extra(model) -> dict`` (entries added to each eval record,
    e.g. accuracy)."""

    cfg: EvalConfig = field(default_factory=EvalConfig)
    data: Iterable[Batch] | Callable[[], Iterable[Batch]] | None = None
    extra: Callable[[nn.Module], dict] | None = None


@dataclass
class Placement:
    """Where the trainer runs: ``device`` (None: ``train.device``), ``dist`` (ranks and collectives; None: one
    process) and ``forward``, the module every training pass goes through (None: ``TokenLosses(model)``;
    under torchrun its DDP / FSDP wrapper) and ``context``, this rank's place among ranks that split every row
    (``train.context_parallel``; None: rows are not split)."""

    device: str | torch.device | None = None
    dist: Distributed | None = None
    forward: nn.Module | None = None
    context: ContextRanks | None = None


@dataclass
class StepParts:
    """The stateful components that decide each step besides the optimizer, each checkpointed by name:
    ``guard`` (apply, skip or roll back; None: skip non-finite steps, never roll back), ``clipper`` (None: a
    fixed clip at ``train.grad_clip``) and ``batch_schedule`` (each step's size; None: full size); and
    ``source_weights``, each source's weight of its loss tokens in the gradient (``train.source_balance``;
    None: every loss token alike), which the data decides, so no checkpoint holds it; ``objective``, what
    a step's loss and an evaluation are when it is not the loss tokens' cross-entropy (a preference
    objective's ``PreferenceSteps``), which holds no state either."""

    guard: AnomalyGuard | None = None
    clipper: FixedClipper | AdaptiveClipper | None = None
    batch_schedule: BatchSchedule | None = None
    source_weights: Sequence[float] | None = None
    objective: Any = None  # a preference objective's steps and evaluation (train/objectives/steps.py); None: sft


@dataclass
class Reporting:
    """What the trainer reports to: the ``console`` (rank 0's progress and summary), ``sinks`` (every record
    besides metrics.jsonl), ``health`` (warnings read from every train record) and ``source_names`` (with
    two or more, records carry the loss per source)."""

    console: bool = True
    sinks: Iterable[Any] = ()
    health: HealthMonitor | None = None
    source_names: list[str] | None = None


def load_parts(parts: dict[str, Any], saved: dict, only: Iterable[str] | None = None) -> None:
    """Each part's saved state back (``only``: the parts named, all when None). A checkpoint without
    ``health`` only gives its warnings again; a disabled scaler saves ``{}``, which is skipped; any other
    part missing is a ``KeyError`` naming it."""
    for name, part in parts.items():
        if only is not None and name not in only:
            continue
        if name == "health" and name not in saved:
            continue  # the warnings already given: a checkpoint saved without them only warns again
        if name not in saved:
            raise KeyError(f"the saved trainer state has no part '{name}' (saved: {sorted(saved)})")
        if name == "scaler" and not saved[name]:
            continue  # a disabled scaler saves {}
        part.load_state_dict(saved[name])

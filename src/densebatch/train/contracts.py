"""The interfaces the trainer relies on, written down: the model, the source of steps, and the trainer's
own public surface that the components it hosts (session, batch schedule, range test) may use.

The training layer imports nothing from ``densebatch.data`` or ``densebatch.model``: what it needs of
them is these ``Protocol`` s, which the data layer's ``StepLoader``, the reference ``GPT`` and the
Hugging Face adapter satisfy (tests check each). A plain iterable of ``Batch`` is grouped into steps
by ``train/batch_steps.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from densebatch.batch import Batch, Step

StepFraction = Callable[[int], float]  # loader step number → its size as a share of the target


class TokenLossModel(Protocol):
    """A model the trainer can train: per-token losses of a batch, its parameters by layer group, and what the
    trainer and the runner read of it (the reference ``GPT`` and ``HFCausalLM`` have every member; a model of
    one's own needs the two methods, and the trainer reads the others with the defaults noted here)."""

    max_positions: int | None  # the longest row it takes; the runner refuses longer rows up front (None: no limit)
    weighs_losses: bool  # token_losses multiplies batch.loss_weights in itself (train/per_source.py; default False)
    task: str  # "causal" or "mlm" (a masked LM): what export and generation may do with it (default "causal")
    label_smoothing: float  # train.label_smoothing, given when the model is built; training passes only

    def token_losses(self, batch: Batch) -> Tensor:
        """(rows, T) float32 cross-entropy per target; 0 where the label is ``IGNORE_INDEX``."""
        ...

    def layer_groups(self) -> dict[str, list[nn.Parameter]]:
        """Parameters by group (``embeddings``, ``blocks``, ``head``) for per-group learning rates."""
        ...

    def output_embeddings(self) -> list[nn.Parameter]:
        """The output table(s), kept without weight decay like embeddings (default: none)."""
        ...


@runtime_checkable
class StepSource(Protocol):
    """Where the trainer's steps come from: resumable, cycled up to ``max_epochs``, and (for a batch-size
    schedule) cut to a share of the target size step by step."""

    max_epochs: float | None  # None: cycle without end (the trainer sets it from its limits)

    def __iter__(self) -> Iterator[Step]:
        """Steps from the current position on; the position advances as each is handed out."""
        ...

    def steps_per_epoch(self) -> int | None:
        """Full-size steps in one epoch, None when unknown."""
        ...

    def state_dict(self) -> dict:
        """The position, JSON-able; ``state_dict()["steps"]``: steps handed out so far."""
        ...

    def load_state_dict(self, state: dict) -> None: ...

    @property
    def step_fraction(self) -> StepFraction | None:
        """The cut of every step (None: full-size steps)."""
        ...

    def set_step_fraction(self, fraction: StepFraction | None) -> None:
        """Cut every later step to ``fraction(step)`` of the target (None: full size); ``ValueError``
        from a source that cannot cut its steps."""
        ...

    @property
    def loss_tokens_per_step(self) -> int | None:
        """The loss-token target of a step, when steps are cut by loss tokens."""
        ...

    def invalidate(self) -> None:
        """Drop steps prepared ahead (their size may have changed)."""
        ...


class TrainerHost(Protocol):
    """The trainer as the components it hosts see it (``train/loop.py``'s ``Trainer``)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    data: StepSource
    state: Any  # TrainState
    console: Any  # Console: .message(text)
    cfg: Any  # TrainConfig
    dist: Any  # Distributed
    eval_data: Iterable[Batch] | Callable[[], Iterable[Batch]] | None
    eval_cfg: Any  # EvalConfig: max_batches caps an evaluation

    def write_record(self, rec: dict, always: bool = False) -> None: ...

    def reset_data_iterator(self) -> None: ...

    def trainer_state(self) -> dict: ...

    def load_trainer_state(self, d: dict, only: Iterable[str] | None = None) -> None: ...

    def forward_backward(self, batches: Iterable[Batch]) -> dict: ...

    def apply_update(self, stats: dict, clipper: Any = None, judge: bool = True) -> tuple[Any, float, float]: ...

    def evaluate_batches(self, batches: Iterable[Batch], max_batches: int | None = None) -> Any: ...

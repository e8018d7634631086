"""The batch sampler of the torch API: this rank's pieces of each step of an epoch's global plan, resumable.

``DenseBatchSampler`` plans any list of document lengths with densebatch's planners and yields, per batch,
``Piece(doc, start, stop, row)``s; ``torch_loader`` reads and collates them (``Documents``, ``Collator``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from densebatch.data.plan.planner import PlanSettings
from densebatch.data.plan.steps import rows_of, share
from densebatch.data.plan.store_epochs import rows_of_epoch
from densebatch.data.plan.strategies import DEFAULT_STRATEGY


class Piece(NamedTuple):
    """Tokens ``start`` up to ``stop`` of document ``doc``, in row ``row`` of its batch."""

    doc: int
    start: int
    stop: int
    row: int


def _dist_defaults(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is not None and world_size is not None:
        return int(rank), int(world_size)
    import torch.distributed as tdist

    on = tdist.is_available() and tdist.is_initialized()
    r = rank if rank is not None else (tdist.get_rank() if on else 0)
    w = world_size if world_size is not None else (tdist.get_world_size() if on else 1)
    return int(r), int(w)


class DenseBatchSampler:
    """A ``torch.utils.data`` batch sampler: this rank's pieces of each step of densebatch's plan of ``lengths``.

    Settings are those of the config's ``batching`` section (``PlanSettings``). Every rank builds the same
    global plan (a pure function of lengths, settings, seed and epoch) and yields its share of each step
    of ``world_size`` planned batches. ``set_epoch(e)`` (or iterating again) moves to another epoch's plan;
    ``state_dict()`` / ``load_state_dict()`` resume mid-epoch at the next batch not yet yielded."""

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        strategy: str = DEFAULT_STRATEGY,
        seq_len: int = 1024,
        max_tokens_per_batch: int = 8192,
        rows_per_batch: int = 8,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        **batching: Any,
    ) -> None:
        self.lengths = np.asarray(lengths, np.int64)
        if self.lengths.ndim != 1 or not len(self.lengths) or int(self.lengths.min()) < 1:
            raise ValueError("lengths: expected one positive token count per document (and at least one document)")
        self.settings = PlanSettings(
            strategy=strategy,
            seq_len=seq_len,
            max_tokens_per_batch=max_tokens_per_batch,
            rows_per_batch=rows_per_batch,
            **batching,
        )
        self.seed = int(seed)
        self.rank, self.world_size = _dist_defaults(rank, world_size)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in 0 .. {self.world_size - 1}")
        self.epoch, self.step = 0, 0  # the next batch this sampler yields: step `step` of epoch `epoch`
        self._plan: tuple[int, Any] | None = None

    def plan(self, epoch: int):
        """The global plan of ``epoch`` (all ranks): a ``Plan``, or above ``shard_docs`` documents an
        ``EpochRows`` that builds the pieces of the rows asked for from their shard."""
        if self._plan is None or self._plan[0] != epoch:
            self._plan = (epoch, rows_of_epoch(self.lengths, settings=self.settings, seed=self.seed, epoch=epoch))
        return self._plan[1]

    def __len__(self) -> int:
        """Batches this rank yields in an epoch (the same on every rank)."""
        return math.ceil(self.plan(self.epoch).num_batches / self.world_size)

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.step = int(epoch), 0

    def batch_pieces(self, epoch: int, step: int) -> list[Piece]:
        """This rank's pieces of step ``step`` of ``epoch``, row by row."""
        plan = self.plan(epoch)
        ptr = plan.batch_ptr
        w = self.world_size
        start, stop = int(ptr[step * w]), int(ptr[min(plan.num_batches, (step + 1) * w)])
        mine = share(plan, start=start, stop=stop, rank=self.rank, world_size=w)
        rows = rows_of(plan, mine[0]) if mine else []
        return [Piece(d, a, b, r) for r, row in enumerate(rows) for d, a, b in row]

    def __iter__(self) -> Iterator[list[Piece]]:
        epoch = self.epoch
        while self.step < len(self):
            step = self.step
            self.step += 1
            yield self.batch_pieces(epoch, step)
        self.set_epoch(epoch + 1)

    def state_dict(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        if int(state["seed"]) != self.seed:
            raise ValueError(f"sampler state has seed {state['seed']}, this sampler {self.seed}: plans would differ")
        epoch, step = int(state["epoch"]), int(state["step"])
        if epoch < 0 or step < 0:
            raise ValueError(f"sampler state: epoch and step must be >= 0; got epoch {epoch}, step {step}")
        self.epoch, self.step = epoch, step

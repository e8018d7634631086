"""Steps from a plain iterable of batches, for one process (tests, library users without a loader).

The data layer's ``StepLoader`` plans steps globally for any number of ranks; this adapter groups
an ordinary iterable of ``Batch`` the same way for one process: ``grad_accum_batches`` batches, or
as many batches as bring the step nearest ``loss_tokens_per_step`` loss tokens (reading one batch
ahead; an iterable with its own ``state_dict`` is never read ahead, since its saved state would skip
the batch held, so its steps take batches until they reach the target), never across the end of an epoch (a list is
re-iterated epoch after epoch; its length is the epoch).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator

from densebatch.batch import Batch, Step
from densebatch.config import TrainConfig


class BatchSteps:
    """Steps from a plain iterable of ``Batch`` (one process): ``grad_accum_batches`` batches, or the
    batches nearest ``loss_tokens_per_step`` loss tokens. A re-iterable (a list) cycles epoch after epoch."""

    def __init__(self, batches: Iterable[Batch], cfg: TrainConfig):
        self.batches, self.cfg = batches, cfg
        self.per_epoch = getattr(batches, "batches_per_epoch", None) or (len(batches) if hasattr(batches, "__len__") else None)
        self.seen = 0

    def state_dict(self) -> dict:
        inner = self.batches.state_dict() if hasattr(self.batches, "state_dict") else {}
        return {"seen": self.seen, "inner": inner}

    def load_state_dict(self, state: dict) -> None:
        self.seen = int(state["seen"])
        if hasattr(self.batches, "load_state_dict"):
            self.batches.load_state_dict(state["inner"])

    step_fraction = None  # steps are always full size

    def set_step_fraction(self, fraction) -> None:
        if fraction is not None:
            raise ValueError("a batch-size schedule needs a StepLoader: a plain iterable of batches cannot cut its steps")

    @property
    def loss_tokens_per_step(self) -> int | None:
        return self.cfg.loss_tokens_per_step

    def invalidate(self) -> None:
        """Nothing is prepared ahead."""

    def steps_per_epoch(self) -> int | None:
        if not self.per_epoch or self.cfg.loss_tokens_per_step is not None:
            return None
        return math.ceil(self.per_epoch / self.cfg.grad_accum_batches)

    def __iter__(self) -> Iterator[Step]:
        it = iter(self.batches)
        limit = None if self.max_epochs is None or not self.per_epoch else math.ceil(self.max_epochs * self.per_epoch - 1e-9)
        target = self.cfg.loss_tokens_per_step
        held: list[Batch] = []  # a batch read ahead that belongs to the next step
        ahead = not hasattr(self.batches, "state_dict")
        while limit is None or self.seen < limit:
            out, tokens = [], 0
            for batch in itertools.chain(held, it):  # (a generator here would close `it` when left)
                held = []
                if ahead and target is not None and out and tokens + batch.num_loss_tokens - target > target - tokens:
                    held = [batch]  # taking it would overshoot the target by more than stopping falls short
                    break
                out.append(batch)
                tokens += batch.num_loss_tokens
                epoch_end = self.per_epoch and (self.seen + len(out)) % self.per_epoch == 0
                full = tokens >= target if target is not None else len(out) >= self.cfg.grad_accum_batches
                if full or epoch_end or (limit is not None and self.seen + len(out) >= limit):
                    break
            if not out:
                if not hasattr(self.batches, "__len__"):
                    return
                it = iter(self.batches)  # a list: its next epoch
                continue
            self.seen += len(out)
            yield Step(tuple(out), epoch=self.seen / self.per_epoch if self.per_epoch else 0.0, num_batches=len(out))

    max_epochs: float | None = None

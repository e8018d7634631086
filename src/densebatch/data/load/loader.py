"""Loading: stream this rank's share of every optimizer step, epoch after epoch, resumably.

``StepLoader`` plans each epoch once for all ranks (``plan_epoch``, a pure function of lengths,
settings, seed and epoch; above ``shard_docs`` documents shard by shard, holding an index of the
batches and building a step's pieces from its shard, so no rank ever holds the epoch's pieces), cuts
it into steps and shares each step out (``data/plan/steps.py``), collates
this rank's batches in a background thread (``prefetch`` steps ahead) and pins memory when a GPU is
present. Every rank computes the same boundaries from the same plan, so all ranks take the same
steps; a rank with nothing to do in a step gets null batches (``Batch.null``) and still joins every
collective of the step.

State: ``{"seed", "epoch", "row", "steps"}``: the epoch and the plan row where the next step begins,
and how many steps were handed out. It does not depend on the number of ranks: a checkpoint written
by N processes resumes on M with the same documents per step as long as
``world_size × grad_accum_batches`` stays the same. After ``load_state_dict`` the next step is
exactly the one that would have come next. ``fraction`` (a batch-size ramp or back-off) is a
function of the step count; changing it invalidates prefetched steps.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable, Iterator

import numpy as np
import torch

from densebatch.batch import Batch, Step
from densebatch.data.load.collate import Collator
from densebatch.data.plan.mixture import Selection
from densebatch.data.plan.planner import Plan, PlanSettings
from densebatch.data.plan.shards import EpochRows
from densebatch.data.plan.steps import StepSettings, cumulative_row_loss_tokens, rows_of, share, step_documents, step_stop
from densebatch.data.plan.store_epochs import rows_of_epoch, select
from densebatch.data.store.store import DocumentStore
from densebatch.errors import DataError

_DONE = object()


class StepLoader:
    def __init__(
        self,
        store: DocumentStore,
        *,
        settings: PlanSettings,
        collator: Collator,
        seed: int,
        steps: StepSettings | None = None,
        prefetch: int = 2,
        pin_memory: bool | None = None,
        max_epochs: float | None = None,
        weights: tuple[float, ...] | None = None,
        lengths=None,
    ):
        if prefetch < 0:
            raise ValueError(f"prefetch: expected 0 or more steps; got {prefetch}")
        self.store, self.settings, self.collator = store, settings, collator
        self.step_settings = steps or StepSettings()
        self.seed, self.prefetch = int(seed), prefetch
        self.rank, self.world_size = self.step_settings.rank, self.step_settings.world_size
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        # as stored (uint32 memory-mapped from disk): never copied whole; or as laid out when that differs
        # (``lengths``: preference pairs with their prompt laid twice, run/preference.py)
        self.lengths = store.lengths if lengths is None else lengths
        self.pad_id = int(collator.pad_id)
        self.max_epochs = max_epochs
        self.weights = weights  # data.sources' weights (store order); None: every document once an epoch
        self._fraction: Callable[[int], float] | None = None  # a batch-size schedule's cut; None: full-size steps
        self.epoch, self.row, self.steps_done = 0, 0, 0
        self._plans: dict[int, Plan | EpochRows] = {}
        self._cum: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()  # the prefetch thread plans too
        self._selections: dict[int, Selection] = {}
        self._selection_lock = threading.Lock()  # taken inside _lock by plan()
        self._generation = 0

    # ------------------------------------------------------------------------- plans and state
    def plan(self, epoch: int) -> Plan | EpochRows:
        """The global plan of ``epoch`` (all ranks; sources mixed by ``weights``), cached for the current
        and next epoch only: a ``Plan``, or above ``shard_docs`` documents (or for a weighted mixture)
        an ``EpochRows`` that builds the pieces of the rows asked for from their shard."""
        with self._lock:
            if epoch not in self._plans:
                self._plans = {e: p for e, p in self._plans.items() if e >= epoch - 1}
                self._cum = {e: c for e, c in self._cum.items() if e in self._plans}
                self._plans[epoch] = rows_of_epoch(
                    self.lengths, settings=self.settings, seed=self.seed, epoch=epoch, selection=self.selection(epoch)
                )
            return self._plans[epoch]

    def selection(self, epoch: int) -> Selection | None:
        """The documents ``epoch`` plans for a weighted mixture (drawn once, kept for the current and next
        epoch, as the plans are); None without weights (every document once)."""
        if self.weights is None:
            return None
        with self._selection_lock:
            if epoch not in self._selections:
                self._selections = {e: x for e, x in self._selections.items() if e >= epoch - 1}
                self._selections[epoch] = select(
                    self.store, weights=self.weights, seed=self.seed, epoch=epoch, lengths=self.lengths
                )
            return self._selections[epoch]

    def _cum_tokens(self, epoch: int) -> np.ndarray | None:
        """Loss tokens per row, as prefix sums (only for ``loss_tokens_per_step``)."""
        if self.step_settings.loss_tokens_per_step is None:
            return None
        plan = self.plan(epoch)
        with self._lock:
            if epoch not in self._cum:
                rate = self.collator.masked_rate  # masked LM: a share of the tokens, drawn at collate time
                self._cum[epoch] = cumulative_row_loss_tokens(plan, self.store, rate)
            return self._cum[epoch]

    def _epoch_stop_row(self, epoch: int) -> int | None:
        """Where a fractional ``max_epochs`` cuts ``epoch`` (None: it runs to its end)."""
        if self.max_epochs is None or epoch < math.floor(self.max_epochs):
            return None
        plan = self.plan(epoch)
        share_ = self.max_epochs - epoch  # in [0, 1)
        return int(plan.batch_ptr[math.ceil(share_ * plan.num_batches - 1e-9)])

    def state_dict(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "row": self.row, "steps": self.steps_done}

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state``; an iterator already running is stale and stops at its next step."""
        if int(state["seed"]) != self.seed:
            raise ValueError(f"loader state has seed {state['seed']}, this loader {self.seed}: plans would differ")
        self.epoch, self.row, self.steps_done = int(state["epoch"]), int(state["row"]), int(state["steps"])
        self.invalidate()

    def invalidate(self) -> None:
        """Drop prefetched steps (after a restore, or when the step fraction changes)."""
        self._generation += 1

    @property
    def step_fraction(self) -> Callable[[int], float] | None:
        """The cut of loader step ``n`` as a share of the target size (None: every step full size)."""
        return self._fraction

    def set_step_fraction(self, fraction: Callable[[int], float] | None) -> None:
        """Cut later steps to ``fraction(n)`` of the target (a batch-size ramp or back-off); None: full size."""
        self._fraction = fraction
        self.invalidate()

    @property
    def loss_tokens_per_step(self) -> int | None:
        return self.step_settings.loss_tokens_per_step

    @property
    def batches_per_epoch(self) -> int:
        """Planned batches of the current epoch over all ranks (the same in every epoch unless sources are
        mixed by weight, whose sampled documents differ from epoch to epoch)."""
        return self.plan(self.epoch).num_batches

    def steps_per_epoch(self, fraction: float = 1.0) -> int:
        """Steps of one epoch at a constant ``fraction`` (the schedule's horizon is counted in these)."""
        plan, cum, row, n = self.plan(self.epoch), self._cum_tokens(self.epoch), 0, 0
        while row < plan.num_rows:
            row, n = step_stop(plan, start=row, settings=self.step_settings, fraction=fraction, cum_tokens=cum), n + 1
        return n

    # ---------------------------------------------------------------------------- iteration
    def _positions(self) -> Iterator[tuple[int, int, int, int]]:
        """(epoch, start row, stop row, step count) of every step from the current state on."""
        epoch, row, count = self.epoch, self.row, self.steps_done
        while True:
            plan, stop_at = self.plan(epoch), self._epoch_stop_row(epoch)
            end = plan.num_rows if stop_at is None else stop_at
            if row >= end:
                if stop_at is not None or (self.max_epochs is not None and epoch + 1 >= self.max_epochs):
                    return  # max_epochs reached
                epoch, row = epoch + 1, 0
                continue
            stop = step_stop(
                plan,
                start=row,
                settings=self.step_settings,
                fraction=(self._fraction(count) if self._fraction is not None else 1.0),
                cum_tokens=self._cum_tokens(epoch),
                stop_row=stop_at,
            )
            yield epoch, row, stop, count
            row, count = stop, count + 1

    def build(self, epoch: int, start: int, stop: int) -> Step:
        """Collate this rank's share of the step ``[start, stop)`` of ``epoch``."""
        plan = self.plan(epoch)
        mine = share(plan, start=start, stop=stop, rank=self.rank, world_size=self.world_size)
        everyone = [share(plan, start=start, stop=stop, rank=r, world_size=self.world_size) for r in range(self.world_size)]
        width = max(len(x) for x in everyone)
        batches = [self._collate(plan, epoch, rows) for rows in mine]
        batches += [Batch.null(self.pad_id)] * (width - len(batches))
        return Step(
            tuple(batches),
            epoch=epoch + stop / plan.num_rows,
            documents=tuple(step_documents(plan, start, stop).tolist()),
            num_batches=sum(len(x) for x in everyone),
        )

    def _collate(self, plan: Plan | EpochRows, epoch: int, rows: np.ndarray) -> Batch:
        pieces = rows_of(plan, rows)
        try:
            batch = self.collator(self.store, pieces, step=(epoch, int(rows[0])))
        except Exception as e:
            docs = sorted({d for row in pieces for d, _, _ in row})
            raise DataError(
                f"rows {int(rows[0])}-{int(rows[-1])} of epoch {epoch} (documents {docs}) could not be "
                f"collated: {type(e).__name__}: {e}"
            ) from e
        return batch.pin_memory() if self.pin_memory else batch

    def __iter__(self) -> Iterator[Step]:
        """Steps from the current state onward (until ``max_epochs``); the state advances as each is yielded."""
        generation = self._generation
        for (epoch, _start, stop, count), step in self._prefetched(self._positions(), self.build):
            if self._generation != generation:
                return  # load_state_dict / invalidate was called: this iterator is stale
            self.epoch, self.row, self.steps_done = epoch, stop, count + 1
            yield step

    def iter_epoch(self, epoch: int = 0, max_batches: int | None = None) -> Iterator[Batch]:
        """One deterministic pass over this rank's share of ``epoch`` (evaluation), null-padded so
        every rank yields as many batches; leaves the loader's state alone. ``max_batches``: only the
        plan's first so many batches, over all ranks together (N ranks score what one does)."""
        plan = self.plan(epoch)
        ptr = plan.batch_ptr
        total = plan.num_batches if max_batches is None else min(plan.num_batches, max_batches)
        n = -(-total // self.world_size)  # batches per rank
        keys = [(epoch, b) for b in range(self.rank, n * self.world_size, self.world_size)]

        def build(epoch: int, b: int) -> Batch:
            if b >= total:
                return Batch.null(self.pad_id)
            return self._collate(plan, epoch, np.arange(ptr[b], ptr[b + 1], dtype=np.int64))

        for _, batch in self._prefetched(iter(keys), build):
            yield batch

    def _prefetched(self, keys, build) -> Iterator[tuple]:
        if self.prefetch == 0:
            for key in keys:
                yield key, build(*key[:3])
            return
        q: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def work():
            try:
                for key in keys:
                    item = (key, build(*key[:3]))
                    while not stop.is_set():
                        try:
                            q.put(item, timeout=0.1)
                            break
                        except queue.Full:
                            continue
                    if stop.is_set():
                        return
                q.put(_DONE)
            except BaseException as e:  # handed to the consumer, raised there
                q.put(e)

        thread = threading.Thread(target=work, name="densebatch-prefetch", daemon=True)
        thread.start()
        try:
            while True:
                item = q.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            while thread.is_alive():  # unblock a producer waiting on a full queue
                try:
                    q.get_nowait()
                except queue.Empty:
                    pass
                thread.join(timeout=0.05)

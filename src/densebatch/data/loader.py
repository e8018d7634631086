"""Loading: stream planned, collated batches from a document store, epoch after epoch, resumably.

``BatchLoader`` plans each epoch with ``plan_epoch`` (a pure function of lengths, settings, seed,
epoch, rank), collates batch by batch in a background thread (``prefetch`` batches ahead) and
pins memory when a GPU is present. Its state is ``(seed, epoch, batch_index)`` of the *next* batch
to hand out, counted when a batch is yielded, not when it is prefetched; so after
``load_state_dict`` the next batch is exactly the one that would have come next.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import numpy as np
import torch

from densebatch.batch import Batch
from densebatch.data.plan import Plan, PlanSettings, plan_epoch
from densebatch.errors import DataError

_DONE = object()


class BatchLoader:
    def __init__(
        self,
        store,
        settings: PlanSettings,
        collator,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        prefetch: int = 2,
        pin_memory: bool | None = None,
    ):
        if prefetch < 0:
            raise ValueError(f"prefetch: expected 0 or more batches; got {prefetch}")
        self.store, self.settings, self.collator = store, settings, collator
        self.seed, self.rank, self.world_size, self.prefetch = int(seed), rank, world_size, prefetch
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.lengths = np.asarray(store.lengths, dtype=np.int64)
        self.epoch, self.batch_index = 0, 0
        self._plans: dict[int, Plan] = {}
        self._lock = threading.Lock()  # the prefetch thread plans too

    # ------------------------------------------------------------------------- plans and state
    def plan(self, epoch: int) -> Plan:
        """This rank's plan of ``epoch`` (cached for the current and next epoch only)."""
        with self._lock:
            if epoch not in self._plans:
                self._plans = {e: p for e, p in self._plans.items() if e >= epoch - 1}
                self._plans[epoch] = plan_epoch(self.lengths, self.settings, self.seed, epoch, self.rank, self.world_size)
            return self._plans[epoch]

    @property
    def batches_per_epoch(self) -> int:
        """Batches per epoch on this rank (every epoch has the same count: plans differ only in order)."""
        return self.plan(self.epoch).num_batches

    def __len__(self) -> int:
        return self.batches_per_epoch

    def state_dict(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "batch_index": self.batch_index}

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state``; an iterator already running is stale and stops at its next batch."""
        if int(state["seed"]) != self.seed:
            raise ValueError(f"loader state has seed {state['seed']}, this loader {self.seed}: plans would differ")
        self.epoch, self.batch_index = int(state["epoch"]), int(state["batch_index"])
        self._generation = getattr(self, "_generation", 0) + 1

    # ---------------------------------------------------------------------------- iteration
    def build(self, epoch: int, index: int) -> Batch:
        """Collate batch ``index`` of ``epoch``; a failure names the batch and its documents."""
        plan = self.plan(epoch)
        rows = plan.batch(index)
        try:
            batch = self.collator(self.store, rows, step=(epoch, index))
        except Exception as e:
            raise DataError(
                f"batch {index} of epoch {epoch} (documents {plan.batch_docs(index)}) could not be "
                f"collated: {type(e).__name__}: {e}"
            ) from e
        return batch.pin_memory() if self.pin_memory else batch

    def __iter__(self) -> Iterator[Batch]:
        """Batches from the current state onward, forever; the state advances as each is yielded."""
        generation = getattr(self, "_generation", 0)

        def keys():
            epoch, index = self.epoch, self.batch_index
            while True:
                if index >= self.plan(epoch).num_batches:
                    epoch, index = epoch + 1, 0
                    continue
                yield epoch, index
                index += 1

        for (epoch, index), batch in self._prefetched(keys()):
            if getattr(self, "_generation", 0) != generation:
                return  # load_state_dict was called: this iterator is stale
            self.epoch, self.batch_index = epoch, index + 1
            if self.batch_index >= self.plan(epoch).num_batches:
                self.epoch, self.batch_index = epoch + 1, 0
            yield batch

    def iter_epoch(self, epoch: int) -> Iterator[Batch]:
        """One deterministic pass over ``epoch`` (evaluation); leaves the loader's state alone."""
        n = self.plan(epoch).num_batches
        for _, batch in self._prefetched((epoch, i) for i in range(n)):
            yield batch

    def _prefetched(self, keys) -> Iterator[tuple[tuple[int, int], Batch]]:
        if self.prefetch == 0:
            for key in keys:
                yield key, self.build(*key)
            return
        q: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def work():
            try:
                for key in keys:
                    item = (key, self.build(*key))
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

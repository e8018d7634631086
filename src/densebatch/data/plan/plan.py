"""The ``Plan``: one epoch's batches as CSR arrays, pieces (doc, start, stop) -> rows -> batches (see
``planner`` for how plans are made), with its statistics and the joining of plans made part by part."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Plan:
    """One epoch's batches for one rank. Arrays are int64; ``batch(i)`` gives rows of (doc, start, stop)."""

    doc: np.ndarray
    start: np.ndarray
    stop: np.ndarray
    row_ptr: np.ndarray  # (rows + 1,) into pieces
    batch_ptr: np.ndarray  # (batches + 1,) into rows
    pad_to_multiple_of: int = 1
    split: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # docs cut into > 1 piece
    truncated: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # docs cut short
    dropped: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # docs left out (drop_last)

    @property
    def num_batches(self) -> int:
        return len(self.batch_ptr) - 1

    @property
    def num_rows(self) -> int:
        return len(self.row_ptr) - 1

    def __len__(self) -> int:
        return self.num_batches

    def batch(self, i: int) -> list[list[tuple[int, int, int]]]:
        r0, r1 = int(self.batch_ptr[i]), int(self.batch_ptr[i + 1])
        p0, p1 = int(self.row_ptr[r0]), int(self.row_ptr[r1])
        pieces = list(zip(self.doc[p0:p1].tolist(), self.start[p0:p1].tolist(), self.stop[p0:p1].tolist()))
        bounds = (self.row_ptr[r0 : r1 + 1] - p0).tolist()
        return [pieces[a:b] for a, b in zip(bounds[:-1], bounds[1:])]

    def rows(self, a: int, b: int) -> Plan:
        """Rows ``[a, b)`` as a plan of their own (views, no copy): row 0 is row ``a``; one batch."""
        p0, p1 = int(self.row_ptr[a]), int(self.row_ptr[b])
        ptr = self.row_ptr[a : b + 1] - p0
        return Plan(self.doc[p0:p1], self.start[p0:p1], self.stop[p0:p1], ptr, np.array([0, b - a]), self.pad_to_multiple_of)

    def batch_docs(self, i: int) -> list[int]:
        """Sorted document indices in batch ``i`` (for error messages)."""
        p0, p1 = int(self.row_ptr[self.batch_ptr[i]]), int(self.row_ptr[self.batch_ptr[i + 1]])
        return np.unique(self.doc[p0:p1]).tolist()

    def iter_batches(self, start: int = 0):
        """Batches ``start``, ``start + 1``, ... in order (as ``batch``)."""
        return (self.batch(i) for i in range(start, self.num_batches))

    def batch_rows(self) -> np.ndarray:
        """Rows per batch."""
        return np.diff(self.batch_ptr)

    def doc_lists(self) -> list[list[list[int]]]:
        """Batches → rows → document indices (a split document appears once per piece)."""
        return [[[d for d, _, _ in row] for row in self.batch(i)] for i in range(self.num_batches)]

    def row_lengths(self) -> np.ndarray:
        if len(self.doc) == self.num_rows:  # one piece per row (all but packed): no segment sum
            return self.stop - self.start
        return _segment_sum(self.stop - self.start, self.row_ptr)

    def batch_stats(self) -> tuple[np.ndarray, np.ndarray]:
        """(real tokens, token slots) per batch; slots = rows x longest row rounded up."""
        rl = self.row_lengths()
        real = _segment_sum(rl, self.batch_ptr)
        longest = _segment_max(rl, self.batch_ptr)
        slots = np.diff(self.batch_ptr) * round_up(longest, self.pad_to_multiple_of)
        return real, slots

    def stats(self) -> dict:
        real, slots = self.batch_stats()
        return plan_stats(
            real, slots=slots, rows=self.num_rows, split=len(self.split), truncated=len(self.truncated), dropped=len(self.dropped)
        )


def plan_stats(real: np.ndarray, *, slots: np.ndarray, rows: int, split: int, truncated: int, dropped: int) -> dict:
    """A plan's report from its real tokens and slots per batch (whole or sharded plans alike)."""
    return {
        "fill_rate": float(real.sum() / max(1, slots.sum())),
        "batches": len(real),
        "rows": int(rows),
        "mean_real_tokens": float(real.mean()) if len(real) else 0.0,
        "max_real_tokens": int(real.max(initial=0)),
        "max_slots": int(slots.max(initial=0)),
        "split": int(split),
        "truncated": int(truncated),
        "dropped": int(dropped),
    }


def join_plans(parts: list[Plan], pad_to_multiple_of: int = 1) -> Plan:
    """Plans laid end to end: their pieces, rows and batches in order (document ids as they are)."""
    pieces = np.cumsum([0] + [len(p.doc) for p in parts])
    rows = np.cumsum([0] + [p.num_rows for p in parts])
    cat = lambda xs: np.concatenate(xs).astype(np.int64) if xs else np.zeros(0, np.int64)
    return Plan(
        doc=cat([p.doc for p in parts]),
        start=cat([p.start for p in parts]),
        stop=cat([p.stop for p in parts]),
        row_ptr=cat([p.row_ptr[:-1] + pieces[k] for k, p in enumerate(parts)] + [[pieces[-1]]]),
        batch_ptr=cat([p.batch_ptr[:-1] + rows[k] for k, p in enumerate(parts)] + [[rows[-1]]]),
        pad_to_multiple_of=pad_to_multiple_of,
        split=cat([p.split for p in parts]),
        truncated=cat([p.truncated for p in parts]),
        dropped=cat([p.dropped for p in parts]),
    )


def round_up(x, m: int):
    """``x`` (a number or an array) rounded up to a multiple of ``m``, as an array: the padded length of a row."""
    return (np.asarray(x) + m - 1) // m * m if m > 1 else np.asarray(x)


def _segment_sum(x: np.ndarray, ptr: np.ndarray) -> np.ndarray:
    out = np.zeros(len(ptr) - 1, np.int64)
    nonempty = ptr[1:] > ptr[:-1]
    if nonempty.any():  # reduceat: no cumulative-sum array and no concatenated copy of it
        out[nonempty] = np.add.reduceat(x, ptr[:-1][nonempty]) if len(x) else 0
    return out


def _segment_max(x: np.ndarray, ptr: np.ndarray) -> np.ndarray:
    out = np.zeros(len(ptr) - 1, np.int64)
    nonempty = ptr[1:] > ptr[:-1]
    if nonempty.any():
        out[nonempty] = np.maximum.reduceat(x, ptr[:-1][nonempty]) if len(x) else 0
    return out

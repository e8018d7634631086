"""A store's lengths source by source, read in place: views in memory, ``Span``s over the files on disk.

A prepared store keeps its sources end to end (``store.source_offsets()``); ``source_lengths`` gives each
source's lengths, the input ``mixture.select_mixture`` plans a weighted epoch from.
"""

from __future__ import annotations

import numpy as np

from densebatch.data.store.store import read_window, take


def source_lengths(store, lengths=None) -> list:
    """Each source's document lengths: views of ``lengths`` (default the store's) held in memory; of a
    store's lengths on disk, ``Span``s that read them by positioned reads when asked, so that no copy is
    made and no page of the files stays resident."""
    lengths = store.lengths if lengths is None else lengths
    o = store.source_offsets()
    if isinstance(lengths, np.ndarray) and not isinstance(lengths, np.memmap):
        return [lengths[o[s] : o[s + 1]] for s in range(len(o) - 1)]
    return [Span(lengths, int(o[s]), int(o[s + 1])) for s in range(len(o) - 1)]


class Span:
    """Entries ``a`` to ``b`` of ``base`` (a store's lengths on disk), read on each access by positioned
    reads (``store.take``): contiguous slices, integer indices and integer arrays, relative to ``a``."""

    def __init__(self, base, a: int, b: int) -> None:
        self.base, self.a, self.b = base, a, b

    def __len__(self) -> int:
        return self.b - self.a

    def __getitem__(self, key):
        if isinstance(key, slice):
            i, j, step = key.indices(len(self))
            if step != 1:
                raise IndexError("Span: only contiguous slices")
            return read_window(self.base, self.a + i, self.a + max(i, j))
        idx = np.asarray(key, np.int64)
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= len(self)):
            raise IndexError(f"Span: index out of range 0..{len(self) - 1}")
        got = take(self.base, idx + self.a)
        return got if idx.ndim else got[()]

"""Reading and checking a store's files: positioned reads that leave nothing resident (``read_ranges``,
``read_window``, ``take``), the completion marker, and per-document loss-token counts. Layout: ``store.py``."""

from __future__ import annotations

import json
import os
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from densebatch.data.store.joined import JoinedArray

MARKER = "COMPLETE"
WINDOW_TOKENS = 1 << 20  # tokens of the loss mask summed at once (8 MB of prefix sums), whatever the corpus
_GAP = 64  # take(): indices this close are read in one range


_FDS: dict[int, int] = {}  # id of a store's memory-mapped array -> a descriptor of its file, for positioned reads
_FDS_LOCK = threading.RLock()  # re-entrant: a collection inside the lock may run _close


def _file_of(array) -> int | None:
    """A read-only descriptor of the ``.npy`` file ``array`` maps whole (None: not such an array), closed
    when the array goes."""
    if not isinstance(array, np.memmap) or array.filename is None:
        return None
    with _FDS_LOCK:
        fd = _FDS.get(id(array))
        if fd is None:
            fd = os.open(array.filename, os.O_RDONLY)
            # a slice of a mapping (its offset is the file's) ends short of the file by an item or more; a whole
            # mapping at an id alignment (litdata, mds: offset 1-7) may leave less than an item after its last
            if not 0 <= os.fstat(fd).st_size - (array.offset + array.nbytes) < array.itemsize:
                os.close(fd)
                return None
            _FDS[id(array)] = fd
            weakref.finalize(array, _close, id(array), fd)
        return fd


def _close(key: int, fd: int) -> None:
    with _FDS_LOCK:
        _FDS.pop(key, None)
    os.close(fd)


def read_ranges(array: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """``array[a:b]`` for each range, end to end, as an array of its own. From a store's memory-mapped file
    by positioned reads: what training reads of a store never stays resident in the process (a page fault
    on a mapping would also map the kernel's read-ahead around it), whatever the corpus size."""
    starts, stops = np.asarray(starts, np.int64), np.asarray(stops, np.int64)
    if isinstance(array, JoinedArray):  # a mixture's split: each part read the same way
        return array.read_ranges(starts, stops, read_ranges)
    fd = _file_of(array)
    if fd is None and len(starts) == 1:
        return np.array(array[int(starts[0]) : max(int(starts[0]), int(stops[0]))])
    if fd is None:
        lens = stops - starts
        idx = np.repeat(starts - (np.cumsum(lens) - lens), lens) + np.arange(int(lens.sum()))
        return np.asarray(array[idx])
    size, base = array.itemsize, array.offset
    parts = [os.pread(fd, (b - a) * size, base + a * size) for a, b in zip(starts.tolist(), stops.tolist()) if b > a]
    return np.frombuffer(b"".join(parts), array.dtype)


def read_window(array: np.ndarray, start: int, stop: int) -> np.ndarray:
    """``array[start:stop]`` as an array of its own (``read_ranges``): a scan over a whole store leaves none of
    its pages resident in this process."""
    return read_ranges(array, np.array([start]), np.array([max(start, stop)]))


def windows(array, step: int) -> Iterator[tuple[int, np.ndarray]]:
    """``(start, array[start:start + step])`` for consecutive windows over all of ``array``, each read by
    ``read_window``: one scan of a store's array with one window in memory."""
    for a in range(0, len(array), step):
        yield a, read_window(array, a, min(len(array), a + step))


def take(array, idx) -> np.ndarray:
    """``array[idx]`` as an array of its own: from a store's files by positioned reads of the runs of nearby
    indices (``read_ranges``), so gathering from a corpus's lengths leaves nothing resident."""
    idx = np.asarray(idx, np.int64)
    if not isinstance(array, np.memmap | JoinedArray):
        return np.asarray(array)[idx]
    if not idx.size:
        return np.zeros(idx.shape, array.dtype)
    flat = idx.reshape(-1)
    order = np.argsort(flat, kind="stable")
    s = flat[order]
    cut = np.flatnonzero(np.diff(s) > _GAP) + 1
    a = s[np.concatenate([[0], cut])]
    b = s[np.concatenate([cut - 1, [len(s) - 1]])] + 1
    got = read_ranges(array, a, b)
    run = np.searchsorted(a, s, side="right") - 1
    out = np.empty(len(flat), array.dtype)
    out[order] = got[(np.cumsum(b - a) - (b - a))[run] + s - a[run]]
    return out.reshape(idx.shape)


def write_marker(directory: Path, payload: dict) -> None:
    """The completion marker, written last into a staged directory (fsynced when it is published)."""
    (directory / MARKER).write_text(json.dumps(payload, sort_keys=True), encoding="utf-8")


def marker_ok(directory: Path) -> bool:
    """True when ``directory`` holds a completion marker whose recorded file sizes all match."""
    try:
        payload = json.loads((directory / MARKER).read_text(encoding="utf-8"))
        return all((directory / name).stat().st_size == size for name, size in payload["sizes"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def document_loss_tokens(offsets: np.ndarray, loss_mask: np.ndarray) -> np.ndarray:
    """(n,) uint32: the loss tokens of each whole document (the mask's loss bits at its targets: every token
    but the first; a pair's mask also holds its parts, ``pair_layout.py``). Read window by window: memory is one window, not the corpus."""
    offsets = np.asarray(offsets, np.int64)
    n = len(offsets) - 1
    out = np.zeros(n, np.uint32)
    d = 0
    while d < n:  # documents [d, e): at most one window of tokens, or one longer document
        e = max(d + 1, int(np.searchsorted(offsets, offsets[d] + WINDOW_TOKENS, side="right")) - 1)
        e = min(e, n)
        a, b = int(offsets[d]), int(offsets[e])
        c = np.concatenate([[0], np.cumsum(read_window(loss_mask, a, b) & 1, dtype=np.int64)])  # the loss bit (pair_layout)
        ends = offsets[d + 1 : e + 1]
        out[d:e] = c[ends - a] - c[np.minimum(offsets[d:e] + 1, ends) - a]  # targets: every token but the first
        d = e
    return out

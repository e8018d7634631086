"""A mixture's split as a view of its sources' stores: each source's tokens are stored once.

A mixture entry (``cache_dir/mix-<key>/train``) holds no tokens of its own: ``parts.json`` names each
source's store of that split (a path relative to it, the source's index, its documents and tokens),
beside ``meta.json`` and the completion marker. ``DocumentStore.open`` reads it as one store whose
``tokens`` and ``loss_mask`` are ``JoinedArray``s (the parts end to end, source after source),
``offsets`` the parts' offsets shifted end to end and ``source`` each document's source index.
Before, a mixture copied every source's documents into a second full store.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

PARTS = "parts.json"


class JoinedArray:
    """Arrays end to end, read as one: slices, integer indices and ``read_ranges`` (positioned reads
    of each part's file), without copying the parts into one array."""

    def __init__(self, parts: list[np.ndarray]) -> None:
        self.parts = parts
        self.starts = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)
        self.dtype = parts[0].dtype if parts else np.dtype(np.int32)
        self.shape = (int(self.starts[-1]),)

    def __len__(self) -> int:
        return self.shape[0]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:  # np.asarray: the whole array, copied (explicit uses only)
        whole = np.concatenate([np.asarray(p) for p in self.parts]) if self.parts else np.zeros(0, self.dtype)
        return whole if dtype is None else whole.astype(dtype)

    def __getitem__(self, key):
        if isinstance(key, slice):
            a, b, step = key.indices(len(self))
            if step != 1:
                raise IndexError("JoinedArray: only contiguous slices")
            return self.read_ranges(np.array([a]), np.array([max(a, b)]))
        if isinstance(key, int | np.integer):
            i = int(key) + (len(self) if key < 0 else 0)
            p = int(np.searchsorted(self.starts, i, side="right")) - 1
            return self.parts[p][i - self.starts[p]]
        idx = np.asarray(key, np.int64)
        part = np.searchsorted(self.starts, idx, side="right") - 1
        out = np.empty(idx.shape, self.dtype)
        for j in np.unique(part):
            sel = part == j
            out[sel] = np.asarray(self.parts[j][idx[sel] - self.starts[j]])
        return out

    def read_ranges(self, starts: np.ndarray, stops: np.ndarray, read_part=None) -> np.ndarray:
        """``read_part(part, starts, stops)`` (``store.read_ranges``) over the parts: each part's ranges in one
        call, placed back in order (slicing when no reader is given)."""
        if read_part is None:
            read_part = _sliced
        starts, stops = self._within_parts(np.asarray(starts, np.int64), np.asarray(stops, np.int64))
        lens = stops - starts
        out = np.empty(int(lens.sum()), self.dtype)
        at = np.cumsum(lens) - lens
        part = np.searchsorted(self.starts, starts, side="right") - 1
        for j in np.unique(part):
            sel = np.flatnonzero((part == j) & (lens > 0))
            if not len(sel):
                continue
            got = read_part(self.parts[j], starts[sel] - self.starts[j], stops[sel] - self.starts[j])
            n = lens[sel]
            out[np.repeat(at[sel] - (np.cumsum(n) - n), n) + np.arange(int(n.sum()))] = got
        return out

    def _within_parts(self, starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The ranges cut at the parts' boundaries (a document never crosses one; a window may)."""
        last = np.searchsorted(self.starts, np.maximum(stops - 1, starts), side="right") - 1
        first = np.searchsorted(self.starts, starts, side="right") - 1
        if (first == last).all():
            return starts, stops
        a, b = [], []
        for s, e in zip(starts.tolist(), stops.tolist()):
            while s < e:
                cut = min(e, int(self.starts[int(np.searchsorted(self.starts, s, side="right"))]))
                a.append(s)
                b.append(cut)
                s = cut
        return np.array(a, np.int64), np.array(b, np.int64)


def _sliced(part: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    return np.concatenate([np.asarray(part[a:b]) for a, b in zip(starts.tolist(), stops.tolist())])


def write_parts(directory: Path, parts: list[tuple[Path, int, dict]], meta: dict) -> list[str]:
    """``parts.json`` and ``meta.json`` of a mixture split in ``directory`` (new): ``parts`` are (a source
    store's directory, its source index, its meta); returns the file names written."""
    directory.mkdir()
    entries = [
        {
            "path": os.path.relpath(store, directory),
            "source": s,
            "documents": int(m["num_documents"]),
            "tokens": int(m["num_tokens"]),
            "loss_tokens": int(m["num_loss_tokens"]),
        }
        for store, s, m in parts
    ]
    (directory / PARTS).write_text(json.dumps(entries, indent=1), encoding="utf-8")
    counts = np.zeros(len(meta.get("sources") or [0]), np.int64)
    for e in entries:
        counts[e["source"]] += e["documents"]
    meta = dict(
        meta,
        source_documents=counts.tolist(),
        num_documents=sum(e["documents"] for e in entries),
        num_tokens=sum(e["tokens"] for e in entries),
        num_loss_tokens=sum(e["loss_tokens"] for e in entries),
    )
    (directory / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True), encoding="utf-8")
    return [PARTS, "meta.json"]


def read_parts(directory: Path) -> list[dict] | None:
    """The parts a mixture split names (each with its ``dir``), or None for a store of its own."""
    if not (directory / PARTS).is_file():
        return None
    parts = json.loads((directory / PARTS).read_text(encoding="utf-8"))
    return [dict(p, dir=(directory / p["path"]).resolve()) for p in parts]

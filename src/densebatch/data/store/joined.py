"""A store's index of shards, and its arrays read as one (``JoinedArray``): each shard's files stay apart.

``index.json`` lists a store's shards in order: each with its directory (relative to the store), its
source, its documents, tokens, loss tokens and longest document, and its files' sizes. A mixture's
split (``cache_dir/mix-<key>/train``) holds no shard of its own: its index points at its sources'
shards (``write_mixture_index``), so each source's tokens are stored once. ``DocumentStore.open`` reads
a store as one: ``tokens``, ``loss_mask``, ``lengths`` and ``doc_loss`` are ``JoinedArray``s of the
shards' memory-mapped files (the array itself for one shard).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

INDEX = "index.json"
FORMAT = 4  # 3: one file per array (int64 offsets), mixtures as parts.json; 4: shards with an index


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
        idx = np.asarray(key)
        idx = np.flatnonzero(idx) if idx.dtype == bool else idx.astype(np.int64)
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
            if sel[-1] - sel[0] == len(sel) - 1:  # consecutive ranges: one stretch of the output
                out[at[sel[0]] : at[sel[0]] + len(got)] = got
                continue
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


def read_as_one(arrays: list, dtype=None):
    """``arrays`` end to end, read as one (``JoinedArray``: each part by its own reads, a part may itself be
    joined; a single array as it is when it already has the dtype), in ``dtype``: by default the widest integer
    type of the parts, so no id is cut, and int64 where numpy's rule would give float64 (uint64 beside a signed
    type: token ids fit int64)."""
    if dtype is None:
        dtype = np.result_type(*[a.dtype for a in arrays])
        dtype = np.dtype(np.int64) if dtype.kind == "f" else dtype
    if len(arrays) == 1 and arrays[0].dtype == dtype:
        return arrays[0]
    out = JoinedArray(list(arrays))
    out.dtype = np.dtype(dtype)
    return out


def _sliced(part: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    return np.concatenate([np.asarray(part[a:b]) for a, b in zip(starts.tolist(), stops.tolist())])


def write_index(directory: Path, shards: list[dict], meta: dict) -> list[str]:
    """``index.json`` (``shards``, in store order) and ``meta.json`` (``meta`` with the counts) of the store
    ``directory``; returns the file names written."""
    (directory / INDEX).write_text(json.dumps({"format": FORMAT, "shards": shards}, indent=1), encoding="utf-8")
    counts = np.zeros(max(len(meta.get("sources") or [0]), 1 + max((e["source"] for e in shards), default=0)), np.int64)
    for e in shards:
        counts[e["source"]] += e["documents"]
    meta = dict(
        meta,
        source_documents=counts.tolist(),
        num_documents=sum(e["documents"] for e in shards),
        num_tokens=sum(e["tokens"] for e in shards),
        num_loss_tokens=sum(e["loss_tokens"] for e in shards),
        max_length=max((e["max_length"] for e in shards), default=0),
    )
    (directory / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True), encoding="utf-8")
    return [INDEX, "meta.json"]


def write_mixture_index(directory: Path, parts: list[tuple[Path, int]], meta: dict) -> list[str]:
    """A mixture split in the new directory ``directory``: an index of its sources' shards (``parts``: a
    source store's directory and its source index, in store order), pointed at where they lie."""
    directory.mkdir()
    here = directory.resolve()  # as resolved as read_index's paths: a cache_dir reached through a link stays right
    shards = []
    for store, s in parts:
        for e in read_index(store) or []:
            shards.append(dict({k: v for k, v in e.items() if k != "dir"}, path=os.path.relpath(e["dir"], here), source=s))
    return write_index(directory, shards, meta)


def read_index(directory: Path) -> list[dict] | None:
    """The shards of the store ``directory`` in order, each with its ``dir`` resolved; None when it has no
    index (not a store of this format)."""
    if not (directory / INDEX).is_file():
        return None
    index = json.loads((directory / INDEX).read_text(encoding="utf-8"))
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        return None
    return [dict(e, dir=(directory / e["path"]).resolve()) for e in index["shards"]]

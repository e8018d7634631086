"""The assembly of one source's chunk files into its stores: dedupe, eval split, counts, then the writes.

``stream.prepare_chunks`` leaves per chunk a ``.npz`` of its documents and a ``.json`` of its counts; this
reads their per-document columns (about 30 bytes a document; near dedupe adds 8 a band), decides which
documents are kept and which are held out, fills the summary, and appends each chunk's kept documents to
the split's store (``store_write.StoreWriter``), one chunk in memory at a time. The documents, their order
and every count are those of the in-memory build the tests keep (``tests/data/prepare/in_memory_prepare.py``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from densebatch.data.prepare.dedupe import NUM_PERM, Keys, dedupe, dedupe_mode, lsh_shape, repeats, write_index, write_split_keys
from densebatch.data.prepare.documents import (
    DROPPED_NO_LOSS,
    DROPPED_NO_TARGET,
    DROPPED_OVERLONG,
    TRUNCATED,
    Builder,
    count_outcome,
)
from densebatch.data.prepare.sources import BadRecord
from densebatch.data.prepare.stream import CHUNK_FILES, Chunk, keeps_records, load_chunk
from densebatch.data.prepare.summary import PrepareSummary, percentiles
from densebatch.data.store.store_write import StoreWriter
from densebatch.errors import DataError


def assemble(
    b: Builder,
    *,
    chunks: list[Chunk],
    stage: Path,
    eval_fraction: float,
    train_dir: Path,
    eval_dir: Path,
    meta: dict,
    prior: Keys | None = None,
    held_chunks: int = 0,
) -> list[dict]:
    """Dedupe (against ``prior`` too: the kept records of a mixture's earlier sources), split, count and write
    the stores from the chunk files (and the dedupe keys of the kept records, for a later source); returns the
    held-out records. ``held_chunks``: the first chunks are ``data.eval_path``'s, whose documents are the eval
    split (deduped first, as the in-memory build does; no split by hash then)."""
    for c in chunks:
        c.stage = c.stage or stage
    columns = _Columns(chunks)
    _add_chunk_counts(b, columns.infos, held_chunks)
    keep, keys = _dedupe(b, columns, prior, index_dir=train_dir.parent)
    held = _held_out(columns, keep, eval_fraction, held_chunks)
    train, evals = _count(b, columns, keys, keep=keep, held=held, index_dir=train_dir.parent)
    del keys
    writers = {False: StoreWriter(train_dir, dict(meta, split="train"), b.cfg.shard_tokens)}
    if b.s.eval_documents:
        writers[True] = StoreWriter(eval_dir, dict(meta, split="eval"), b.cfg.shard_tokens)
    records = _write(b, columns, writers, wanted=train | evals, held=held, evals=evals)
    for w in writers.values():
        w.close()
    return records


class _Columns:
    """The chunk files' per-document columns, read as one array each (chunk by chunk)."""

    def __init__(self, chunks: list[Chunk]) -> None:
        self.chunks = chunks
        self.infos = [json.loads((c.stage / f"{CHUNK_FILES.format(c.index)}.json").read_text(encoding="utf-8")) for c in chunks]
        self.sizes = [info["documents"] for info in self.infos]
        self.n = sum(self.sizes)
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)

    def __call__(self, name: str, dtype, width: tuple = ()) -> np.ndarray:
        """Column ``name`` of every document, in input order."""
        out = np.empty((self.n, *width), dtype)
        at = 0
        for c, m in zip(self.chunks, self.sizes):
            if m:
                out[at : at + m] = load_chunk(c.stage, c.index, (name,))[name]
                at += m
        return out

    def signatures(self) -> Callable[[np.ndarray], np.ndarray]:
        """A reader of the MinHash signatures of given documents (ascending ids), chunk by chunk."""

        def read(idx: np.ndarray) -> np.ndarray:
            out = np.empty((len(idx), NUM_PERM), np.uint16)
            part = np.searchsorted(self.starts, idx, side="right") - 1
            for j in np.unique(part):
                sel = part == j
                c = self.chunks[j]
                out[sel] = load_chunk(c.stage, c.index, ("sig",))["sig"][idx[sel] - self.starts[j]]
            return out

        return read


def _add(counts: dict, more: dict) -> None:
    for k, v in more.items():
        counts[k] = counts.get(k, 0) + v


def _add_chunk_counts(b: Builder, infos: list[dict], held_chunks: int) -> None:
    """The chunks' records read, bad records and cleaning counts, in the order one process meets them."""
    # malformed records, all first (as one process reads every record before rendering: the training
    # file's, then eval_path's)
    for info in infos[held_chunks:] + infos[:held_chunks]:
        b.s.records_read += info["read"]
        for where, reason, message in info["read_bad"]:
            b.bad(BadRecord(where, reason, message))
    for info in infos:  # then bad records met while rendering, and cleaning counts, in input order
        for where, reason, message in info["bad"]:
            b.bad(BadRecord(where, reason, message))
        _add(b.cleaner.changed, info["changed"])
        _add(b.cleaner.dropped, info["dropped"])


def _dedupe(b: Builder, columns: _Columns, prior: Keys | None, *, index_dir: Path) -> tuple[np.ndarray, Keys]:
    """(which documents dedupe keeps (all, with it off), every document's text keys); the kept ones' keys are
    written for a later source."""
    cfg = b.cfg
    mode = dedupe_mode(cfg.clean)
    keys = Keys(columns("text_key", "V16"), columns("has_text_key", bool))
    if mode == "near":
        keys.has_sig = columns("has_sig", bool)
        keys.sigs = columns.signatures()
        keys.bands = columns("bands", np.uint64, (lsh_shape(cfg.clean.near_threshold)[0],))
    keep, drops = dedupe(keys, mode, cfg.clean.near_threshold, prior)
    _add(b.cleaner.dropped, drops)
    if mode != "off":
        write_index(index_dir, keys, keep)
    keys.bands = None
    return keep, keys


def _held_out(columns: _Columns, keep: np.ndarray, eval_fraction: float, held_chunks: int) -> np.ndarray:
    """The documents of the eval split: eval_path's, or the kept documents of the smallest content hashes."""
    held = np.zeros(columns.n, bool)
    if held_chunks:  # eval_path's documents
        held[: columns.starts[held_chunks]] = True
        return held
    docs = np.flatnonzero(keep)
    if eval_fraction <= 0 or len(docs) < 2:
        return held
    n_eval = min(len(docs) - 1, max(1, round(eval_fraction * len(docs))))
    # the smallest content hashes, ties by position (documents.split_eval): a stable sort
    held[docs[np.argsort(columns("key", np.uint64)[docs], kind="stable")[:n_eval]]] = True
    return held


def _count(b: Builder, columns: _Columns, keys: Keys, *, keep, held, index_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """(train, eval) documents after the length and target rules, with the summary's counts."""
    s: PrepareSummary = b.s
    outcome = columns("outcome", np.int8)
    for o in (TRUNCATED, DROPPED_OVERLONG, DROPPED_NO_TARGET, DROPPED_NO_LOSS):
        count_outcome(s, o, int(((outcome == o) & keep).sum()))
    final = keep & (outcome <= TRUNCATED)
    train = final & ~held
    evals = final & held
    s.eval_repeats_train = repeats(keys, train, evals)
    mode = dedupe_mode(b.cfg.clean)
    if mode == "off":  # for the leakage count across a mixture's parts (with dedupe on it is 0)
        write_split_keys(index_dir, keys.text[keys.has_text & train], keys.text[keys.has_text & evals])
    assert mode == "off" or not s.eval_repeats_train, "dedupe keeps one copy of each rendered text"
    s.cleaning_changed = dict(b.cleaner.changed)
    s.cleaning_dropped = dict(sorted(b.cleaner.dropped.items()))
    if not train.any():
        raise DataError(f"{s.source}: no usable training documents remain ({s.accounting()})")
    lengths = columns("lengths", np.uint32)
    loss = columns("loss", np.uint32)
    s.train_documents = int(train.sum())
    s.eval_documents = int(evals.sum())
    s.train_tokens = int(lengths[train].sum(dtype=np.int64))
    s.eval_tokens = int(lengths[evals].sum(dtype=np.int64))
    s.train_loss_tokens = int(loss[train].sum(dtype=np.int64))
    s.eval_loss_tokens = int(loss[evals].sum(dtype=np.int64))
    s.lengths = percentiles(lengths[train])
    return train, evals


def _write(b: Builder, columns: _Columns, writers: dict, *, wanted, held, evals) -> list[dict]:
    """Each chunk's ``wanted`` documents appended to their split's store (``held``: the eval one), one chunk in
    memory at a time; returns the held-out records (when kept: ``stream.keeps_records``)."""
    records: list[dict] = []
    start = 0
    for c, m in zip(columns.chunks, columns.sizes):
        p = load_chunk(c.stage, c.index, ("outcome", "lengths", "tokens", "mask"))
        kept = p["outcome"] <= TRUNCATED  # the chunk file holds the tokens of these, in order
        lens = p["lengths"][kept].astype(np.int64)
        to_eval = held[start : start + m][kept]
        wanted_here = wanted[start : start + m][kept]
        for split, w in writers.items():  # each split's documents of this chunk in one write
            docs_here = wanted_here & (to_eval == split)
            if docs_here.any():
                at = np.repeat(docs_here, lens)
                w.extend(p["tokens"][at], p["mask"][at], lens[docs_here])
        if keeps_records(b.cfg) and (here := np.flatnonzero(evals[start : start + m])).size:
            lines = (c.stage / f"{CHUNK_FILES.format(c.index)}.records.jsonl").read_text(encoding="utf-8").splitlines()
            records += [r for r in (json.loads(lines[k]) for k in here) if r is not None]
        start += m
    return records

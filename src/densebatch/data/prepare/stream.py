"""Streaming, parallel preparation of one source: memory bounded by the chunk, not the corpus.

The records are read in input order, ``data.chunk_records`` records a chunk (blocks of running text:
``data.chunk_records`` KiB of them). Each chunk is rendered,
cleaned, filtered, tokenised and finished (``documents.Builder``) by a pool of ``data.num_proc``
worker processes (inline when there is one chunk or one process), which write it to
``cache_dir/.chunks-<key>-<chunk_records>/chunk-000123.npz`` (its documents' tokens, loss mask,
lengths, content hashes, rendered-text hashes, with near dedupe their MinHash signatures and band hashes,
and what ``finish_one`` did to each; a JSONL, Parquet or save_to_disk chunk is a line or row range that the
worker reads itself) with its bad
records and counts beside it (and, for the embedded dataset, its records); the ``.npz`` is renamed
into place last, so a chunk file is complete or absent. What needs every document happens once all chunks are written, in input order, on
per-document arrays only (about 30 bytes a document; near dedupe adds 8 a band): the dedupe (``dedupe.py``:
the first copy kept; against a mixture's earlier sources too), the eval split (the smallest content
hashes, as ``documents.split_eval``), the counts, among them held-out documents that repeat a training one.
The stores are then written by appending each chunk's kept documents to the split's files
(``store_write.StoreWriter``: shards of ``data.shard_tokens``), one chunk in memory at a time.

The documents, their order and every count are those of the tests' in-memory build
(``tests/data/prepare/in_memory_prepare.py``),
byte for byte, for any number of workers (tested). A run that dies keeps its chunk files: the next
prepare of the same inputs and settings reads the input again but tokenises only the chunks that are
missing. A worker that dies fails the prepare with one line naming the chunk's first and last record.
``data.eval_path`` is chunked too (into ``eval/`` of the same directory) and assembled first: its documents
are the eval split, and with dedupe on a training record that repeats one of them is dropped.
With ``text_split: chunks`` the records are blocks of running text (``text_blocks.py``), kept whole by
the workers and cut into documents by ``stream_cut.py`` before the assembly. A learned ``bpe:N`` tokenizer
is trained first, from the records as they are read (``learned_bpe.learn_bpe``), then the chunks are
tokenised with it. Every source streams.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import multiprocessing
import os
import shutil
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import chain, islice
from pathlib import Path

import numpy as np

from densebatch.atomic import pid_alive
from densebatch.config import DataConfig
from densebatch.data.prepare import text_blocks
from densebatch.data.prepare.dedupe import Keys
from densebatch.data.prepare.documents import (
    KEPT,
    TRUNCATED,
    Builder,
    finish_one,
)
from densebatch.data.prepare.row_ranges import RowRange, cut
from densebatch.data.prepare.sources import LineRange, jsonl_ranges
from densebatch.data.prepare.summary import PrepareSummary
from densebatch.data.prepare.tokenizers import Tokenizer
from densebatch.data.store.pair_layout import loss_bit
from densebatch.errors import DataError

CHUNK_FILES = "chunk-{:06d}"


class WorkerDied(DataError):
    """A preparation worker died: its chunk files stay for the next run to go on from."""


def workers(cfg: DataConfig) -> int:
    """``data.num_proc``, or (0) the cores this process may run on, shared with the other ranks of this
    machine under torchrun (``LOCAL_WORLD_SIZE``)."""
    if cfg.num_proc:
        return cfg.num_proc
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def stage_dir(final: Path, cfg: DataConfig) -> Path:
    """Where the chunk files of the entry ``final`` are written (and kept until it is whole); named by the
    chunk size too, so a run with another ``data.chunk_records`` never takes them for its own."""
    return final.with_name(f".chunks-{final.name}-{cfg.chunk_records}")


# ----------------------------------------------------------------------------------------- a chunk
_TOK: Tokenizer | None = None


def _init_worker(tok: Tokenizer) -> None:
    global _TOK
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # parallel across processes, not inside each
    _TOK = tok


def _run_chunk(cfg: DataConfig, *, index: int, work, stage: str, blocks: bool, tok: Tokenizer | None = None) -> int:
    """Prepare chunk ``index`` into ``stage``: ``work`` is its good records, or its ``LineRange`` (JSONL) or
    ``RowRange`` (Parquet, save_to_disk), read here; returns ``index``."""
    running = Path(stage) / f".running-{index:06d}-{os.getpid()}"  # names the chunk if this process dies
    running.touch()
    _prepare_chunk(cfg, index=index, work=work, stage_dir=Path(stage), tok=tok if tok is not None else _TOK, blocks=blocks)
    running.unlink(missing_ok=True)
    return index


def _prepare_chunk(cfg: DataConfig, *, index: int, work, stage_dir: Path, tok: Tokenizer, blocks: bool = False) -> None:
    """``blocks``: blocks of running text (``text_blocks.py``), kept whole here: cut into documents later."""
    b = Builder(cfg, tok, PrepareSummary(), collect_bad=True)
    items = list(b.stream(cfg.path, "jsonl", work)) if isinstance(work, (LineRange, RowRange)) else work
    read_bad, b.bad_records = b.bad_records, []
    docs = b.documents(items)
    info = {
        "documents": len(docs),
        "read": b.s.records_read,
        "read_bad": [[x.where, x.reason, x.message] for x in read_bad or []],
        "bad": [[x.where, x.reason, x.message] for x in b.bad_records or []],
        "changed": b.cleaner.changed,
        "dropped": b.cleaner.dropped,
    }
    if keeps_records(cfg):
        records = "".join(json.dumps(d.record, ensure_ascii=False, default=str) + "\n" for d in docs)
        (stage_dir / f"{CHUNK_FILES.format(index)}.records.jsonl").write_text(records, encoding="utf-8")
    write_chunk(b, stage_dir=stage_dir, index=index, docs=docs, info=info, finish=not blocks)


def write_chunk(b: Builder, *, stage_dir: Path, index: int, docs: list, info: dict, finish: bool = True) -> None:
    """Chunk file ``index`` of ``docs`` (``finish``: judged by ``finish_one`` first, else all kept) with its
    ``info``: per-document columns, then the kept documents' tokens and mask."""
    outcomes = np.array([finish_one(d, b.cfg) if finish else KEPT for d in docs], np.int8)
    kept = [d for d, o in zip(docs, outcomes) if o <= TRUNCATED]
    arrays = {
        "key": np.array([int.from_bytes(d.key, "big") for d in docs], np.uint64),
        "text_key": np.array([d.text_key or bytes(16) for d in docs], "V16"),
        "has_text_key": np.array([d.text_key is not None for d in docs], bool),
        "outcome": outcomes,
        "lengths": np.array([len(d.tokens) if o <= TRUNCATED else 0 for d, o in zip(docs, outcomes)], np.uint32),
        "loss": np.array([int(loss_bit(d.mask).sum()) if o <= TRUNCATED else 0 for d, o in zip(docs, outcomes)], np.uint32),
        "tokens": np.concatenate([d.tokens for d in kept]).astype(np.int32) if kept else np.zeros(0, np.int32),
        "mask": np.concatenate([d.mask for d in kept]).astype(np.uint8) if kept else np.zeros(0, np.uint8),
    }
    if b.signer is not None:  # near dedupe: each document's signature and band hashes (dedupe.py)
        near = Keys.of_docs(docs, b.signer.bands)
        arrays.update(has_sig=near.has_sig, bands=near.bands, sig=near.sigs(np.arange(len(docs))))
    name = CHUNK_FILES.format(index)
    (stage_dir / f"{name}.json").write_text(json.dumps(info), encoding="utf-8")
    tmp = stage_dir / f".{name}.{os.getpid()}.npz"
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
    os.replace(tmp, stage_dir / f"{name}.npz")  # last: a chunk file is whole or absent


# ----------------------------------------------------------------------------------------- the source
@dataclass
class Chunk:
    index: int
    first: str  # where its first and last records are, for a message
    last: str
    work: object = None  # what a worker is given: a LineRange, or the good records
    stage: Path | None = None  # where its files are


def keeps_records(cfg: DataConfig) -> bool:
    """Held-out records are kept (``eval_records.jsonl``) for the embedded dataset, whose answers the
    exact-match accuracy checks; a file's held-out documents are its eval store."""
    return cfg.path is None


def _work(b: Builder, path: str | None, fmt: str) -> Iterator[Chunk]:
    """The source's chunks in order: JSONL as line ranges, Parquet and save_to_disk datasets as row ranges,
    that the workers (of this rank only) read and parse themselves (this process only finds the cuts), any other input as lists of
    good records read here."""
    if fmt == "jsonl" and path is not None:
        for i, r in enumerate(jsonl_ranges(path, b.cfg.chunk_records)):
            yield Chunk(i, f"{path}:{r.first_line}", f"{path}:{r.last_line}", r)
        return
    if path is not None and (rows := cut(path, fmt, b.cfg.chunk_records)):  # one input (a pattern's: parts.py)
        fields, ranges = rows
        b.check_columns(path, fields)  # as the first record read here would have been
        for i, r in enumerate(ranges):
            yield Chunk(i, *r.names(), r)
        return
    items = b.stream(path, fmt)
    size = b.cfg.chunk_records
    if fmt == "text" and b.cfg.text_split == "chunks":  # blocks of running text: about a KiB a record's worth
        size = max(1, size * 1024 // text_blocks.BLOCK_BYTES)
    for i, part in enumerate(iter(lambda: list(islice(items, size)), [])):
        yield Chunk(i, part[0][0], part[-1][0], part)


def prepare_chunks(
    b: Builder,
    *,
    path: str | None,
    fmt: str,
    stage: Path,
    num_proc: int,
    share: tuple[int, int] = (0, 1),
    mine: bool = False,
) -> list[Chunk]:
    """Prepare every chunk of ``path`` that ``stage`` does not already hold, on ``num_proc`` processes;
    the chunks, in order (malformed records found while reading here are reported through ``b``).
    ``share`` (rank, ranks): only the chunks whose index is the rank's modulo the ranks; ``mine``: return
    only those."""
    stage.mkdir(parents=True, exist_ok=True)
    for m in [*stage.glob(".running-*"), *stage.glob(".chunk-*")]:  # left by a run that died (never read)
        if not pid_alive(int(m.name.split(".")[-2] if m.name.endswith(".npz") else m.name.split("-")[-1])):
            m.unlink(missing_ok=True)  # another rank's (or worker's) of a live process stays
    cfg, tok = b.cfg, b.tok
    blocks = fmt == "text" and cfg.text_split == "chunks"
    done = {p.name for p in stage.glob("chunk-*.npz")}
    chunks: list[Chunk] = []

    rank, ranks = share

    def todo():
        for c in _work(b, path, fmt):
            c.stage = stage
            if c.index % ranks != rank:
                if not mine:
                    chunks.append(c)
                continue
            chunks.append(c)
            if f"{CHUNK_FILES.format(c.index)}.npz" not in done:
                yield c

    jobs = todo()
    first = list(islice(jobs, 2))
    if num_proc <= 1 or len(first) < 2:  # one chunk (or one process): no pool to start
        for c in chain(first, jobs):
            _run_chunk(cfg, index=c.index, work=c.work, stage=str(stage), blocks=blocks, tok=tok)
            c.work = None  # its records are not kept once prepared
        return chunks
    # fork where there is one (as datasets.map does): a spawned worker would import the caller's __main__,
    # which a script without an `if __name__ == "__main__"` guard cannot survive; a forked one is told by
    # tokenizers not to use its threads, and none of the parent's threads runs in it
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    with cf.ProcessPoolExecutor(num_proc, mp_context=ctx, initializer=_init_worker, initargs=(tok,)) as pool:
        pending: dict[cf.Future, int] = {}
        for c in chain(first, jobs):
            pending[pool.submit(_run_chunk, cfg, index=c.index, work=c.work, stage=str(stage), blocks=blocks)] = c.index
            c.work = None  # sent: not kept here
            if len(pending) >= 2 * num_proc:  # bounded: at most this many chunks of records in memory
                _wait(pending, chunks=chunks, stage=stage, how=cf.FIRST_COMPLETED, pool=pool)
        _wait(pending, chunks=chunks, stage=stage, how=cf.ALL_COMPLETED, pool=pool)
    return chunks


def _wait(pending: dict, *, chunks: list[Chunk], stage: Path, how, pool: cf.ProcessPoolExecutor) -> None:
    finished, _ = cf.wait(list(pending), return_when=how)
    for fut in sorted(finished, key=pending.get):
        i = pending.pop(fut)
        try:
            fut.result()
        except cf.process.BrokenProcessPool:
            k = _dead_chunk(pool, stage, i)
            c = next(c for c in chunks if c.index == k)
            held = len(list(stage.glob("chunk-*.npz")))
            raise WorkerDied(
                f"preparing records {c.first} to {c.last} (chunk {k}): a worker process died; run again to go on "
                f"({held} chunks already prepared are kept in {stage})"
            ) from None


def _dead_chunk(pool: cf.ProcessPoolExecutor, stage: Path, failed: int) -> int:
    """The chunk whose worker died: once the pool has stopped every worker, the one that did not end by
    the pool's SIGTERM (nor normally) names it through its ``.running-<chunk>-<pid>`` marker."""
    procs = dict(getattr(pool, "_processes", None) or {})
    pool.shutdown(wait=True, cancel_futures=True)
    stopped = {0, -signal.SIGTERM, 128 + signal.SIGTERM, None}
    dead = {pid for pid, p in procs.items() if p.exitcode not in stopped}
    running = [m.name.split("-") for m in stage.glob(".running-*")]
    blamed = sorted(int(chunk) for _, chunk, pid in running if int(pid) in dead)
    return blamed[0] if blamed else failed


def load_chunk(stage: Path, index: int, names) -> dict[str, np.ndarray]:
    with np.load(stage / f"{CHUNK_FILES.format(index)}.npz", allow_pickle=False) as z:
        return {k: z[k] for k in names}


def remove_stage(stage: Path) -> None:
    shutil.rmtree(stage, ignore_errors=True)

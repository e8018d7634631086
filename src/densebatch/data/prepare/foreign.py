"""The cache entry of a foreign corpus: its documents checked once and described in ``data.cache_dir``, then opened as stores.

``prepare_foreign(cfg, tok, meta_of)`` is what ``prepare`` does for a ``data.format`` another engine
wrote (``FORMATS``). The entry ``cache_dir/<format>-<key>/`` (key: every input file's identity, or
with ``data.verify_inputs: hash`` its bytes, and every setting that changes the documents) holds
``train/`` and ``eval/`` (``view.SplitWriter``, written a block of documents at a time), ``corpus.json`` (the token files each split reads,
with their sizes, checked again at every open) and ``summary.json``; it is built under the entry's
lock, in a staged directory renamed into place, marker last, as our own entries are. Nothing is ever
written beside the corpus: its files are opened read-only.

Building reads the index files and scans every token once, window by window, for ids outside the
tokenizer's vocabulary. Eval split (no ``data.eval_path``): in each input file by itself, document
``i`` (its place in that file) is held out when ``splitmix64(i) < eval_fraction * 2**64`` (the one
with the smallest hash when that picks none), so appending documents to a file never moves another
between train and eval, and no seed changes it. ``data.eval_path`` in the same format is the eval
split whole. Documents of fewer than 2 tokens (nothing to predict) are dropped and counted;
``data.max_seq_len`` truncates (``overlong: truncate``) or drops (``drop``) longer ones.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from densebatch.config import DataConfig
from densebatch.data.prepare.cache import entry_lock, input_key
from densebatch.data.prepare.summary import PrepareSummary, percentiles
from densebatch.data.store.formats import datatrove, litdata, mds, megatron
from densebatch.data.store.formats.mapped import map_part
from densebatch.data.store.formats.view import ForeignStore, SplitWriter
from densebatch.data.store.joined import read_as_one
from densebatch.data.store.store import marker_ok, read_ranges, room_for_files, staged_store, write_marker
from densebatch.errors import DataError

FORMATS = ("megatron", "datatrove", "litdata", "mds")
ENTRY_VERSION = 2  # 2: first_tokens.npy where the starts are unsorted (1 read such entries' loss masks wrong)
_SCAN = 1 << 24  # tokens read at once by the vocabulary scan
_BLOCK = 1 << 22  # documents handled at once while the entry is built


@dataclass(frozen=True)
class Input:
    """One file of a foreign corpus as read: its token file, tokens, and each document's first token and length."""

    name: Path  # the file named in messages (the token file)
    files: tuple[Path, ...]  # every file it is read from (the key's identity)
    tokens: np.ndarray
    doc_starts: np.ndarray  # (documents,) int64, read a block at a time (``[a:b]``; megatron's computes each block)
    doc_lengths: np.ndarray  # (documents,) int64, the same
    loss: np.ndarray | None = None  # (tokens,) the writer's loss mask (1 = carries loss as a target), if it wrote one
    parts: tuple[dict, ...] = ()  # how tokens is mapped again at every open (``_tokens_of``), in order


def _whole(name: Path, tokens: np.ndarray, loss_file: Path | None = None) -> tuple[dict, ...]:
    loss = None if loss_file is None else str(loss_file)
    size = name.stat().st_size
    return ({"file": str(name), "dtype": tokens.dtype.str, "offset": 0, "tokens": len(tokens), "size": size, "loss": loss},)


def foreign_format(cfg: DataConfig) -> str | None:
    """The foreign format ``cfg`` reads (``FORMATS``), or None for records densebatch tokenises itself and for
    a mixture (``data.sources``: ``foreign_mixture`` reads one holding foreign sources)."""
    if cfg.format in FORMATS and not cfg.sources:
        if cfg.path is None:
            raise DataError(f"data.format {cfg.format}: data.path names the corpus (a prefix, a folder or a pattern)")
        return cfg.format
    return None


def _paths(path: str, fmt: str) -> list[Path]:
    """The inputs ``path`` names, sorted: itself, a folder's, or a glob pattern's (one per prefix)."""
    if fmt == "datatrove":
        return datatrove.shards_of(path)
    if fmt == "litdata":
        return litdata.chunks_of(path)
    if fmt == "mds":
        return mds.shards_of(path)
    matches = sorted(glob.glob(path, recursive=True)) if glob.has_magic(path) else [path]
    if not matches:
        raise DataError(f"{path}: the pattern matches no file")
    return list({p: None for m in matches for p in megatron.prefixes_of(m)})


def _read(fmt: str, p: Path, cfg: DataConfig) -> Input:
    if fmt == "megatron":
        f = megatron.read_indexed(p)
        return Input(
            f.bin_path, (f.idx_path, f.bin_path), f.tokens, f.doc_starts, f.doc_lengths, None, _whole(f.bin_path, f.tokens)
        )
    if fmt in ("litdata", "mds"):
        column, dtype = cfg.fields.input_ids, cfg.bytes_dtype  # mds: which column holds the ids, and a bytes column's dtype
        c = litdata.read_chunk(p) if fmt == "litdata" else mds.read_shard(p, column=column, bytes_dtype=dtype)
        tokens = read_as_one([map_part(x) for x in c.parts])
        return Input(c.path, (c.path,), tokens, c.doc_starts, c.doc_lengths, None, tuple(dict(x, loss=None) for x in c.parts))
    d = datatrove.read_shard(p)
    loss_file = d.files[-1] if d.loss is not None else None
    return Input(d.path, d.files, d.tokens, d.doc_starts, d.doc_lengths, d.loss, _whole(d.path, d.tokens, loss_file))


def _files(fmt: str, p: Path) -> list[Path]:
    """The files of input ``p`` that its documents depend on (its identity in the key)."""
    if fmt == "megatron":
        return [Path(f"{p}.idx"), Path(f"{p}.bin")]
    if fmt == "litdata":
        return [p, p.parent / litdata.INDEX]
    if fmt == "mds":
        return [p, mds.index_of(p)[0]]
    return [p] + [q for q in (Path(f"{p}.index"), Path(f"{p}.loss"), Path(f"{p}.metadata")) if q.exists()]


def _key(cfg: DataConfig, *, fmt: str, tok, inputs: list[Path], evals: list[Path]) -> str:
    files = lambda p: _files(fmt, p)  # noqa: E731
    ident = [[input_key(str(f), cfg.verify_inputs) if f.exists() else str(f) for f in files(p)] for p in inputs]
    eval_ident = [[input_key(str(f), cfg.verify_inputs) if f.exists() else str(f) for f in files(p)] for p in evals]
    material = {
        "version": ENTRY_VERSION,
        "format": fmt,
        "inputs": ident,
        "eval_inputs": eval_ident,
        "eval_fraction": None if evals else cfg.eval_fraction,
        "max_seq_len": cfg.max_seq_len,
        "overlong": cfg.overlong,
        "tokenizer": tok.fingerprint(),
        "vocab_size": tok.vocab_size,
        "pad_id": tok.pad_id,
    }
    if fmt == "mds":  # which column holds the ids, and what a bytes column's ids are
        material["mds"] = [cfg.fields.input_ids, cfg.bytes_dtype]
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()[:24]


def splitmix64(i: np.ndarray) -> np.ndarray:
    """SplitMix64 of each of ``i`` (uint64): a fixed, well-mixed hash of a document's place in its file."""
    with np.errstate(over="ignore"):
        z = np.asarray(i, np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def held_out(n: int, fraction: float, a: int = 0, b: int | None = None) -> np.ndarray:
    """(b - a,) bool: which of documents a .. b - 1 of a file of ``n`` the eval split takes (module docstring)."""
    b = n if b is None else b
    if fraction <= 0 or n == 0:
        return np.zeros(b - a, bool)
    threshold = np.uint64(min(int(fraction * 2.0**64), 2**64 - 1))
    out = splitmix64(np.arange(a, b, dtype=np.uint64)) < threshold
    if n > 1 and not out.any() and (fallback := _fallback(n, threshold)) is not None and a <= fallback < b:
        out[fallback - a] = True
    return out


@functools.lru_cache(maxsize=64)
def _fallback(n: int, threshold: np.uint64) -> int | None:
    """The document of a file of ``n`` with the smallest hash, when the threshold takes none (else None)."""
    best, at = None, 0
    for a in range(0, n, _BLOCK):
        h = splitmix64(np.arange(a, min(n, a + _BLOCK), dtype=np.uint64))
        if (h < threshold).any():
            return None
        k = int(np.argmin(h))
        if best is None or h[k] < best:
            best, at = h[k], a + k
    return at


def _windows(lengths: np.ndarray):
    """``(d, e)``: consecutive runs of documents of at most ``_SCAN`` tokens together (or one longer document)."""
    d = 0
    while d < len(lengths):
        e = min(len(lengths), max(d + 1, d + int(np.searchsorted(np.cumsum(lengths[d : d + _SCAN]), _SCAN, side="right"))))
        yield d, e
        d = e


def _check_ids(x: Input, *, starts: np.ndarray, lengths: np.ndarray, first: int, vocab: int, tok_name: str) -> None:
    """Every token id of documents ``first`` .. of ``x`` (their ``starts`` and ``lengths``) within 0 .. vocab - 1,
    a window of documents at a time; ``DataError`` naming the file, the document and the token."""
    if x.tokens.dtype.kind == "u" and np.iinfo(x.tokens.dtype).max < vocab:
        return  # every value the dtype holds is an id of the vocabulary
    for d, e in _windows(lengths):
        w = read_ranges(x.tokens, starts[d:e], starts[d:e] + lengths[d:e])
        bad = (w < 0) | (w >= vocab)
        if bad.any():
            k = int(np.argmax(bad))
            ends = np.cumsum(lengths[d:e])
            j = int(np.searchsorted(ends, k, side="right"))
            raise DataError(
                f"{x.name}: token id {int(w[k])} at token {k - int(ends[j] - lengths[d + j])} of document {first + d + j} "
                f"is outside the {vocab} ids of data.tokenizer {tok_name}: set data.tokenizer to the tokenizer that wrote this corpus"
            )


def _keep(x: Input, *, starts: np.ndarray, lengths: np.ndarray, cfg: DataConfig, s: PrepareSummary):
    """The starts, lengths and loss tokens of the documents (``starts``, ``lengths``) of ``x`` that a split keeps
    (too short dropped; overlong truncated or dropped; with the writer's mask, those left without a loss token
    dropped)."""
    short = lengths < 2
    s.dropped_no_target += int(short.sum())
    long = lengths > cfg.max_seq_len
    if cfg.overlong == "drop":
        s.dropped_overlong += int((long & ~short).sum())
        keep = ~short & ~long
    else:
        s.truncated += int((long & ~short).sum())
        keep = ~short
    starts, lengths = starts[keep], np.minimum(lengths[keep], cfg.max_seq_len)
    if x.loss is None:
        return starts, lengths, lengths - 1
    loss = _loss_tokens(x.loss, starts, lengths)
    s.dropped_no_loss += int((loss == 0).sum())
    return starts[loss > 0], lengths[loss > 0], loss[loss > 0]


def _loss_tokens(mask: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Each document's loss tokens under the writer's ``mask`` (its first token never one), read a window of
    documents at a time."""
    out = np.zeros(len(starts), np.int64)
    for d, e in _windows(lengths):
        got = read_ranges(mask, starts[d:e] + 1, starts[d:e] + lengths[d:e]) != 0  # targets: every token but the first
        n = lengths[d:e] - 1
        c = np.concatenate([[0], np.cumsum(got, dtype=np.int64)])
        ends = np.cumsum(n)
        out[d:e] = c[ends] - c[ends - n]
    return out


def _build(tmp: Path, *, cfg: DataConfig, fmt: str, tok, meta_of, inputs: list[Path], evals: list[Path]) -> PrepareSummary:
    s = PrepareSummary(source=str(cfg.path), format=fmt, tokenizer=tok.name, template="none (token ids as written)")
    s.eval_repeats_train = -1  # not checked: no text (summary: "not checked")
    s.eval_source = f"eval_path {cfg.eval_path}" if evals else f"{cfg.eval_fraction:g} of each file's documents by index hash"
    corpus: dict[str, list] = {"train": [], "eval": []}
    writers: dict[str, SplitWriter] = {}
    offsets = {"train": 0, "eval": 0}
    for names, split_of in ((inputs, None), (evals, "eval")):
        for p in names:
            x = _read(fmt, p, cfg)
            n = len(x.doc_lengths)
            s.records_read += n
            base = {}
            for split in ("eval",) if split_of == "eval" else ("train", "eval"):
                _same_masks(x, corpus[split])
                corpus[split].extend(x.parts)
                base[split] = offsets[split]
                offsets[split] += len(x.tokens)
            for a in range(0, n, _BLOCK):  # a block of documents at a time: memory bounded whatever the corpus
                b = min(n, a + _BLOCK)
                starts, lengths = np.asarray(x.doc_starts[a:b], np.int64), np.asarray(x.doc_lengths[a:b], np.int64)
                _check_ids(x, starts=starts, lengths=lengths, first=a, vocab=tok.vocab_size, tok_name=tok.name)
                ev = np.ones(b - a, bool) if split_of == "eval" else held_out(n, 0.0 if evals else cfg.eval_fraction, a, b)
                for split, sel in (("train", ~ev), ("eval", ev)):
                    if split not in base or not sel.any():
                        continue
                    if split not in writers:
                        writers[split] = SplitWriter(tmp / split, meta_of(split))
                    kept, length, loss = _keep(x, starts=starts[sel], lengths=lengths[sel], cfg=cfg, s=s)
                    writers[split].add(kept + base[split], length, loss)
    for split in ("train", "eval"):
        w = writers.get(split)
        if w is None:
            corpus[split] = []
            continue
        w.close()
        if split == "eval" and not w.documents:  # every held-out document dropped (too short): no eval split
            shutil.rmtree(tmp / split)
            corpus[split] = []
            continue
        setattr(s, f"{split}_documents", w.documents)
        setattr(s, f"{split}_tokens", w.tokens)
        setattr(s, f"{split}_loss_tokens", w.loss_tokens)
    if "train" in writers and writers["train"].documents:
        s.lengths = percentiles(np.load(tmp / "train" / "lengths.npy", mmap_mode="r"))
    if not s.train_documents and s.records_read and s.dropped_no_target == s.records_read:
        raise DataError(
            f"{cfg.path}: each of its {s.records_read} documents is one token or none (the end-of-text alone?): the "
            "tokenizer that wrote it encoded no text, as a tokenizer.json with an empty vocabulary does; write the corpus "
            "again with one that encodes (docs/data.md)"
        )
    if not s.train_documents:
        raise DataError(f"{cfg.path}: no document of 2 tokens or more to train on")
    (tmp / "corpus.json").write_text(json.dumps(corpus, indent=1), encoding="utf-8")
    (tmp / "summary.json").write_text(json.dumps(s.as_dict(), indent=1), encoding="utf-8")
    files = ["corpus.json", "summary.json"] + [
        f"{sp}/{n}" for sp in ("train", "eval") if (tmp / sp).is_dir() for n in _SPLIT_NAMES if (tmp / sp / n).exists()
    ]
    write_marker(tmp, {"format": ENTRY_VERSION, "sizes": {f: (tmp / f).stat().st_size for f in files}})
    return s


_SPLIT_NAMES = ("starts.npy", "lengths.npy", "doc_loss.npy", "meta.json", "first_tokens.npy")


def _same_masks(x: Input, before: list[dict]) -> None:
    if before and (before[0]["loss"] is None) != (x.loss is None):
        has, lacks = (x.name, before[0]["file"]) if x.loss is not None else (before[0]["file"], x.name)
        raise DataError(f"{lacks}: no loss mask file, while {has} has one: write the corpus with or without them throughout")


def _masks_of(files: list[dict], final: Path):
    """The writer's loss mask files of one split (None: it wrote none), mapped read-only and checked."""
    if not files or files[0]["loss"] is None:
        return None
    return _tokens_of([dict(f, file=f["loss"], dtype="|u1", offset=0, size=f["tokens"]) for f in files], final)


def _tokens_of(files: list[dict], final: Path):
    """The token files of one split, mapped read-only, each checked against what the entry recorded."""
    reading = f"the {len(files)} mappings of its token files"  # each mapping and its positioned reader: 2 files
    room_for_files(2 * len(files), final, reading=reading, fix="write the corpus in fewer, larger files")
    arrays = []
    for f in files:
        p = Path(f["file"])
        try:
            size = p.stat().st_size
        except OSError:
            raise DataError(f"{p}: missing (the corpus changed since {final} was made)") from None
        if size != f["size"]:
            raise DataError(f"{p}: {size} bytes, {f['size']} when {final} was made: the corpus changed")
        arrays.append(map_part(f))
    return read_as_one(arrays)


def _open(final: Path, tok, t0: float, hit: bool) -> tuple[ForeignStore, ForeignStore | None, object, PrepareSummary, Path]:
    corpus = json.loads((final / "corpus.json").read_text(encoding="utf-8"))
    train = ForeignStore(final / "train", _tokens_of(corpus["train"], final), _masks_of(corpus["train"], final))
    same = corpus["eval"] == corpus["train"]
    ev = None
    if (final / "eval").is_dir():
        tokens, masks = (train.tokens, train.loss_mask.base) if same else (_tokens_of(corpus["eval"], final), None)
        ev = ForeignStore(final / "eval", tokens, masks if same else _masks_of(corpus["eval"], final))
    s = PrepareSummary.from_dict(json.loads((final / "summary.json").read_text(encoding="utf-8")))
    s.cache_hit, s.cache_path, s.seconds = hit, str(final), time.perf_counter() - t0
    return train, ev, tok, s, final


def prepare_foreign(
    cfg: DataConfig, tok, meta_of: Callable[[str], dict], t0: float
) -> tuple[ForeignStore, ForeignStore | None, object, PrepareSummary, Path]:
    """The train and eval stores of the foreign corpus ``cfg`` names, from the cache or built now (module docstring),
    with ``tok``, the summary and the entry: ``Prepared``'s fields in order."""
    fmt = foreign_format(cfg)
    assert fmt is not None
    if tok.fingerprint().startswith("pending-"):
        raise DataError(
            f"data.format {fmt}: the corpus holds token ids; data.tokenizer must be the tokenizer that wrote them, not {tok.name}"
        )
    inputs = _paths(cfg.path, fmt)
    evals = _paths(cfg.eval_path, fmt) if cfg.eval_path is not None else []
    final = Path(cfg.cache_dir) / f"{fmt}-{_key(cfg, fmt=fmt, tok=tok, inputs=inputs, evals=evals)}"
    if marker_ok(final):
        return _open(final, tok, t0, True)
    with entry_lock(final):
        if not marker_ok(final):
            with staged_store(final) as tmp:
                _build(tmp, cfg=cfg, fmt=fmt, tok=tok, meta_of=meta_of, inputs=inputs, evals=evals)
            return _open(final, tok, t0, False)
    return _open(final, tok, t0, True)

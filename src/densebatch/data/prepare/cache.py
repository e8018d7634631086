"""The prepared-documents cache: an entry's key (the inputs' identity + every setting that changes tokens) and
reading an entry back, checked, so that a damaged or stale entry is a one-line error, not a traceback.

An entry ``cache_dir/<key>/`` holds ``train/`` and ``eval/`` document stores, ``summary.json``,
``eval_records.jsonl``, a learned ``bpe:N`` tokenizer in ``tokenizer/`` and the completion marker
(written by ``prepare``). A mixture has one entry per source and ``cache_dir/mix-<key>/`` with all of
them end to end (its key hashes the sources' keys, in order). A mixture holding a corpus another engine
wrote (``foreign_mixture``) keeps in ``cache_dir/mix-<key>/`` only its summary and held-out records (its
key hashes the names of its sources' entries, in order): its stores are those entries', joined in memory.

An entry is built under its lock, ``cache_dir/.<key>.lock`` (``entry_lock``; a ``densebatch.locks.FileLock``):
a second process preparing the same data at the same time waits for the first, saying so, then reads
the entry the first published; if the first died, the operating system has dropped its lock, and the
second removes what it left and builds the entry itself. Reading a complete entry takes no lock
(entries appear by an atomic rename), so a cache that cannot be written still serves its entries.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

from densebatch.atomic import io_reason, remove_leftovers
from densebatch.config import DataConfig
from densebatch.data.prepare import default_dataset
from densebatch.data.prepare.dedupe import dedupe_mode, key_material
from densebatch.data.prepare.sources import detect_format
from densebatch.data.prepare.summary import PrepareSummary
from densebatch.data.prepare.tokenizers import PendingBPE, Tokenizer, load_tokenizer
from densebatch.data.store.store import DocumentStore, marker_ok
from densebatch.errors import DataError, UserError
from densebatch.locks import FileLock, describe

CACHE_VERSION = 7  # 2: stores carry source.npy; tokenizers may add tokens; 3: inputs known by identity; 4: sharded stores;
# 5: text_split chunks read in blocks (text_blocks.py); 6: split_keys.npz (the leakage count across a mixture's parts);
# 7: Parquet and save_to_disk chunks are row ranges whose workers count the rows read (row_ranges.py): a chunk
# file of 6 counted none, so a run left half done by 6 resumes into a fresh directory

LEARNED_TOKENIZER = "tokenizer"  # where a bpe:N tokenizer is kept inside the cache entry


def _files(path: Path) -> list[Path]:
    return sorted(q for q in path.rglob("*") if q.is_file()) if path.is_dir() else [path]


def _file_digest(path: Path) -> str:
    """SHA-256 of every byte of ``path`` (every file of a directory, with its name): ``verify_inputs: hash``."""
    h = hashlib.sha256()
    for f in _files(path):
        h.update(str(f.relative_to(path) if path.is_dir() else f.name).encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _file_identity(path: Path) -> list:
    """The absolute path, then each file's name, size and modification time (ns): what a cache hit checks
    without reading any input (``verify_inputs: identity``); editing, replacing, growing or moving a
    file changes it."""
    root = path.resolve()
    out: list = [str(root)]
    for f in _files(root):
        st = f.stat()
        out.append([str(f.relative_to(root)) if root.is_dir() else f.name, st.st_size, st.st_mtime_ns])
    return out


def input_key(path: str | None, how: str):
    """What stands for the input ``path`` in a cache key (None: no such input)."""
    if path is None:
        return None
    return _file_digest(Path(path)) if how == "hash" else {"identity": _file_identity(Path(path))}


def cache_key(cfg: DataConfig, tok: Tokenizer, after: list[str] | tuple[str, ...] = ()) -> str:
    """Hash of the inputs (their identity, or with ``verify_inputs: hash`` their bytes) and every setting
    that changes the prepared tokens; ``after``: the keys of a mixture's earlier sources, whose records this
    source's are deduped against (``dedupe.py``; named only when dedupe is on)."""
    settings = dataclasses.asdict(cfg)
    dedupe = key_material(cfg.clean)
    # off and exact as false / true, as before; near's threshold only where it is read: off's entries stay valid
    settings["clean"]["dedupe"] = {"off": False, "exact": True}.get(dedupe_mode(cfg.clean), "near")
    if dedupe is None or dedupe_mode(cfg.clean) != "near":
        settings["clean"].pop("near_threshold")
    # a source's key: the tokenizer's fingerprint covers the added tokens, and other sources are theirs
    for k in (
        "path",
        "eval_path",
        "cache_dir",
        "sources",
        "add_tokens",
        "add_special_tokens",
        "verify_inputs",
        "num_proc",
        "chunk_records",
        "shard_tokens",
    ):
        settings.pop(k)
    if cfg.pairs is True:  # pairs: one more setting and three more fields; documents keep the keys they had
        settings["pairs"] = True
    else:
        settings.pop("pairs")
        for k in ("prompt", "chosen", "rejected"):
            settings["fields"].pop(k)
    if cfg.path is not None:
        settings.pop("default")
        settings["format"] = detect_format(cfg.path, cfg.format)
    material = {
        "version": CACHE_VERSION,
        "settings": settings,
        "tokenizer": tok.fingerprint(),
        "pad_id": tok.pad_id,
        "input": default_dataset.VERSION if cfg.path is None else input_key(cfg.path, cfg.verify_inputs),
        "eval_input": input_key(cfg.eval_path, cfg.verify_inputs),
    }
    if dedupe is not None:
        material["dedupe"] = dedupe
        if after:
            material["after"] = list(after)
    if cfg.clean.terms:  # the dictionary's contents change the text, not only its path
        material["terms"] = _file_digest(Path(cfg.clean.terms)) if Path(cfg.clean.terms).is_file() else None
    if cfg.template == "chat_template":  # the texts are the tokenizer's template's
        material["chat_template"] = [tok.chat_template, tok.template_variables]
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:24]


def source_keys(cfgs: list[DataConfig], tok: Tokenizer) -> list[str]:
    """The cache keys of a mixture's sources, in order: with dedupe on, each names those before it."""
    keys: list[str] = []
    for c in cfgs:
        keys.append(cache_key(c, tok, after=keys))
    return keys


def check_meta(store: DocumentStore, tok: Tokenizer) -> None:
    """What collate and the model read from a store's meta is there and agrees with the tokenizer."""
    m = store.meta
    for key in ("eos_id", "vocab_size"):
        if not isinstance(m.get(key), int):
            raise ValueError(f"meta.json of {store.path.name} has no integer {key}")
    if m.get("num_documents") != len(store) or m.get("vocab_size") != tok.vocab_size:
        raise ValueError(f"meta.json of {store.path.name} does not match its documents or the tokenizer")


def load_entry(final: Path, tok: Tokenizer) -> tuple[DocumentStore, DocumentStore | None, Tokenizer, PrepareSummary] | None:
    """(train, eval, tokenizer, summary) of the complete entry ``final``; None when
    there is none. An entry that is complete but does not read back raises a one-line ``DataError``."""
    if not marker_ok(final):
        return None
    if broken := [s for s in ("train", "eval") if (final / s).exists() and DocumentStore.damaged(final / s)]:
        raise DataError(
            f"{final}: the cached documents cannot be used (its {broken[0]} documents were damaged after they were "
            "written: a file is missing or its size is not the one recorded); delete that directory and run again "
            "(it is rebuilt from the data)"
        )
    if not DocumentStore.is_complete(final / "train"):  # a mixture whose source's entry is gone: made again
        return None
    try:
        if isinstance(tok, PendingBPE):  # a learned tokenizer lives with the documents it made
            tok = load_tokenizer(final / LEARNED_TOKENIZER, tok.requested_pad_id)
        summary = PrepareSummary.from_dict(json.loads((final / "summary.json").read_text(encoding="utf-8")))
        has_eval = DocumentStore.is_complete(final / "eval")
        train = DocumentStore.open(final / "train")
        evals = DocumentStore.open(final / "eval") if has_eval else None
        for store in (train, evals) if evals is not None else (train,):
            check_meta(store, tok)
    except (ValueError, KeyError, TypeError, AttributeError, OSError, UserError) as e:
        # A complete entry that does not read back was damaged or written by another version:
        # rebuilding under the same key is the user's call (it is their cache), so say how.
        why = (str(e).splitlines() or [type(e).__name__])[0]
        raise DataError(
            f"{final}: the cached documents cannot be used ({why}); delete that directory and run again "
            "(it is rebuilt from the data)"
        ) from None
    return train, evals, tok, summary


def read_eval_records(final: Path) -> list[dict]:
    """The held-out records of entry ``final`` (for exact-match accuracy): read only when asked for, by
    the process that scores them. A file that does not read back is a one-line ``DataError``."""
    try:
        lines = (final / "eval_records.jsonl").read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines if line]
    except (OSError, ValueError) as e:
        raise DataError(
            f"{final}: the cached held-out records cannot be read ({(str(e).splitlines() or [type(e).__name__])[0]}); "
            "delete that directory and run again (it is rebuilt from the data)"
        ) from None


@contextlib.contextmanager
def entry_lock(final: Path) -> Iterator[None]:
    """Hold the cache entry ``final``'s lock while it is built (see the module docstring): wait, with one
    line naming the holder, while another process builds it; remove what a writer that is gone left.
    ``UserError`` naming the directory and the operation when ``data.cache_dir`` cannot be written.
    The lock file goes when the lock is released (``FileLock.release(remove=True)``): the cache holds
    entries only, and a build that failed leaves no file behind."""
    lock = FileLock(final.with_name(f".{final.name}.lock"))
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"data.cache_dir {final.parent}: cannot be created (mkdir: {io_reason(e)})") from e
    try:
        holder = lock.acquire()
    except OSError as e:
        raise UserError(f"data.cache_dir {final.parent}: cannot be written (creating {lock.path.name}: {io_reason(e)})") from e
    try:
        if holder is not None:
            print(f"waiting for {final} being written by {describe(holder)}", file=sys.stderr, flush=True)
            lock.acquire(wait=True)
        remove_leftovers(final.parent, re.escape(final.name), locked=True)  # a writer that died mid-build (its lock is ours now)
        yield
    finally:
        lock.release(remove=True)

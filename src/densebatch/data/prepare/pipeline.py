"""prepare: records → tokenised documents on disk (train + eval DocumentStores), cached by inputs and settings.

``prepare(cfg: DataConfig) -> Prepared``. For each source (``data.path``, or each of
``data.sources``), in order, for each record in file order (``documents.Builder``):
read (``sources``) → render with the template, cleaning each field value (``templates``, ``clean``)
→ length filters → tokenize each segment on its own and concatenate, so the loss mask is exact by
position → append the end-of-text; then, once every record is rendered, drop duplicates (``dedupe.py``:
exact or near, the first copy kept) → split train / eval → truncate or drop documents over
``max_seq_len`` → write both stores.

A mixture (``data.sources``), and a source given as a glob pattern of files, is prepared part by part
(a part: one source, or one file of a pattern; ``parts.py``), each in its own cache entry (so adding a
source tokenises only that one; all share one tokenizer, whose added tokens are in every key), then
laid end to end in one entry: its stores' indexes point at each source's shards (with its source) and
``meta["sources"]`` names them, its eval split
holds each source's own held-out documents, and its summary one line of facts per source. Names
and weights are not part of any key: renaming or re-weighting prepares nothing again. With dedupe on,
a source's records that repeat an earlier source's kept records are dropped too (counted per source as
``dedupe_cross_source``), so a source's key names the keys of the sources before it (``cache.source_keys``).
A mixture that holds a corpus another engine wrote is read as its sources' own entries joined in memory
(``foreign_mixture.py``: ``_own_sources`` gives it ours, prepared as here).

Eval split, when ``data.eval_path`` is unset: a record goes to eval when the hash of its raw
content (canonical JSON, BLAKE2b) ranks among the ``round(eval_fraction * n)`` smallest of its file's
(at least one when eval_fraction > 0; a glob pattern's files are each split on their own, ``parts.py``). It is therefore deterministic, independent of file order and of every
seed, and stable when records are appended. Duplicates are dropped before the split when
``clean.dedupe`` is on, so no prompt can land on both sides; with ``eval_path``, train records that
repeat an eval record are dropped too. The summary counts the held-out documents whose rendered text is
a training document's (``eval_repeats_train``): 0 with dedupe on (checked), a warning with it off.

Cache (``data/prepare/cache.py``): ``cache_dir/<key>/`` where key hashes the inputs' identity (path, size and
modification time of every file; with ``data.verify_inputs: hash`` their bytes) and every setting that changes tokens (format, fields, template, loss, cleaning,
tokenizer content, pad id, max_seq_len, overlong, eval split, on_bad_record, the default dataset's
settings). Built in a temporary directory, fsynced, renamed into place, marker last: a crash never
leaves a directory that a later run trusts; built under the entry's lock, so two processes preparing
the same data at once build it once (the second waits, then reads it). Measured on 2 busy shared
cores (build / cache hit): the book's 1,100 Alpaca records with the GPT-2 BPE 1.1 s / 0.4 s (loading the BPE dominates a hit);
400 OASST chat threads 0.8 s / 0.3 s; tinyshakespeare in 512-token chunks 2.2 s / 0.1 s; the
embedded default (6,000 records, byte-level) 0.6 s / under 0.01 s.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from densebatch.atomic import io_reason
from densebatch.config import DataConfig
from densebatch.data.prepare.assemble import assemble
from densebatch.data.prepare.cache import (
    CACHE_VERSION,
    LEARNED_TOKENIZER,
    cache_key,
    entry_lock,
    load_entry,
    read_eval_records,
    source_keys,
)
from densebatch.data.prepare.dedupe import Keys, dedupe_mode, leakage_across, read_prior
from densebatch.data.prepare.documents import Builder
from densebatch.data.prepare.foreign import foreign_format, prepare_foreign
from densebatch.data.prepare.foreign_mixture import mixes_foreign, prepare_mixed
from densebatch.data.prepare.learned_bpe import learn_bpe
from densebatch.data.prepare.parts import Part, source_parts
from densebatch.data.prepare.source_configs import mixture_weights, source_configs
from densebatch.data.prepare.sources import detect_format
from densebatch.data.prepare.stream import (
    WorkerDied,
    prepare_chunks,
    remove_stage,
    stage_dir,
    workers,
)
from densebatch.data.prepare.stream_cut import cut_chunks
from densebatch.data.prepare.summary import PrepareSummary
from densebatch.data.prepare.tokenizers import PendingBPE, Tokenizer, load_data_tokenizer
from densebatch.data.store.joined import write_mixture_index
from densebatch.data.store.store import DocumentStore, staged_store, write_marker
from densebatch.errors import DataError, UserError


@dataclass
class Prepared:
    train: DocumentStore
    eval: DocumentStore | None
    tokenizer: Tokenizer
    summary: PrepareSummary
    cache_dir: Path
    weights: tuple[float, ...] | None = None  # data.sources' weights, in store order; None = natural shares
    source_names: list[str] = field(default_factory=list)

    @functools.cached_property
    def eval_records(self) -> list[dict]:
        """The held-out records that became eval documents (for exact-match accuracy), read on first use."""
        return read_eval_records(self.cache_dir)


# --------------------------------------------------------------------------------- one source
def _meta(tok: Tokenizer, cfg: DataConfig, split: str) -> dict:
    return {
        "split": split,
        "eos_id": tok.eos_id,
        "pad_id": tok.pad_id,
        "mask_id": tok.mask_id,
        "vocab_size": tok.vocab_size,
        "base_vocab_size": tok.base_vocab_size,
        "added_tokens": tok.added,
        "special_ids": tok.special_ids,
        "tokenizer": tok.describe(),
        "template": cfg.template,
        "loss_on": cfg.loss_on,
        **({"pairs": True} if cfg.pairs is True else {}),  # each document a preference pair (data/store/pair_layout.py)
    }


def _eval_source(cfg: DataConfig) -> str:
    if cfg.eval_path is not None:
        return f"eval_path {cfg.eval_path}"
    if cfg.eval_fraction <= 0:
        return "none (eval_fraction 0)"
    return f"{cfg.eval_fraction:g} of records held out by content hash"


def _load_cached(final: Path, tok: Tokenizer, t0: float) -> Prepared | None:
    entry = load_entry(final, tok)
    if entry is None:
        return None
    train, evals, tok, summary = entry
    summary.cache_hit = True
    summary.seconds = time.perf_counter() - t0
    summary.cache_path = str(final)
    return Prepared(train, evals, tok, summary, final)


def _cached_or_built(final: Path, tok: Tokenizer, t0: float, build: Callable[[], Tokenizer]) -> Prepared:
    """The entry ``final``: from the cache, or written by ``build()`` (which returns the tokenizer its
    documents were made with) under the entry's lock; a process already building it is waited for and
    its entry used (``cache.entry_lock``)."""
    if (cached := _load_cached(final, tok, t0)) is not None:
        return cached
    with entry_lock(final):
        if (cached := _load_cached(final, tok, t0)) is not None:  # built by the process we waited for
            return cached
        tok = build()
    prepared = _load_cached(final, tok, t0)
    assert prepared is not None, "a freshly written cache must be complete"
    prepared.summary.cache_hit = False
    return prepared


@contextlib.contextmanager
def _staged_entry(final: Path, tok: Tokenizer, cfg: DataConfig) -> Iterator[Path]:
    """The staged directory of entry ``final`` (a learned ``bpe:N`` tokenizer saved in it first), published
    when the caller's writes are done; a write that fails (no space left) is one line, nothing half-written stays."""
    try:
        with staged_store(final) as tmp:
            if cfg.tokenizer.startswith("bpe:"):
                tok.save(tmp / LEARNED_TOKENIZER)
            yield tmp
    except OSError as e:
        raise _cannot_write(final, e) from e


def _write_entry_files(tmp: Path, records: list, summary: PrepareSummary) -> None:
    """The held-out records, the summary and the entry's marker (last), beside its stores."""
    lines = [json.dumps(r, ensure_ascii=False, default=str) for r in records]
    (tmp / "eval_records.jsonl").write_text("".join(x + "\n" for x in lines), encoding="utf-8")
    (tmp / "summary.json").write_text(json.dumps(summary.as_dict(), indent=1), encoding="utf-8")
    write_marker(tmp, {"sizes": {n: (tmp / n).stat().st_size for n in ("summary.json", "eval_records.jsonl")}})


def _cannot_write(final: Path, e: OSError) -> DataError:
    return DataError(f"data.cache_dir {final.parent}: cannot be written (the documents of {final.name}: {io_reason(e)})")


def _prepare_one(name: str, *, cfg: DataConfig, fmt: str, tok: Tokenizer, t0: float, keys: list[str] | None = None) -> Prepared:
    """One source's entry (built, or found in the cache). ``keys``: a mixture's source keys up to this
    one's (``cache.source_keys``), whose entries before it hold the records it is deduped against."""
    keys = keys or [cache_key(cfg, tok)]
    final = Path(cfg.cache_dir) / keys[-1]
    prior = [Path(cfg.cache_dir) / k for k in keys[:-1]]
    return _cached_or_built(final, tok, t0, lambda: _build_one(final, name=name, cfg=cfg, fmt=fmt, tok=tok, prior=prior))


def _summary(cfg: DataConfig, fmt: str, tok: Tokenizer) -> PrepareSummary:
    """The summary one source's build fills in."""
    return PrepareSummary(
        source=cfg.path or "embedded default dataset",
        format=fmt,
        template=cfg.template,
        tokenizer=tok.name,
        eval_source=_eval_source(cfg),
    )


def _prior_keys(cfg: DataConfig, prior: list[Path]) -> Keys | None:
    """The kept records' keys of a mixture's sources before this one (None with dedupe off)."""
    mode = dedupe_mode(cfg.clean)
    if mode == "off":
        return None
    return read_prior(prior, mode == "near")


def _build_one(final: Path, *, name: str, cfg: DataConfig, fmt: str, tok: Tokenizer, prior: list[Path]) -> Tokenizer:
    """The entry ``final`` of one source, chunk by chunk on ``data.num_proc`` processes (``stream.py``), with
    memory bounded by the chunk; returns the tokenizer its documents were made with. The tests build the same
    entry in memory (``tests/data/prepare/in_memory_prepare.py``) and compare the two byte for byte."""
    s = _summary(cfg, fmt, tok)
    before = _prior_keys(cfg, prior)
    if isinstance(tok, PendingBPE):  # learned from a first pass over the records (bad ones reported by the second)
        first_pass = Builder(cfg, tok, PrepareSummary(), collect_bad=True).stream(cfg.path, fmt)
        tok = learn_bpe([(first_pass, cfg)], tok)
        s.tokenizer = tok.name
    b = Builder(cfg, tok, s)
    stage = stage_dir(final, cfg)  # kept if this run dies or is stopped: the next one goes on from it
    blocks = cfg.text_split == "chunks"
    try:
        chunks = prepare_chunks(b, path=cfg.path, fmt=fmt, stage=stage, num_proc=workers(cfg))
        held = []  # eval_path's chunks: the eval split, deduped first
        if cfg.eval_path is not None:
            eval_fmt = detect_format(cfg.eval_path, cfg.format)
            held = prepare_chunks(b, path=cfg.eval_path, fmt=eval_fmt, stage=stage / "eval", num_proc=workers(cfg))
            if blocks and eval_fmt == "text":
                held = cut_chunks(b, held, stage / "eval")
        if blocks and fmt == "text":  # blocks of running text → documents (stream_cut.py)
            chunks = cut_chunks(b, chunks, stage)
        meta = dict(_meta(tok, cfg, "train"), sources=[name])
        with _staged_entry(final, tok, cfg) as tmp:
            records = assemble(
                b,
                chunks=held + chunks,
                stage=stage,
                eval_fraction=cfg.eval_fraction,
                train_dir=tmp / "train",
                eval_dir=tmp / "eval",
                meta=meta,
                prior=before,
                held_chunks=len(held),
            )
            s.sources = [s.source_facts(name, s.source)]
            _write_entry_files(tmp, records, s)
    except OSError as e:  # reading the chunks (writes are _staged_entry's)
        raise _cannot_write(final, e) from e
    except WorkerDied:
        raise
    except UserError:  # bad input or settings: the same run fails the same way, so nothing of it is kept
        remove_stage(stage)
        raise
    remove_stage(stage)
    return tok


# --------------------------------------------------------------------------------- a mixture
def _prepare_mixture(cfg: DataConfig, parts: list[Part], tok: Tokenizer, t0: float) -> Prepared:
    keys = source_keys([p.cfg for p in parts], tok)
    ids = [p.source for p in parts]
    material = {"version": CACHE_VERSION, "mixture": keys} | ({"sources": ids} if ids != list(range(len(ids))) else {})
    final = Path(cfg.cache_dir) / f"mix-{hashlib.sha256(json.dumps(material).encode()).hexdigest()[:24]}"
    # Under the mixture's lock, each part's entry takes its own: always in that order, so no two processes
    # can each hold a lock the other waits for.
    return _cached_or_built(final, tok, t0, lambda: _build_mixture(final, cfg=cfg, parts=parts, tok=tok, t0=t0))


def _build_mixture(final: Path, *, cfg: DataConfig, parts: list[Part], tok: Tokenizer, t0: float) -> Tokenizer:
    if isinstance(tok, PendingBPE):  # one vocabulary learned from every part's text (read as it comes), then each part with it
        tok = learn_bpe(
            ((Builder(p.cfg, tok, PrepareSummary(), collect_bad=True).stream(p.cfg.path, p.fmt), p.cfg) for p in parts), tok
        )
    built = _prepare_parts(parts, tok, t0)
    sources = _per_source(cfg, parts, built, tok)
    if len(sources) == 1:  # one source of several files
        summary = sources[0][1].of_files()
    else:
        summary = PrepareSummary.combine(
            sources,
            np.concatenate([np.asarray(b.train.lengths) for b in built]),
            source=", ".join(name for name, _ in sources),
            format="mixture",
            template=", ".join(sorted({p.cfg.template for p in parts})),
            tokenizer=tok.name,
            eval_source=_eval_source(cfg) + " per source",
        )
    summary.parts = [sum(not b.summary.cache_hit for b in built), len(built)]
    if dedupe_mode(cfg.clean) == "off":  # on, every part is deduped against those before it: 0 across them too
        summary.eval_repeats_train = leakage_across([b.cache_dir for b in built])  # across the parts, not within each
    records = [r for b in built for r in b.eval_records]
    if final.exists():  # whole by its own marker, but a part's entry it names is gone: made again
        shutil.rmtree(final)
    with _staged_entry(final, tok, cfg) as tmp:
        for split in ("train", "eval"):  # no copy: each split names its parts' stores (joined.py)
            stores = [(getattr(b, split), p.source) for p, b in zip(parts, built) if getattr(b, split) is not None]
            if stores:
                meta = dict(_meta(tok, cfg, split), sources=summary.source_names)
                names = write_mixture_index(tmp / split, [(st.path, s) for st, s in stores], meta)
                write_marker(tmp / split, {"sizes": {n: (tmp / split / n).stat().st_size for n in names}})
        _write_entry_files(tmp, records, summary)
    return tok


def _prepare_parts(parts: list[Part], tok: Tokenizer, t0: float) -> list[Prepared]:
    """Each part's entry, in order (with dedupe on, each part's key names those before it: ``cache.source_keys``)."""
    keys = source_keys([p.cfg for p in parts], tok)
    return [_prepare_one(p.name, cfg=p.cfg, fmt=p.fmt, tok=tok, t0=t0, keys=keys[: i + 1]) for i, p in enumerate(parts)]


def _own_sources(cfg: DataConfig, tok: Tokenizer, t0: float) -> list[tuple[list[Prepared], PrepareSummary]]:
    """Each source of ``cfg`` (all tokenised by densebatch) as a mixture of them prepares it: its parts' entries
    and its summary, in order (what ``foreign_mixture`` joins with the foreign sources)."""
    parts = source_parts(cfg)
    built = _prepare_parts(parts, tok, t0)
    per = _per_source(cfg, parts, built, tok)
    return [([b for p, b in zip(parts, built) if p.source == sid], s) for sid, (_, s) in enumerate(per)]


def _per_source(cfg: DataConfig, parts: list[Part], built: list[Prepared], tok: Tokenizer) -> list[tuple[str, PrepareSummary]]:
    """(name, summary) of each source: its part's, or its files' summed (``parts.py``)."""
    out = []
    for sid, (name, c) in enumerate(source_configs(cfg)):
        mine = [(p, b) for p, b in zip(parts, built) if p.source == sid]
        if len(mine) == 1:
            out.append((name, mine[0][1].summary))
            continue
        s = PrepareSummary.combine(
            [("", b.summary) for _, b in mine],
            np.concatenate([np.asarray(b.train.lengths) for _, b in mine]),
            source=c.path,
            format=", ".join(sorted({p.fmt for p, _ in mine})),
            template=mine[0][0].cfg.template,
            tokenizer=tok.name,
            eval_source=_eval_source(c) + ("" if c.eval_path else f" in each of its {len(mine)} files"),
        )
        s.sources = [s.source_facts(name, c.path)]
        out.append((name, s))
    return out


# -------------------------------------------------------------------------------- entry point
def prepare(cfg: DataConfig) -> Prepared:
    """Prepare (or reuse from the cache) the train and eval documents that ``cfg`` describes. The summary's
    per-source ``share`` (of an epoch's tokens, a plan's) is filled in by the caller that prints it (``run/``)."""
    t0 = time.perf_counter()
    tok = load_data_tokenizer(cfg)
    if cfg.pairs is True and (foreign_format(cfg) is not None or mixes_foreign(cfg)):
        raise DataError(
            f"data.pairs: a corpus of token ids another engine wrote ({foreign_format(cfg) or 'in data.sources'}) holds "
            "documents, not preference pairs: give the pairs as records (prompt, chosen, rejected)"
        )
    if foreign_format(cfg) is not None:  # a corpus another engine tokenised: read in place (data/store/formats)
        prepared = Prepared(*prepare_foreign(cfg, tok, lambda split: _meta(tok, cfg, split), t0))
    elif mixes_foreign(cfg):  # a mixture holding such a corpus: each source its own entry, read as one store
        meta_of = lambda split: _meta(tok, cfg, split)  # noqa: E731
        prepared = Prepared(*prepare_mixed(cfg, tok, t0, meta_of=meta_of, own=lambda c: _own_sources(c, tok, t0)))
    else:
        parts = source_parts(cfg)
        if len(parts) == 1:
            prepared = _prepare_one(parts[0].name, cfg=parts[0].cfg, fmt=parts[0].fmt, tok=tok, t0=t0)
        else:
            prepared = _prepare_mixture(cfg, parts, tok, t0)
    names = [name for name, _ in source_configs(cfg)]
    for store in (prepared.train, prepared.eval):  # names are configuration, not content: never in a key
        if store is not None:
            store.meta["sources"] = names
    prepared.weights = mixture_weights(cfg)
    prepared.source_names = names
    prepared.summary.name_sources(names)
    return prepared

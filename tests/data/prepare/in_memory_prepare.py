"""The tests' oracle for prepare: one source's cache entry built in memory, record list by record list.

The library streams every source chunk by chunk (``data/prepare/stream.py``); this is the straightforward
build it must equal byte for byte: read every record, tokenise, dedupe, split and write the stores at once.
A test swaps it in for ``pipeline._build_one`` (``in_memory(monkeypatch)``) and compares the stores.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from densebatch.config import DataConfig
from densebatch.data.prepare import pipeline
from densebatch.data.prepare.dedupe import Keys, dedupe, dedupe_mode, write_index, write_split_keys
from densebatch.data.prepare.documents import Builder, Doc, split_eval
from densebatch.data.prepare.learned_bpe import learn_bpe
from densebatch.data.prepare.sources import detect_format
from densebatch.data.prepare.stream import keeps_records
from densebatch.data.prepare.summary import PrepareSummary
from densebatch.data.prepare.tokenizers import PendingBPE, Tokenizer
from densebatch.data.store.store_write import write_store_files
from densebatch.errors import DataError


def in_memory(monkeypatch) -> None:
    """Every source of the next ``prepare`` is built by ``build_one`` (the reference) instead of streamed."""
    monkeypatch.setattr(pipeline, "_build_one", build_one)


def _arrays(docs: list[Doc]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, offsets, loss mask) of ``docs`` end to end."""
    lengths = np.array([0] + [len(d.tokens) for d in docs], np.int64)
    tokens = np.concatenate([d.tokens for d in docs]) if docs else np.zeros(0, np.int32)
    mask = np.concatenate([d.mask for d in docs]) if docs else np.zeros(0, np.uint8)
    return tokens, np.cumsum(lengths), mask


def _one_source(docs: list[Doc]) -> tuple:
    """``_arrays`` and every document's source: 0, the one source."""
    return (*_arrays(docs), np.zeros(len(docs), np.int16))


def _write(final: Path, tok: Tokenizer, cfg: DataConfig, train, evals, records: list, summary: PrepareSummary, *, index, keys):
    """One entry: ``train`` / ``evals``, (tokens, offsets, loss_mask, source) tuples (evals None: no eval split);
    ``index``: (keys, kept) for ``write_index`` (dedupe on), else ``keys``: the splits' text keys."""
    with pipeline._staged_entry(final, tok, cfg) as tmp:
        if index is not None:  # dedupe on: the kept records' keys (the leakage count is 0 across parts)
            write_index(tmp, *index)
        else:
            write_split_keys(tmp, *keys)
        for split, arrays in (("train", train), ("eval", evals)):
            if arrays is not None:
                (tmp / split).mkdir()
                meta = dict(pipeline._meta(tok, cfg, split), sources=summary.source_names)
                tokens, offsets, mask, source = arrays
                write_store_files(
                    tmp / split,
                    tokens=tokens,
                    offsets=offsets,
                    loss_mask=mask,
                    meta=meta,
                    source=source,
                    shard_tokens=cfg.shard_tokens,
                )
        pipeline._write_entry_files(tmp, records, summary)


def build_one(final: Path, name: str, cfg: DataConfig, fmt: str, tok: Tokenizer, prior: list[Path]) -> Tokenizer:
    """``pipeline._build_one``'s entry, every record and document in memory at once."""
    s = pipeline._summary(cfg, fmt, tok)
    before = pipeline._prior_keys(cfg, prior)
    mode = dedupe_mode(cfg.clean)
    b = Builder(cfg, tok, s)
    items = b.read(cfg.path, fmt)
    if isinstance(tok, PendingBPE):
        tok = b.tok = learn_bpe([(items, cfg)], tok)
        s.tokenizer = tok.name
    eval_docs: list[Doc] = []
    if cfg.eval_path is not None:
        eval_fmt = detect_format(cfg.eval_path, cfg.format)
        eval_docs = b.documents(b.read(cfg.eval_path, eval_fmt))
        if cfg.text_split == "chunks" and eval_fmt == "text":
            eval_docs = b.chunk(eval_docs)
    train_docs = b.documents(items)
    if fmt == "text" and cfg.text_split == "chunks":  # blocks of running text → pieces, before dedupe (none for pieces)
        train_docs = b.chunk(train_docs)
    index = None
    if mode != "off":  # eval_path's records first: a training record that repeats one of them is dropped
        both, n_eval = eval_docs + train_docs, len(eval_docs)
        keys = Keys.of_docs(both, b.signer.bands if b.signer is not None else None)
        keep, drops = dedupe(keys, mode, cfg.clean.near_threshold, before)
        index = keys, keep
        for k, v in drops.items():
            b.cleaner.drop(k, v)
        eval_docs = [d for d, k in zip(both[:n_eval], keep) if k]
        train_docs = [d for d, k in zip(both[n_eval:], keep[n_eval:]) if k]
    if cfg.eval_path is None:
        train_docs, eval_docs = split_eval(train_docs, cfg.eval_fraction)
    train_docs, eval_docs = b.finish(train_docs), b.finish(eval_docs)
    trained = {d.text_key for d in train_docs if d.text_key is not None}
    s.eval_repeats_train = sum(d.text_key in trained for d in eval_docs)
    assert mode == "off" or not s.eval_repeats_train, "dedupe keeps one copy of each rendered text"
    s.cleaning_changed, s.cleaning_dropped = dict(b.cleaner.changed), dict(sorted(b.cleaner.dropped.items()))
    if not train_docs:
        raise DataError(f"{s.source}: no usable training documents remain ({s.accounting()})")
    s.fill_counts(train_docs, eval_docs)
    s.sources = [s.source_facts(name, s.source)]
    evals = _one_source(eval_docs) if eval_docs else None
    records = [d.record for d in eval_docs if d.record is not None] if keeps_records(cfg) else []
    texts = [np.array([d.text_key for d in docs if d.text_key is not None], "V16") for docs in (train_docs, eval_docs)]
    _write(final, tok, cfg, _one_source(train_docs), evals, records, s, index=index, keys=texts)
    return tok

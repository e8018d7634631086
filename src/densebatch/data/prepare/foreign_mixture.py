"""A mixture with sources in foreign formats (``data.sources``, some in ``foreign.FORMATS``): each source its own entry, read as one store.

A mixture of sources densebatch tokenises itself is one cache entry whose stores index each source's
shards (``pipeline``). A corpus another engine wrote has no shards of ours, so a mixture that holds one
is read through ``store/mixed.MixedStore`` instead: each source is prepared into its own entry exactly
as it would be alone — a foreign source by ``foreign.prepare_foreign`` (its files checked, every id
scanned against ``data.tokenizer``'s vocabulary, its eval split by index hash), and the sources
densebatch tokenises by the caller (``own``: the parts of those sources, in their order, deduped against
one another as a mixture of them alone is) — then the mixture's train and eval stores are those
entries' stores end to end, source after source, made in memory when the mixture is opened. So a
source is tokenised or scanned once, whatever mixture it joins, and renaming or re-weighting a source
opens the same entries (names and weights are in no key).

One small entry, ``cache_dir/mix-<key>/`` (key: the names of the sources' entries, in order), keeps
what joining them computes once: the summary (one line of facts per source) and the held-out records of
the sources densebatch tokenised. Every source is read with the one ``data.tokenizer``; a ``bpe:N``
tokenizer, learned from the text, cannot have written a foreign corpus and is refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from densebatch.config import DataConfig
from densebatch.data.prepare.cache import entry_lock
from densebatch.data.prepare.dedupe import dedupe_mode, leakage_across
from densebatch.data.prepare.foreign import FORMATS, prepare_foreign
from densebatch.data.prepare.source_configs import source_configs
from densebatch.data.prepare.summary import PrepareSummary, percentiles
from densebatch.data.store.mixed import MixedStore
from densebatch.data.store.store import marker_ok, staged_store, windows, write_marker
from densebatch.errors import DataError

ENTRY_VERSION = 1
_FILES = ("summary.json", "eval_records.jsonl")


def mixes_foreign(cfg: DataConfig) -> bool:
    """``data.sources`` holds a source in a foreign format (its own ``format``, or ``data.format``)."""
    return bool(cfg.sources) and any(c.format in FORMATS for _, c in source_configs(cfg))


def own_sources(cfg: DataConfig) -> DataConfig | None:
    """``cfg`` with only the sources densebatch tokenises itself: ``cfg`` itself when it has no foreign
    source, None when every source is foreign."""
    if not mixes_foreign(cfg):
        return cfg
    kept = [s for s, (_, c) in zip(cfg.sources, source_configs(cfg)) if c.format not in FORMATS]
    return dataclasses.replace(cfg, sources=kept) if kept else None


@dataclass
class _Source:
    """One source of the mixture as prepared: its parts' stores (train, eval), its summary and its entries."""

    name: str
    splits: list[tuple]  # (train store, eval store or None) of each part, in order
    summary: PrepareSummary
    entries: list[Path]
    hits: list[bool]
    own: list = field(default_factory=list)  # our own source's parts (``Prepared``): their held-out records


def prepare_mixed(
    cfg: DataConfig,
    tok,
    t0: float,
    *,
    meta_of: Callable[[str], dict],
    own: Callable[[DataConfig], list],
):
    """The mixture ``cfg`` (``mixes_foreign``) as ``Prepared``'s fields in order: train and eval ``MixedStore``s,
    ``tok``, the summary, the mixture's entry. ``own(cfg)``: for a config of our own sources only, each
    source's ``(its parts' Prepared entries, its summary)``, in order (``pipeline``)."""
    if tok.fingerprint().startswith("pending-"):
        fmt = next(c.format for _, c in source_configs(cfg) if c.format in FORMATS)
        raise DataError(
            f"data.sources: a source in format {fmt} holds token ids; data.tokenizer must be the tokenizer that wrote "
            f"them, not {tok.name}"
        )
    mine = own_sources(cfg)
    ours = iter(own(mine) if mine is not None else [])
    sources = []
    for name, c in source_configs(cfg):
        if c.format in FORMATS:
            train, ev, _, s, entry = prepare_foreign(c, tok, meta_of, t0)
            sources.append(_Source(name, [(train, ev)], s, [entry], [s.cache_hit]))
        else:
            built, s = next(ours)
            splits = [(b.train, b.eval) for b in built]
            sources.append(_Source(name, splits, s, [b.cache_dir for b in built], [b.summary.cache_hit for b in built], built))
    stores = {}
    for i, split in enumerate(("train", "eval")):
        parts = [(x[i], sid) for sid, src in enumerate(sources) for x in src.splits if x[i] is not None and len(x[i])]
        stores[split] = MixedStore(parts, dict(meta_of(split), sources=[s.name for s in sources])) if parts else None
    material = {"version": ENTRY_VERSION, "entries": [[e.name for e in src.entries] for src in sources]}
    final = Path(cfg.cache_dir) / f"mix-{hashlib.sha256(json.dumps(material).encode()).hexdigest()[:24]}"
    hit = marker_ok(final)
    if not hit:
        with entry_lock(final):
            if not marker_ok(final):
                _build(final, cfg=cfg, tok=tok, sources=sources, train=stores["train"])
    summary = PrepareSummary.from_dict(json.loads((final / "summary.json").read_text(encoding="utf-8")))
    hits = [h for src in sources for h in src.hits]
    summary.parts = [hits.count(False), len(hits)]
    summary.cache_hit = hit and all(hits)
    summary.cache_path, summary.seconds = str(final), time.perf_counter() - t0
    return stores["train"], stores["eval"], tok, summary, final


def _build(final: Path, *, cfg: DataConfig, tok, sources: list[_Source], train: MixedStore) -> None:
    """The mixture's entry: its summary (per-source facts) and its own sources' held-out records."""
    summary = PrepareSummary.combine(
        [(src.name, src.summary) for src in sources],
        np.zeros(0),
        source=", ".join(src.name for src in sources),
        format="mixture",
        template=", ".join(sorted({src.summary.template for src in sources})),
        tokenizer=tok.name,
        eval_source="per source: "
        + "; ".join(dict.fromkeys(src.summary.eval_source for src in sources)),  # no names: they change
    )
    summary.lengths = length_percentiles(train)
    ours = [src for src in sources if src.own]
    summary.eval_repeats_train = -1 if not ours else sum(src.summary.eval_repeats_train for src in ours)  # ids: unchecked
    if ours and dedupe_mode(cfg.clean) == "off":  # across our own sources' parts too (with dedupe on: 0 by construction)
        summary.eval_repeats_train = leakage_across([e for src in ours for e in src.entries])
    records = [r for src in ours for b in src.own for r in b.eval_records]
    with staged_store(final) as tmp:
        lines = [json.dumps(r, ensure_ascii=False, default=str) for r in records]
        (tmp / "eval_records.jsonl").write_text("".join(x + "\n" for x in lines), encoding="utf-8")
        (tmp / "summary.json").write_text(json.dumps(summary.as_dict(), indent=1), encoding="utf-8")
        write_marker(tmp, {"format": ENTRY_VERSION, "sizes": {n: (tmp / n).stat().st_size for n in _FILES}})


def length_percentiles(store) -> dict:
    """``summary.percentiles`` of ``store``'s lengths, from their histogram read window by window: nothing
    held per document, whatever the corpora."""
    counts = np.zeros(store.max_length + 1, np.int64)
    for _, w in windows(store.lengths, 1 << 22):
        counts += np.bincount(np.asarray(w, np.int64), minlength=len(counts))[: len(counts)]
    n = int(counts.sum())
    if n == 0:
        return percentiles(np.zeros(0))
    cum = np.cumsum(counts)

    def kth(k: int) -> int:  # the k-th smallest length (from 0)
        return int(np.searchsorted(cum, k, side="right"))

    out: dict = {}
    for name, q in (("p50", 50), ("p90", 90), ("p99", 99)):
        pos = q / 100 * (n - 1)  # numpy's linear rule
        lo = int(np.floor(pos))
        a, b = kth(lo), kth(min(lo + 1, n - 1))
        out[name] = float(a + (pos - lo) * (b - a))
    out["max"] = int(np.flatnonzero(counts)[-1])
    return out

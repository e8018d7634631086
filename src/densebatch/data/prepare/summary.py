"""PrepareSummary: what ``prepare`` read, kept, skipped and dropped, printable and as JSON.

Every record read is accounted for: ``records_read = kept + skipped + dropped by cleaning +
dropped overlong / without target / without loss tokens`` (for ``text_split: chunks``,
``records_read`` counts the file's blocks of about 64 KiB, ``text_blocks.py``, and documents are chunks). A mixture's summary sums its sources' and keeps one line of
facts per source in ``sources`` (name, records, documents, tokens, and the share of an epoch's tokens
its weight gives it, filled in by ``prepare`` for the run's weights).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from densebatch.data.store.pair_layout import loss_bit


def percentiles(lengths: np.ndarray) -> dict:
    if len(lengths) == 0:
        return {"p50": 0, "p90": 0, "p99": 0, "max": 0}
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "max": int(np.max(lengths))}


@dataclass
class PrepareSummary:
    source: str = ""
    format: str = ""
    template: str = ""
    tokenizer: str = ""
    eval_source: str = ""
    records_read: int = 0
    skipped: dict = field(default_factory=dict)  # reason -> records skipped as malformed
    skip_examples: dict = field(default_factory=dict)  # reason -> the first such record's "file:line: message"
    cleaning_changed: dict = field(default_factory=dict)  # step -> records it changed
    cleaning_dropped: dict = field(default_factory=dict)  # filter -> records it dropped
    truncated: int = 0
    dropped_overlong: int = 0  # overlong=drop
    dropped_no_target: int = 0  # overlong=truncate left no loss-carrying target
    dropped_no_loss: int = 0  # no token carries loss at all (e.g. pre-tokenised labels all -100)
    eval_repeats_train: int = 0  # held-out documents whose rendered text is a training document's (0 with dedupe on)
    train_documents: int = 0
    eval_documents: int = 0
    train_tokens: int = 0
    eval_tokens: int = 0
    train_loss_tokens: int = 0
    eval_loss_tokens: int = 0
    lengths: dict = field(default_factory=dict)  # train document lengths (tokens incl. end-of-text): p50/p90/p99/max
    seconds: float = 0.0
    cache_hit: bool = False
    cache_path: str = ""
    sources: list = field(default_factory=list)  # per source: name, path, records_read, documents, tokens, ..., share
    parts: list = field(default_factory=list)  # [prepared, of]: a build's parts (files, sources) made now / in all

    @property
    def records_kept(self) -> int:
        return self.train_documents + self.eval_documents

    @property
    def records_skipped(self) -> int:
        return sum(self.skipped.values())

    def accounting(self) -> str:
        """Where every record went, in one line; with skipped records, the first of the most frequent kind (why)."""
        text = (
            f"{self.records_read} read, {self.records_skipped} skipped as malformed, "
            f"{sum(self.cleaning_dropped.values())} dropped by cleaning, {self.dropped_overlong} dropped as overlong, "
            f"{self.dropped_no_target + self.dropped_no_loss} without loss tokens"
        )
        if self.skipped and (reason := max(self.skipped, key=self.skipped.get)) in self.skip_examples:
            text += f"; most skipped as {reason}, first {self.skip_examples[reason]}"
        return text

    def fill_counts(self, train_docs: list, eval_docs: list) -> None:
        self.train_documents, self.eval_documents = len(train_docs), len(eval_docs)
        self.train_tokens = int(sum(len(d.tokens) for d in train_docs))
        self.eval_tokens = int(sum(len(d.tokens) for d in eval_docs))
        self.train_loss_tokens = int(sum(int(loss_bit(d.mask).sum()) for d in train_docs))
        self.eval_loss_tokens = int(sum(int(loss_bit(d.mask).sum()) for d in eval_docs))
        self.lengths = percentiles(np.array([len(d.tokens) for d in train_docs]))

    @property
    def source_names(self) -> list[str]:
        return [x["name"] for x in self.sources]

    def name_sources(self, names: list[str]) -> None:
        """Give the per-source facts (and a mixture's source line) the configured ``names``: names are
        configuration, not content, so an entry made under other names is reused with these."""
        for x, name in zip(self.sources, names):
            x["name"] = name
        if self.format == "mixture":
            self.source = ", ".join(names)

    def source_facts(self, name: str, path: str) -> dict:
        """This (one source's) summary as one line of a mixture's per-source facts."""
        return {
            "name": name,
            "path": path,
            "records_read": self.records_read,
            "records_kept": self.records_kept,
            "records_skipped": self.records_skipped,
            "documents": self.train_documents,
            "eval_documents": self.eval_documents,
            "tokens": self.train_tokens,
            "eval_tokens": self.eval_tokens,
            "loss_tokens": self.train_loss_tokens,
            "duplicates_of_earlier_sources": self.cleaning_dropped.get("dedupe_cross_source", 0),
        }

    @classmethod
    def combine(cls, parts: list[tuple[str, PrepareSummary]], lengths: np.ndarray, **kw) -> PrepareSummary:
        """A mixture's summary: counts summed over its sources' summaries, ``lengths`` (train) percentiles."""
        out = cls(**kw)
        for name, p in parts:
            for key in (
                "records_read",
                "truncated",
                "dropped_overlong",
                "dropped_no_target",
                "dropped_no_loss",
                "eval_repeats_train",
            ):
                setattr(out, key, getattr(out, key) + getattr(p, key))
            for key in (
                "train_documents",
                "eval_documents",
                "train_tokens",
                "eval_tokens",
                "train_loss_tokens",
                "eval_loss_tokens",
            ):
                setattr(out, key, getattr(out, key) + getattr(p, key))
            for key in ("skipped", "cleaning_changed", "cleaning_dropped"):
                total = getattr(out, key)
                for k, v in getattr(p, key).items():
                    total[k] = total.get(k, 0) + v
            for k, v in p.skip_examples.items():
                out.skip_examples.setdefault(k, f"{name}: {v}" if name else v)  # a file of a source: v names it
            out.sources.append(p.source_facts(name, p.source))
        out.lengths = percentiles(lengths)
        return out

    def of_files(self) -> PrepareSummary:
        """This summary as that of one source of several files: its drops of an earlier file's copies are
        ``dedupe_cross_file`` (in a mixture they count as the source's ``dedupe_cross_source``)."""
        if "dedupe_cross_source" in self.cleaning_dropped:
            self.cleaning_dropped["dedupe_cross_file"] = self.cleaning_dropped.pop("dedupe_cross_source")
            self.cleaning_dropped = dict(sorted(self.cleaning_dropped.items()))
        return self

    def _parts(self) -> str:
        if self.cache_hit or len(self.parts) != 2:
            return ""
        made, of = self.parts
        return f"; {made} of {of} inputs (files, sources) prepared now, {of - made} from the cache"

    def _leakage(self) -> str:
        n = self.eval_repeats_train
        if n < 0:  # a corpus of token ids another engine wrote (data/store/formats): no records to compare
            return "not checked (token ids as written)"
        text = f"held-out records that duplicate training records: {n}"
        if n:  # dedupe off (on, there are none by construction)
            text += " (warning: their answers are seen in training; set data.clean.dedupe: exact or near to drop them)"
        if "token ids as written" in self.template:  # a mixture beside a corpus another engine wrote: ours only
            text += " among the sources densebatch tokenised (the corpora of token ids as written: not checked)"
        return text

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["records_kept"], d["records_skipped"] = self.records_kept, self.records_skipped
        return d

    @classmethod
    def from_dict(cls, d: dict) -> PrepareSummary:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def __str__(self) -> str:
        def counts(d: dict) -> str:
            return ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "none"

        L = self.lengths or percentiles(np.zeros(0))
        rows = [
            ("source", f"{self.source} ({self.format}, template {self.template}, tokenizer {self.tokenizer})"),
            (
                "records",
                f"{self.records_read} read, {self.records_kept} kept "
                f"({self.train_documents} train, {self.eval_documents} eval), {self.records_skipped} skipped",
            ),
            ("skipped", counts(self.skipped)),
            ("cleaning", f"changed: {counts(self.cleaning_changed)}; dropped: {counts(self.cleaning_dropped)}"),
            (
                "overlong",
                f"{self.truncated} truncated, {self.dropped_overlong} dropped, "
                f"{self.dropped_no_target} dropped (no target left); {self.dropped_no_loss} without loss tokens",
            ),
            (
                "tokens",
                f"train {self.train_tokens} ({self.train_loss_tokens} carry loss), "
                f"eval {self.eval_tokens} ({self.eval_loss_tokens} carry loss)",
            ),
            (
                "length",
                f"p50 {L['p50']:g}  p90 {L['p90']:g}  p99 {L['p99']:g}  max {L['max']} tokens (train, end-of-text included)",
            ),
            ("eval split", self.eval_source),
            ("leakage", self._leakage()),
            ("time", f"{self.seconds:.2f} s ({'cache hit' if self.cache_hit else 'built'}: {self.cache_path}){self._parts()}"),
        ]
        lines = [f"{k:<10} {v}" for k, v in rows]
        if len(self.sources) > 1:  # one source: the rows above already say it all
            head = f"{'sources':<10} {'name':<16} {'records':>9} {'documents':>10} {'tokens':>12} {'epoch share':>12}"
            lines.append(head + f" {'dup of earlier':>15}")
            for x in self.sources:
                share = f"{x['share']:.4f}" if "share" in x else "-"
                lines.append(
                    f"{'':<10} {x['name']:<16} {x['records_read']:>9} {x['documents']:>10} {x['tokens']:>12} {share:>12} "
                    f"{x.get('duplicates_of_earlier_sources', 0):>15}"
                )
        lines += [f"{'':<10} first {reason}: {ex}" for reason, ex in sorted(self.skip_examples.items())]
        return "\n".join(lines)

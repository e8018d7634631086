"""inspect: render prepared documents as text with the loss-carrying tokens marked.

``render_documents(store, tokenizer, indices, color)`` decodes each document in runs of tokens that
do / do not carry loss. Loss runs are shown in green (``color=True``, for a terminal) or wrapped in
``[[`` ... ``]]`` (plain text, for logs and pipes). Each document gets a header with its token count
and loss-token count, so a user sees exactly what the model is trained on.

``render_cleaning(cfg, num)``: when a cleaning step that rewrites text is on, the first ``num`` records
(of the first ``SCAN`` of each source) that cleaning changed: each changed field value before and after,
and the steps that changed it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from itertools import islice

import numpy as np

from densebatch.config import DataConfig
from densebatch.data.prepare.clean import Cleaner
from densebatch.data.prepare.dedupe import dedupe_mode, text_key
from densebatch.data.prepare.default_dataset import as_pair, generate_records
from densebatch.data.prepare.foreign import FORMATS
from densebatch.data.prepare.pairs import pair_segments
from densebatch.data.prepare.source_configs import source_configs
from densebatch.data.prepare.sources import BadRecord, detect_format, iter_records
from densebatch.data.prepare.templates import EmptiedByCleaning, RecordError, render
from densebatch.data.prepare.tokenizers import Tokenizer
from densebatch.data.store.pair_layout import loss_bit, pair_spans
from densebatch.data.store.store import DocumentStore
from densebatch.errors import DataError

LOSS_OPEN, LOSS_CLOSE = "[[", "]]"
_GREEN, _DIM, _RESET = "\x1b[32m", "\x1b[2m", "\x1b[0m"


def _runs(mask: np.ndarray) -> list[tuple[int, int, bool]]:
    """Maximal runs [start, stop) of equal mask values."""
    if len(mask) == 0:
        return []
    cuts = np.flatnonzero(np.diff(mask.astype(np.int8))) + 1
    bounds = np.concatenate([[0], cuts, [len(mask)]])
    return [(int(a), int(b), bool(mask[a])) for a, b in zip(bounds[:-1], bounds[1:])]


def render_document(tokens: np.ndarray, mask: np.ndarray, tokenizer: Tokenizer, color: bool) -> str:
    parts = []
    for a, b, loss in _runs(np.asarray(mask)):
        text = tokenizer.decode(np.asarray(tokens[a:b]).tolist())
        if loss:
            parts.append(f"{_GREEN}{text}{_RESET}" if color else f"{LOSS_OPEN}{text}{LOSS_CLOSE}")
        else:
            parts.append(f"{_DIM}{text}{_RESET}" if color else text)
    return "".join(parts)


def render_documents(store: DocumentStore, tokenizer: Tokenizer, indices: Iterable[int], color: bool = False) -> str:
    """Decoded documents ``indices`` of ``store``, loss-carrying tokens marked (see the module doc)."""
    legend = "loss-carrying tokens in green" if color else f"loss-carrying tokens between {LOSS_OPEN} and {LOSS_CLOSE}"
    pairs = bool(store.meta.get("pairs"))
    noun = "pair" if pairs else "document"
    out = [f"{len(store)} {noun}s, {store.num_tokens} tokens; {legend}"]
    for i in indices:
        if not 0 <= i < len(store):
            raise DataError(f"{noun} {i} does not exist: the store holds {noun}s 0..{len(store) - 1}")
        tokens, mask = store.document(i)
        out.append(f"--- {noun} {i}: {len(tokens)} tokens, {int(loss_bit(mask).sum())} carry loss ---")
        out.append(render_pair(tokens, mask, tokenizer, color) if pairs else render_document(tokens, mask, tokenizer, color))
    return "\n".join(out) + "\n"


PAIR_LABELS = ("prompt", "chosen", "rejected")


def render_pair(tokens: np.ndarray, mask: np.ndarray, tokenizer: Tokenizer, color: bool) -> str:
    """A stored pair (``data/store/pair_layout.py``) as its three parts, each on lines of its own after its
    label: the prompt once (its last token, which opens each answer's branch, included), then each answer
    with its loss-carrying tokens marked."""
    tokens, mask = np.asarray(tokens), np.asarray(mask)
    prefix, c, _ = (int(x) for x in pair_spans(mask, [len(mask)])[0])
    prompt = tokens[: prefix + 1]
    parts = [
        render_document(prompt, np.zeros(len(prompt), np.uint8), tokenizer, color),
        render_document(tokens[prefix + 1 : prefix + c], loss_bit(mask[prefix + 1 : prefix + c]), tokenizer, color),
        render_document(tokens[prefix + c + 1 :], loss_bit(mask[prefix + c + 1 :]), tokenizer, color),
    ]
    sizes = (len(prompt), c - 1, len(tokens) - prefix - c - 1)
    return "\n".join(f"[{label}: {n} tokens]\n{text}" for label, n, text in zip(PAIR_LABELS, sizes, parts))


SCAN = 1000  # records of a source looked at for render_cleaning


def _records(cfg: DataConfig) -> Iterator[tuple[str, dict]]:
    if cfg.path is None:
        for i, r in enumerate(generate_records(cfg.default.num_records, cfg.default.seed)):
            yield f"default dataset: record {i}", as_pair(r, i, cfg.default.seed) if cfg.pairs is True else r
        return
    for item in iter_records(cfg.path, cfg.format):  # each file of a pattern in its own format
        if not isinstance(item, BadRecord):  # reported by prepare
            yield item


def _field(record: dict, value: str) -> str:
    """The name of the top-level field that holds ``value`` (a chat message's text: its list's field)."""
    for k, v in record.items():
        if v == value or (isinstance(v, list) and any(isinstance(m, dict) and value in m.values() for m in v)):
            return k
    return "value"


def render_cleaning(cfg: DataConfig, num: int) -> str:
    """Records that cleaning changed, before and after (see the module doc); "" when no step rewrites text."""
    cleaner = Cleaner(dataclasses.replace(cfg.clean, dedupe=False))
    if not cleaner.steps:
        return ""
    out = [f"cleaning ({', '.join(name for name, _ in cleaner.steps)}): records it changed, field values before and after"]
    changes: list[tuple[str, str, list[str]]] = []  # of the record being rendered

    def transform(value: str) -> str:
        cleaner.start_record()
        new = cleaner.transform(value)
        if new != value:
            changes.append((value, new, sorted(cleaner.touched)))
        return new

    dedupe = dedupe_mode(cfg.clean) != "off"  # exact copies after cleaning are marked; near ones only prepare finds
    seen: dict[bytes, str] = {}  # rendered text -> the first record with it, over every source (as prepare dedupes)
    for name, c in source_configs(cfg):
        if c.format in FORMATS:  # token ids another engine wrote: no text was cleaned
            continue
        fmt = "json" if c.path is None else detect_format(c.path, c.format)
        if fmt == "text":  # paragraphs: the text is the record (as prepare reads it)
            c = dataclasses.replace(c, template="raw", fields=dataclasses.replace(c.fields, text="text"))
        if c.template == "chat_template":  # the same messages cleaned; only the tokenizer's markup differs
            c = dataclasses.replace(c, template="chatml")
        shown = 0
        for where, rec in islice(_records(c), SCAN):
            changes.clear()
            copy_of = None
            try:
                if c.pairs is True:
                    pair = pair_segments(rec, c, transform)
                    segments = [*pair.prompt, *pair.chosen, *pair.rejected]
                else:
                    segments = render(rec, c, transform)
                copy_of = seen.setdefault(text_key("".join(t for t, _ in segments)), where) if dedupe else None
            except (RecordError, EmptiedByCleaning):
                pass  # what was cleaned before the field that failed is still shown
            if not changes:
                continue
            dropped = f"; then dropped by dedupe: the same text as {copy_of}" if copy_of not in (None, where) else ""
            out.append(f"--- {where}: changed by {', '.join(sorted({s for _, _, steps in changes for s in steps}))}{dropped} ---")
            for before, after, steps in changes:
                field = _field(rec, before)
                out += [f"{field} before: {before!r}", f"{field} after:  {after!r}  ({', '.join(steps)})"]
            shown += 1
            if shown >= num:
                break
        if not shown:
            out.append(f"--- {name}: cleaning changed none of its first {SCAN} records ---")
    return "\n".join(out) + "\n"

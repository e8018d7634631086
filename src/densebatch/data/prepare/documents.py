"""Documents: records -> rendered, cleaned, filtered, tokenised documents with an exact loss mask by position.

``Builder(cfg, tok, summary)`` reads one source's records (``read``), turns them into ``Doc``s
(``documents``: render with the template, clean, filter, tokenize each segment on its own and
concatenate, append the end-of-text), chunks plain text (``chunk``) and applies the length policy
(``finish``); every record it does not keep is counted in the summary. Duplicates are not judged here
(that needs every record): each rendered document carries its keys (``text_key``, and with near dedupe
its MinHash ``sig`` and ``bands``) for ``dedupe.dedupe``. ``split_eval`` holds out documents by content
hash. ``prepare`` drives it and stores the result.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from densebatch.config import DataConfig
from densebatch.data.prepare import default_dataset
from densebatch.data.prepare.chat_template import ChatTemplate
from densebatch.data.prepare.clean import Cleaner
from densebatch.data.prepare.dedupe import Signer, dedupe_mode, text_key
from densebatch.data.prepare.pair_documents import RenderedPair, answer_loss, finish_pair, tokenize_pairs
from densebatch.data.prepare.pairs import pair_segments
from densebatch.data.prepare.row_ranges import RowRange, read_range
from densebatch.data.prepare.sources import BadRecord, LineRange, iter_records, read_jsonl_range
from densebatch.data.prepare.summary import PrepareSummary
from densebatch.data.prepare.templates import EmptiedByCleaning, RecordError, missing_fields, render
from densebatch.data.prepare.text_blocks import cut, piece_key, text_blocks, without_inner_ends
from densebatch.data.prepare.tokenizers import Tokenizer
from densebatch.errors import DataError

_ENCODE_CHUNK = 4096  # texts per encode_batch call: large enough for the library's threads
COLUMNAR = ("csv", "parquet", "hf_disk")  # formats whose records all have the same fields: the file's columns


@dataclass
class Doc:
    key: bytes  # content hash: decides the eval split
    tokens: np.ndarray  # int32
    mask: np.ndarray  # uint8
    record: dict | None
    text_key: bytes | None = None  # hash of the rendered text (None: not rendered), for dedupe and the leakage count
    sig: np.ndarray | None = None  # near dedupe: MinHash signature of the content (uint16), None when it has no word
    bands: np.ndarray | None = None  # near dedupe: its LSH band hashes (uint64)


# What ``finish_one`` did to a document; the first two keep it
KEPT, TRUNCATED, DROPPED_OVERLONG, DROPPED_NO_TARGET, DROPPED_NO_LOSS = range(5)


def record_key(record: dict) -> bytes:
    text = json.dumps(record, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()


# --------------------------------------------------------------------------------- building
class Builder:
    """Turns records into documents, counting every record it does not keep."""

    def __init__(self, cfg: DataConfig, tok: Tokenizer, summary: PrepareSummary, collect_bad: bool = False) -> None:
        """``collect_bad``: bad records go to ``self.bad_records`` in order, neither raised nor counted."""
        self.cfg, self.tok, self.s = cfg, tok, summary
        self.cleaner = Cleaner(cfg.clean, keep_edges=cfg.text_split == "chunks")  # chunks: blocks' edges are not the text's
        self.signer = Signer(cfg.clean.near_threshold) if dedupe_mode(cfg.clean) == "near" else None
        self.bad_records: list[BadRecord] | None = [] if collect_bad else None
        # the tokenizer's own chat template (a ConfigError at once when it has none)
        self.chat = ChatTemplate.of(tok) if cfg.template == "chat_template" else None
        self.pairs = cfg.pairs is True  # records are preference pairs (data.pairs, resolved by the run)

    def bad(self, b: BadRecord) -> None:
        if self.bad_records is not None:
            self.bad_records.append(b)
            return
        if self.cfg.on_bad_record == "error":
            if b.reason == "bad_token_ids":  # the fix is the tokenizer, not skipping every record
                raise DataError(str(b))
            raise DataError(f"{b} (set data.on_bad_record: skip to count and skip such records)")
        self.s.skipped[b.reason] = self.s.skipped.get(b.reason, 0) + 1
        self.s.skip_examples.setdefault(b.reason, str(b))

    def read(self, path: str | None, fmt: str) -> list[tuple[str, dict]]:
        return list(self.stream(path, fmt))

    def stream(self, path: str | None, fmt: str, part: LineRange | RowRange | None = None) -> Iterator[tuple[str, dict]]:
        """The good records of ``path`` (None: the embedded default dataset; ``part``: those lines of a
        JSONL file or those rows of a Parquet file or save_to_disk dataset only) in order, one at a time; malformed ones are
        reported (``bad``) as they are met."""
        if part is not None:
            for item in read_jsonl_range(part) if isinstance(part, LineRange) else read_range(part):
                self.s.records_read += 1
                if isinstance(item, BadRecord):
                    self.bad(item)
                else:
                    yield item
            return
        if path is None:
            d = self.cfg.default
            for i, r in enumerate(default_dataset.generate_records(d.num_records, d.seed)):
                self.s.records_read += 1
                yield f"default dataset: record {i}", default_dataset.as_pair(r, i, d.seed) if self.pairs else r
            return
        first = True
        chunked = fmt == "text" and self.cfg.text_split == "chunks"  # blocks of running text (text_blocks.py)
        for item in text_blocks(path) if chunked else iter_records(path, fmt):
            self.s.records_read += 1
            if isinstance(item, BadRecord):
                self.bad(item)
                continue
            if first and fmt in COLUMNAR:
                self.check_columns(path, list(item[1]))
            first = False
            yield item

    def check_columns(self, path: str, columns: list[str]) -> None:
        """A file whose columns lack a field the template reads is one error (every row would fail alike,
        and with ``on_bad_record: skip`` all would be skipped), naming the columns found and those expected."""
        if self.cfg.fields.input_ids in columns:  # pre-tokenised records: no template
            return
        if (problem := missing_fields(columns, self.cfg, noun="column")) is not None:
            raise DataError(f"{path}: {problem}")

    def documents(self, items: list[tuple[str, dict]], pretokenized_ok: bool = True) -> list[Doc]:
        """Render, clean, filter and tokenize ``items`` (in order); bad ones are reported."""
        rendered: list[tuple[int, dict, list, tuple]] = []
        paired: list[RenderedPair] = []
        docs: list[tuple[int, Doc]] = []
        for pos, (where, rec) in enumerate(items):
            if pretokenized_ok and self.cfg.fields.input_ids in rec and not self.pairs:
                try:
                    docs.append((pos, self._pretokenized(rec)))
                except RecordError as e:
                    self.bad(BadRecord(where, e.reason, e.message))
                continue
            self.cleaner.start_record()
            try:
                if self.pairs:  # a preference pair: its prompt and two answers (pairs.py)
                    pair = pair_segments(rec, self.cfg, self.cleaner.transform, self.chat)
                    segments = [*pair.prompt, *pair.chosen, *pair.rejected]
                else:
                    segments = render(rec, self.cfg, self.cleaner.transform, self.chat)
            except RecordError as e:
                self.bad(BadRecord(where, e.reason, e.message))
                continue
            except EmptiedByCleaning:
                self.cleaner.finish_record()
                self.cleaner.drop("emptied")
                continue
            self.cleaner.finish_record()
            text = "".join(t for t, _ in segments)
            if self.cleaner.keep(text):
                signed = self.signer.sign("\n".join(self.cleaner.values)) if self.signer is not None else None
                keys = (text_key(text), *(signed or (None, None)))
                if self.pairs:
                    paired.append(RenderedPair(pos, where, rec, pair, keys))
                else:
                    rendered.append((pos, rec, segments, keys))
        docs += self._tokenize(rendered)
        if paired:
            made, bad = tokenize_pairs(self.tok, paired, self.cfg)
            for b in bad:
                self.bad(b)
            by_pos = {it.pos: it for it in paired}
            docs += [
                (pos, Doc(record_key(by_pos[pos].record), t, m, by_pos[pos].record, *by_pos[pos].keys)) for pos, (t, m) in made
            ]
        docs.sort(key=lambda x: x[0])  # input order, pre-tokenised records among the others
        return [d for _, d in docs]

    def _tokenize(self, rendered: list[tuple[int, dict, list, tuple]]) -> list[tuple[int, Doc]]:
        """Each record's segments tokenised on their own and laid end to end with the end-of-text, the
        loss mask by segment; built as one flat array a batch (each document a view of it)."""
        docs = []
        for lo in range(0, len(rendered), _ENCODE_CHUNK):
            part = rendered[lo : lo + _ENCODE_CHUNK]
            ids = self.tok.encode_batch([t for _, _, segs, _ in part for t, _ in segs])
            seg_len = np.fromiter(map(len, ids), np.int64, len(ids))
            segs_per_doc = np.fromiter((len(segs) for _, _, segs, _ in part), np.int64, len(part))
            flags = np.fromiter((flag for _, _, segs, _ in part for _, flag in segs), np.uint8, len(ids))
            # The end-of-text carries loss when the text before it does (a response, an assistant turn).
            eos_flags = [next((flag for t, flag in reversed(segs) if t.strip()), True) for _, _, segs, _ in part]
            doc_ends = np.cumsum(segs_per_doc)
            seg_ends = np.concatenate([[0], np.cumsum(seg_len)])
            doc_len = seg_ends[doc_ends] - seg_ends[doc_ends - segs_per_doc] + 1  # its segments and the end-of-text
            bounds = np.concatenate([[0], np.cumsum(doc_len)])
            tokens = np.empty(int(bounds[-1]), np.int32)
            mask = np.empty(int(bounds[-1]), np.uint8)
            eos_at = bounds[1:] - 1
            body = np.ones(len(tokens), bool)
            body[eos_at] = False
            tokens[body] = np.fromiter(itertools.chain.from_iterable(ids), np.int32, int(seg_len.sum()))
            mask[body] = np.repeat(flags, seg_len)
            tokens[eos_at] = self.tok.eos_id
            mask[eos_at] = np.asarray(eos_flags, np.uint8)
            for j, (pos, rec, _segs, keys) in enumerate(part):
                a, b = int(bounds[j]), int(bounds[j + 1])
                docs.append((pos, Doc(record_key(rec), tokens[a:b], mask[a:b], rec, *keys)))
        return docs

    def _pretokenized(self, rec: dict) -> Doc:
        f = self.cfg.fields
        ids, labels = rec[f.input_ids], rec.get(f.labels)
        if not isinstance(ids, list) or not ids:
            raise RecordError(
                "wrong_type" if not isinstance(ids, list) else "empty_field",
                f"field '{f.input_ids}' should be a non-empty list of token ids",
            )
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise RecordError("bad_token_ids", f"field '{f.input_ids}' holds a value that is not an integer token id")
        if not 0 <= min(ids) <= max(ids) < self.tok.vocab_size:
            bad = next(i for i in ids if not 0 <= i < self.tok.vocab_size)
            raise RecordError(
                "bad_token_ids",
                f"field '{f.input_ids}' holds id {bad}, outside the {self.tok.vocab_size} ids of data.tokenizer "
                f"{self.tok.name!r}: set data.tokenizer to the tokenizer these ids came from (a tokenizer.json or "
                "model directory)",
            )
        tokens = np.asarray(ids, np.int32)
        if labels is None:
            mask = np.ones(len(ids), np.uint8)
        else:
            if not isinstance(labels, list) or len(labels) != len(ids):
                raise RecordError("bad_labels", f"field '{f.labels}' should be a list as long as '{f.input_ids}' ({len(ids)})")
            lab = np.asarray([x if isinstance(x, int) else -(10**9) for x in labels], np.int64)
            if np.any((lab != -100) & (lab != tokens)):
                raise RecordError(
                    "bad_labels",
                    f"field '{f.labels}': each label must be -100 or equal to its input id (unshifted, as Hugging Face)",
                )
            mask = (lab != -100).astype(np.uint8)
        if tokens[-1] != self.tok.eos_id:
            tokens = np.append(tokens, np.int32(self.tok.eos_id))
            mask = np.append(mask, mask[-1])
        return Doc(record_key(rec), tokens, mask, None)

    def chunk(self, docs: list[Doc]) -> list[Doc]:
        """text_split=chunks: the blocks ``docs`` end to end, one document per chunk_tokens tokens; only the
        last keeps the end-of-text (``text_blocks.py``)."""
        if not docs:
            return []
        lengths = np.array([len(d.tokens) for d in docs], np.int64)
        tokens, mask = np.concatenate([d.tokens for d in docs]), np.concatenate([d.mask for d in docs])
        pieces, _, _ = cut(*without_inner_ends(tokens, mask, lengths, last=True), self.cfg.chunk_tokens, final=True)
        return [Doc(piece_key(t), t, m, None) for t, m in pieces]

    def finish(self, docs: list[Doc]) -> list[Doc]:
        """Overlong policy, and drop documents with no loss-carrying target; all counted."""
        out = []
        for d in docs:
            outcome = finish_one(d, self.cfg)
            count_outcome(self.s, outcome)
            if outcome <= TRUNCATED:
                out.append(d)
        return out


def finish_one(d: Doc, cfg: DataConfig) -> int:
    """Apply the overlong policy to ``d`` (in place) and say what became of it (``KEPT`` ... ``DROPPED_NO_LOSS``)."""
    if cfg.pairs is True:  # a pair (pair_documents.py): its first token is a prompt token, never a target
        finished = finish_pair(d.tokens, d.mask, cfg)
        if finished is None:
            return DROPPED_OVERLONG
        d.tokens, d.mask, truncated = finished
        if 0 in answer_loss(d.mask):
            return DROPPED_NO_LOSS
        return TRUNCATED if truncated else KEPT
    d.mask[0] = 0  # the first token is never a target
    if len(d.tokens) > cfg.max_seq_len:
        if cfg.overlong == "drop":
            return DROPPED_OVERLONG
        d.tokens, d.mask = d.tokens[: cfg.max_seq_len], d.mask[: cfg.max_seq_len]
        if not d.mask.any():
            return DROPPED_NO_TARGET
        return TRUNCATED if d.mask.any() else DROPPED_NO_LOSS
    return KEPT if d.mask.any() else DROPPED_NO_LOSS


def count_outcome(s: PrepareSummary, outcome: int, n: int = 1) -> None:
    """Add ``n`` documents that ``finish_one`` judged ``outcome`` to the summary's counts."""
    if outcome == TRUNCATED:
        s.truncated += n
    elif outcome == DROPPED_OVERLONG:
        s.dropped_overlong += n
    elif outcome == DROPPED_NO_TARGET:
        s.dropped_no_target += n
    elif outcome == DROPPED_NO_LOSS:
        s.dropped_no_loss += n


def split_eval(docs: list[Doc], fraction: float) -> tuple[list[Doc], list[Doc]]:
    """(train, eval): eval = the round(fraction * n) documents of smallest content hash, in input order."""
    n = len(docs)
    n_eval = 0 if fraction <= 0 or n < 2 else min(n - 1, max(1, round(fraction * n)))
    ranked = sorted(range(n), key=lambda i: (docs[i].key, i))
    held = set(ranked[:n_eval])
    return [d for i, d in enumerate(docs) if i not in held], [d for i, d in enumerate(docs) if i in held]


# --------------------------------------------------------------------------------- bpe:N

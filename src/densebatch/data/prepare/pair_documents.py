"""Pair documents: a pair's segments tokenised into the stored pair (``data/store/pair_layout.py``), and its length rule.

Each segment is tokenised on its own (as a document's are), the prompt's tokens once, each answer's followed
by the end-of-text (which carries loss when the answer's text before it does). A prompt that leaves no room
for one token of each answer within ``data.max_seq_len`` is a bad pair (``prompt_too_long``).

``data.max_seq_len`` bounds the pair as a row holds it (``P + C + R + 1`` tokens: the prompt once, its last
token opening each answer): it is what a packed row or a budget must fit, and no pair is ever split. A longer
pair is dropped (``overlong: drop``) or its answers are cut at their ends (``truncate``), the longer first:
each keeps at least half the room, or all of its own when it needs less.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from densebatch.config import DataConfig
from densebatch.data.prepare.pairs import PairSegments
from densebatch.data.prepare.sources import BadRecord
from densebatch.data.store.pair_layout import CHOSEN, REJECTED, loss_bit, pair_document, pair_spans


@dataclass
class RenderedPair:
    pos: int  # the record's place among the items
    where: str  # file:line, for a bad pair's message
    record: dict
    pair: PairSegments
    keys: tuple  # (text key, MinHash signature, band hashes)


def tokenize_pairs(tok, items: list[RenderedPair], cfg: DataConfig) -> tuple[list[tuple[int, tuple]], list[BadRecord]]:
    """((pos, (tokens, mask, item)) of each good pair, the bad pairs): every segment of every pair in one
    ``encode_batch`` call."""
    texts, flags, owners = [], [], []
    for i, it in enumerate(items):
        for part, segs in enumerate((it.pair.prompt, it.pair.chosen, it.pair.rejected)):
            for text, flag in segs:
                texts.append(text)
                flags.append(flag)
                owners.append((i, part))
    ids = tok.encode_batch(texts) if texts else []
    pieces: list[list[list[int]]] = [[[], [], []] for _ in items]
    loss: list[list[list[int]]] = [[[], [], []] for _ in items]
    for got, flag, (i, part) in zip(ids, flags, owners):
        pieces[i][part] += got
        loss[i][part] += [int(flag)] * len(got)
    out, bad = [], []
    for i, it in enumerate(items):
        prompt, chosen, rejected = (np.asarray(x, np.int64) for x in pieces[i])
        if len(prompt) < 1:
            bad.append(BadRecord(it.where, "empty_field", "the prompt has no tokens (a pair's answers follow a prompt)"))
            continue
        if len(prompt) + 3 > cfg.max_seq_len:
            bad.append(
                BadRecord(
                    it.where,
                    "prompt_too_long",
                    f"the prompt's {len(prompt)} tokens leave no room for the answers within data.max_seq_len "
                    f"{cfg.max_seq_len} (a pair takes its prompt, then both answers)",
                )
            )
            continue
        ends = []
        for segs in (it.pair.chosen, it.pair.rejected):
            # the end-of-text carries loss when the answer's text before it does (as a document's)
            ends.append(next((flag for t, flag in reversed(segs) if t.strip()), True))
        tokens, mask = pair_document(
            prompt,
            np.append(chosen, tok.eos_id),
            np.append(rejected, tok.eos_id),
            chosen_loss=loss[i][1] + [int(ends[0])],
            rejected_loss=loss[i][2] + [int(ends[1])],
        )
        out.append((it.pos, (tokens, mask)))
    return out, bad


def finish_pair(tokens: np.ndarray, mask: np.ndarray, cfg: DataConfig) -> tuple[np.ndarray, np.ndarray, bool] | None:
    """(tokens, mask, truncated) of a pair under ``data.max_seq_len`` and ``data.overlong``; None when dropped."""
    n = len(tokens)
    if n <= cfg.max_seq_len:
        return tokens, mask, False
    if cfg.overlong == "drop":
        return None
    prefix, c, r = (int(x) for x in pair_spans(mask, [n])[0])
    room = cfg.max_seq_len - prefix  # both branches, each opened by the prompt's last token
    keep_c = min(c, max(room - r, room // 2))
    keep_r = min(r, room - keep_c)
    keep = np.concatenate([np.arange(prefix + keep_c), prefix + c + np.arange(keep_r)])
    return tokens[keep], mask[keep], True


def answer_loss(mask: np.ndarray) -> tuple[int, int]:
    """Loss tokens of (chosen, rejected) in one pair's mask."""
    part = np.right_shift(mask, 1)
    bit = loss_bit(mask)
    return int(bit[part == CHOSEN].sum()), int(bit[part == REJECTED].sum())

"""How a preference pair lies in a document store: one document, its prompt once, each answer after it.

A pair of prompt ``p0 .. p(P-1)``, chosen answer ``c0 .. c(C-1)`` and rejected answer ``r0 .. r(R-1)`` (each
answer ending with the end-of-text) is stored as the row lays it out with its prompt shared::

    tokens    p0 .. p(P-2) | p(P-1) c0 .. c(C-1) | p(P-1) r0 .. r(R-1)       P + C + R + 1 tokens
    part      0  ..  0     | 1      1  ..  1     | 2      2  ..  2
    positions 0  ..  P-2   | P-1    P  ..  P+C-1 | P-1    P  ..  P+R-1      (rejected continues the prompt)

The prompt's last token opens each answer's branch (it predicts the answer's first token, whose target
differs between the two), so its input is laid twice and the rest of the prompt once. The stored length
is the length the pair takes in a row, which is what the planners see: no plan splits a pair, and a
budget counts it as laid out. Laying the prompt twice (``[p c] [p r]``, for a kernel that cannot keep the
rejected branch from the chosen one) takes ``P - 1`` more.

The part travels in the loss mask's bits, so that shards, mixtures, dedupe and the eval split carry it
untouched: ``mask & 1`` is the loss bit as for every document (this token, as a target, carries loss)
and ``mask >> 1`` the part, 0 for every token of a plain document. Counts of loss tokens read the loss
bit (``loss_bit``).
"""

from __future__ import annotations

import numpy as np

PROMPT, CHOSEN, REJECTED = 0, 1, 2  # a token's part (mask >> 1); 0 also for every token of a plain document
LOSS = 1  # the loss bit


def loss_bit(mask: np.ndarray) -> np.ndarray:
    """The loss bit of each token (uint8 0/1): what carries loss, pairs or not."""
    return np.bitwise_and(mask, LOSS)


def part_of(mask: np.ndarray) -> np.ndarray:
    """Each token's part: ``PROMPT`` (the shared prompt, and every token of a plain document), ``CHOSEN`` or
    ``REJECTED`` (the answer's branch, opened by the prompt's last token)."""
    return np.right_shift(mask, 1)


def pair_document(prompt: np.ndarray, chosen: np.ndarray, rejected: np.ndarray, *, chosen_loss, rejected_loss):
    """(tokens int32, mask uint8) of one pair as stored; ``*_loss``: each answer token's loss flag (0/1)."""
    if len(prompt) < 1 or len(chosen) < 1 or len(rejected) < 1:
        raise ValueError("a pair needs a prompt token and an answer token on each side")
    last = prompt[-1:]
    tokens = np.concatenate([prompt[:-1], last, chosen, last, rejected]).astype(np.int32)
    mask = np.concatenate(
        [
            np.zeros(len(prompt) - 1, np.uint8),
            [CHOSEN << 1],
            (CHOSEN << 1) | np.asarray(chosen_loss, np.uint8),
            [REJECTED << 1],
            (REJECTED << 1) | np.asarray(rejected_loss, np.uint8),
        ]
    ).astype(np.uint8)
    return tokens, mask


def pair_spans(mask: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """(prefix, chosen branch, rejected branch) token counts of each pair of ``mask`` (the pairs' masks end to
    end, cut by ``lengths``): (pairs, 3) int64. A pair's prompt is ``prefix + 1`` tokens."""
    lengths = np.asarray(lengths, np.int64)
    part = part_of(np.asarray(mask))
    doc = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    return np.bincount(3 * doc + part.astype(np.int64), minlength=3 * len(lengths)).reshape(-1, 3)


def is_pair(mask: np.ndarray) -> bool:
    """True when ``mask`` (one document's) is a pair's."""
    return bool(np.any(part_of(np.asarray(mask))))

"""inspect: render prepared documents as text with the loss-carrying tokens marked.

``render_documents(store, tokenizer, indices, color)`` decodes each document in runs of tokens that
do / do not carry loss. Loss runs are shown in green (``color=True``, for a terminal) or wrapped in
``[[`` ... ``]]`` (plain text, for logs and pipes). Each document gets a header with its token count
and loss-token count, so a user sees exactly what the model is trained on.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from densebatch.data.prepare.store import DocumentStore
from densebatch.data.prepare.tokenizers import Tokenizer
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
    out = [f"{len(store)} documents, {store.num_tokens} tokens; {legend}"]
    for i in indices:
        if not 0 <= i < len(store):
            raise DataError(f"document {i} does not exist: the store holds documents 0..{len(store) - 1}")
        tokens, mask = store.document(i)
        out.append(f"--- document {i}: {len(tokens)} tokens, {int(mask.sum())} carry loss ---")
        out.append(render_document(tokens, mask, tokenizer, color))
    return "\n".join(out) + "\n"

"""``text_split: chunks``: running text read in blocks, tokenised block by block, cut into documents.

A plain-text file is read as blocks of about ``BLOCK_BYTES`` (whole lines; a block ends before a line
that starts with a letter or a digit, after a line that ends in one newline after a character that is not
white space: ``_boundary``), so that no process holds the whole file: each block is a record,
rendered, cleaned and tokenised on its own (by the streamed prepare's workers, ``stream.py``). The
blocks are then laid end to end without their end-of-text, the file's last block keeping its own, and
cut into documents of ``data.chunk_tokens`` tokens (``cut``; a last piece of one token is dropped: it
has no target). The in-memory path (``documents.Builder.chunk``) and the streamed one
(``stream_cut.py``) cut with the same functions, so their stores are the same byte for byte.

Why the block ends there: for byte-level BPE tokenizers (GPT-2's, Llama 3's, tiktoken's and the
byte-level default) a single newline between a character that is not white space and a letter or a
digit is always a pre-token of its own, so tokenising block by block gives the tokens of one pass over the whole file (tested
on the shared Shakespeare text with the GPT-2 BPE). A tokenizer that marks the start of its input
(SentencePiece's ``▁``, Metaspace's ``prepend_scheme``) sees each block's start as a text's start:
one extra marker every ``BLOCK_BYTES`` of text.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from densebatch.data.prepare.sources import SURROGATE, BadRecord, has_undecodable, iter_records

BLOCK_BYTES = 1 << 16  # text a block (64 KiB); a streamed chunk takes data.chunk_records KiB of blocks (stream.py)


def text_blocks(path: str | Path) -> Iterator[tuple[str, dict] | BadRecord]:
    """The blocks of the text file ``path`` as records ``(file:first_line, {"text": ...})``, in order; a
    block with bytes that are not UTF-8 is a ``BadRecord`` naming its first such line."""
    p = Path(path)
    next(iter_records(p, "text"))  # the same checks as paragraphs: missing, empty, whitespace only
    with open(p, "rb") as f:
        first, lines, size = 1, [], 0
        for number, raw in enumerate(f, 1):
            if size >= BLOCK_BYTES and (moved := _boundary(lines[-1], raw)) is not None:
                rest = lines[-1][len(lines[-1]) - moved :]  # a CRLF's "\n" opens the next block
                lines[-1] = lines[-1][: len(lines[-1]) - moved]
                yield _block(p, first, lines)
                first, lines, size = number - bool(moved), [rest] if moved else [], moved
            lines.append(raw)
            size += len(raw)
        if lines:
            yield _block(p, first, lines)


def _boundary(before: bytes, line: bytes) -> int | None:
    """Whether a block may end between the line ``before`` and ``line``: ``line`` starts with a letter or a
    digit and ``before`` ends with one line break after a character that is not white space, so that no
    run of white space is cut (a tokenizer's pre-tokens join such runs: ``"\\n\\n"`` at the end of a text
    is one GPT-2 token, two in the middle of one). None: it may not; else how many bytes of ``before``'s
    end open the next block instead (1: the ``"\\n"`` of a ``"\\r\\n"``, whose two characters are one
    pre-token only at the end of a text; 0: none)."""
    if not line[:4].decode("utf-8", "ignore")[:1].isalnum():
        return None
    body, moved = (before[:-2], 1) if before.endswith(b"\r\n") else (before[:-1], 0) if before.endswith(b"\n") else (b"", 0)
    end = body[-4:].decode("utf-8", "ignore")[-1:]
    return moved if end and not end.isspace() else None


def _block(p: Path, first: int, lines: list[bytes]) -> tuple[str, dict] | BadRecord:
    text = b"".join(lines).decode("utf-8-sig" if first == 1 else "utf-8", "surrogateescape")
    if has_undecodable(text):
        line = first + text[: SURROGATE.search(text).start()].count("\n")
        return BadRecord(f"{p}:{line}", "undecodable_bytes", "undecodable bytes; the file must be UTF-8")
    return f"{p}:{first}", {"text": text}


def without_inner_ends(tokens: np.ndarray, mask: np.ndarray, lengths: np.ndarray, last: bool) -> tuple[np.ndarray, np.ndarray]:
    """Blocks (``lengths`` tokens each, end to end) without their end-of-text token; with ``last`` the
    final block keeps its own (it ends the file)."""
    keep = np.ones(len(tokens), bool)
    ends = np.cumsum(lengths.astype(np.int64)) - 1
    keep[ends[:-1] if last and len(ends) else ends] = False
    return tokens[keep], mask[keep]


def cut(
    tokens: np.ndarray, mask: np.ndarray, n: int, final: bool
) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray, np.ndarray]:
    """(pieces of ``n`` tokens, the tokens and mask left over): with ``final`` the rest is a last piece
    too, unless it is one token (no target)."""
    full = len(tokens) // n * n
    pieces = [(tokens[a : a + n], mask[a : a + n].copy()) for a in range(0, full, n)]
    rest_t, rest_m = tokens[full:], mask[full:]
    if final:
        if len(rest_t) >= 2:
            pieces.append((rest_t, rest_m.copy()))
        rest_t, rest_m = rest_t[:0], rest_m[:0]
    return pieces, rest_t, rest_m


def piece_key(tokens: np.ndarray) -> bytes:
    """A piece's content hash (its eval split)."""
    return hashlib.blake2b(tokens.tobytes(), digest_size=8).digest()

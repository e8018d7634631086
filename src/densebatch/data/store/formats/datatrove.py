"""datatrove's tokenised shards (``NAME.ds`` + ``NAME.ds.index`` [+ ``NAME.ds.loss``]), checked and read in place.

The layout datatrove's ``DocumentTokenizer`` and ``DocumentTokenizerMerger`` write
(``datatrove.pipeline.tokens.tokenizer.TokenizedFile``), little-endian::

    NAME.ds           every document's token ids end to end: uint16, or uint32 when the tokenizer has
                      more than 65,536 ids (its ``token_size``, 2 or 4 bytes)
    NAME.ds.index     uint64 per document: the token offset where it ends (save_index, the default)
    NAME.ds.loss      one byte per token, 1 = the token carries loss (save_loss_metadata only)
    NAME.ds.metadata  text: "TOKENIZER|TOKEN_SIZE", the token count, the count in words (optional)

A ``.ds.loss`` value belongs to the token as a target (datatrove's readers shift it with the labels),
as densebatch's loss mask does. The token size is read from ``.ds.metadata`` when it is there, else
from the ``.ds``'s size over the index's last end. Everything is checked against everything else
before training; any disagreement is one ``DataError`` naming the file.
"""

from __future__ import annotations

import glob
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from densebatch.errors import DataError

SUFFIX = ".ds"
DTYPES = {2: np.uint16, 4: np.uint32}


@dataclass(frozen=True)
class TokenShard:
    """One checked ``.ds`` file: its tokens (and loss mask) memory-mapped, each document's first token and length."""

    path: Path
    files: tuple[Path, ...]
    tokens: np.ndarray
    loss: np.ndarray | None  # (tokens,) uint8 memory-mapped .ds.loss, or None
    doc_starts: np.ndarray  # (documents,) int64
    doc_lengths: np.ndarray  # (documents,) int64


def shards_of(path: str) -> list[Path]:
    """The ``.ds`` files ``path`` names: itself (or the shard of its ``.ds.index``), a folder's (sorted,
    below it too), or a glob pattern's."""
    matches = sorted(glob.glob(path, recursive=True)) if glob.has_magic(path) else [path]
    out: dict[Path, None] = {}
    for m in map(Path, matches):
        if m.is_dir():
            found = sorted(m.rglob(f"*{SUFFIX}"))
            if not found:
                raise DataError(f"{m}: no datatrove shard (*.ds) in this folder")
            out.update(dict.fromkeys(found))
        elif m.name.endswith(SUFFIX) or not glob.has_magic(path):
            out[m] = None
        else:
            for ext in (".index", ".loss", ".metadata"):
                if m.name.endswith(SUFFIX + ext):
                    out[m.with_name(m.name[: -len(ext)])] = None
    if not out:
        raise DataError(f"{path}: the pattern matches no datatrove shard (*.ds)")
    return list(out)


def _token_size(ds: Path, size: int, total: int) -> int:
    meta = Path(f"{ds}.metadata")
    if meta.is_file():
        first = meta.read_text(encoding="utf-8", errors="replace").splitlines()[:1]
        got = first[0].rsplit("|", 1)[-1] if first else ""
        if not got.isdigit() or int(got) not in DTYPES:
            raise DataError(f"{meta}: token size {got!r}; datatrove writes 2 (uint16) or 4 (uint32)")
        return int(got)
    if total and size % total == 0 and size // total in DTYPES:
        return size // total
    if not total and not size:
        return 2
    raise DataError(f"{ds}: {size} bytes for the {total} tokens its index ends at: neither 2- nor 4-byte ids (cut short?)")


def read_shard(ds: Path) -> TokenShard:
    """Check ``ds`` with its index (and loss mask) and map them; ``DataError`` naming the file."""
    index, loss = Path(f"{ds}.index"), Path(f"{ds}.loss")
    if not ds.is_file():
        raise DataError(f"{ds}: missing")
    if not index.is_file():
        raise DataError(f"{index}: missing (datatrove writes it with save_index, the default): no document boundaries")
    isize = index.stat().st_size
    if isize % 8:
        raise DataError(f"{index}: {isize} bytes, not a whole number of uint64 document ends (cut short)")
    ends = np.fromfile(index, np.dtype("<u8")).astype(np.int64)
    total = int(ends[-1]) if len(ends) else 0
    if len(ends) and (ends[0] < 0 or (np.diff(ends) < 0).any()):
        raise DataError(f"{index}: its document ends are not in order")
    size = ds.stat().st_size
    width = _token_size(ds, size, total)
    if size != total * width:
        what = "cut short" if size < total * width else "longer than its index says"
        raise DataError(f"{ds}: {size} bytes, but {index.name} ends at token {total} ({total * width} bytes): {what}")
    dtype = np.dtype(DTYPES[width]).newbyteorder("<")
    tokens = np.memmap(ds, dtype, mode="r") if total else np.zeros(0, dtype)
    mask = None
    if loss.is_file():
        if loss.stat().st_size != total:
            raise DataError(f"{loss}: {loss.stat().st_size} bytes, one a token: {total} expected (cut short or another shard's)")
        mask = np.memmap(loss, np.uint8, mode="r") if total else np.zeros(0, np.uint8)
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    files = (ds, index) + ((loss,) if mask is not None else ())
    return TokenShard(ds, files, tokens, mask, starts, (ends - starts).astype(np.int64))

"""``text_split: chunks``, streamed: the workers' blocks of running text (``stream.py`` chunk files, each
block one document with its end-of-text) cut into documents of ``data.chunk_tokens`` tokens, chunk file
by chunk file, into chunk files of the same kind that ``assemble.assemble`` then reads as any other.

One input chunk's blocks and less than one document of carry are in memory at a time. The pieces are
those of ``documents.Builder.chunk`` over all blocks at once (the same ``text_blocks`` functions), so
the store is the in-memory path's byte for byte (tested).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from densebatch.data.prepare.documents import KEPT, Builder, Doc
from densebatch.data.prepare.stream import CHUNK_FILES, Chunk, load_chunk, write_chunk
from densebatch.data.prepare.text_blocks import cut, piece_key, without_inner_ends


def cut_chunks(b: Builder, chunks: list[Chunk], stage: Path) -> list[Chunk]:
    """The documents of ``chunks`` (blocks) cut into pieces, written to ``stage/cut/`` (made again each
    time: it is derived from the blocks), one file per input chunk; the new chunks, in order."""
    out = stage / "cut"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    infos = [json.loads((c.stage / f"{CHUNK_FILES.format(c.index)}.json").read_text(encoding="utf-8")) for c in chunks]
    last = max((j for j, info in enumerate(infos) if info["documents"]), default=-1)  # the chunk with the file's last block
    carry_t, carry_m = np.zeros(0, np.int32), np.zeros(0, np.uint8)
    made = []
    for j, (c, info) in enumerate(zip(chunks, infos)):
        p = load_chunk(c.stage, c.index, ("outcome", "lengths", "tokens", "mask"))
        assert (p["outcome"] == KEPT).all(), "blocks are kept whole by the workers"
        tokens, mask = without_inner_ends(p["tokens"], p["mask"], p["lengths"], last=j == last)
        both = np.concatenate([carry_t, tokens]), np.concatenate([carry_m, mask])
        pieces, carry_t, carry_m = cut(*both, b.cfg.chunk_tokens, final=j >= last)
        docs = [Doc(piece_key(t), t, m, None) for t, m in pieces]
        write_chunk(b, stage_dir=out, index=c.index, docs=docs, info=dict(info, documents=len(docs)))
        made.append(Chunk(c.index, c.first, c.last, stage=out))
    return made

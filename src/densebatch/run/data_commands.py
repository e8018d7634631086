"""``densebatch prepare``: the data layer only (no torch import), so a cache hit costs what reading the
cache entry costs, not the seconds torch takes to import."""

from __future__ import annotations

from densebatch.config import RunConfig
from densebatch.data.prepare.pipeline import prepare as prepare_data
from densebatch.data.prepare.vocab import added_tokens_line


def prepare_command(cfg: RunConfig, args) -> int:
    prepared = prepare_data(cfg.data, cfg.seed)
    print(prepared.summary)
    if (line := added_tokens_line(prepared.tokenizer.added)) is not None:
        print(line)
    print(f"documents: {prepared.cache_dir}")
    return 0

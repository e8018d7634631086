"""What ``prepare`` builds one cache entry for: the parts of the sources, and each rank's share of them.

A part is one input file of one source. ``data.path`` (or a source's ``path``) given as a glob pattern
(``corpus/part-*.jsonl``; ``**`` for every level below) has one part per file it matches, in sorted
order; any other path is one part. Each part is prepared on its own, in its own cache entry whose key
names that file alone (``cache.cache_key``), so adding a file to a corpus prepares that file and
nothing else, and editing one prepares that one again (with dedupe on, a part's key also names the
parts before it, whose records it is deduped against: the files after an edited one are made again
too). A source of several files is then laid out as a mixture's source is: its entry's index points
at its files' shards, all under the source's index, and its summary sums theirs.

What follows from a file being a part: with ``data.eval_path`` the first file's part holds it (and no
file holds out records); else the eval split (``eval_fraction``) is taken in each file by itself, as the smallest content hashes of that file's records (adding a file never moves a record of
another between train and eval), and near dedupe keeps the first copy in file order, as it does
within one file.
"""

from __future__ import annotations

import dataclasses
import glob
from pathlib import Path

from densebatch.config import DataConfig
from densebatch.data.prepare.cache import source_keys
from densebatch.data.prepare.documents import Builder
from densebatch.data.prepare.foreign import foreign_format
from densebatch.data.prepare.foreign_mixture import own_sources
from densebatch.data.prepare.source_configs import source_configs
from densebatch.data.prepare.sources import detect_format, expand, is_pattern
from densebatch.data.prepare.stream import prepare_chunks, stage_dir, workers
from densebatch.data.prepare.summary import PrepareSummary
from densebatch.data.prepare.tokenizers import PendingBPE, load_data_tokenizer
from densebatch.data.store.store import marker_ok
from densebatch.errors import DataError


@dataclasses.dataclass(frozen=True)
class Part:
    source: int  # the source's index (its id in the store)
    name: str  # the source's name
    cfg: DataConfig  # the source's settings, its path this part's file
    fmt: str


def resolved(cfg: DataConfig) -> tuple[DataConfig, str]:
    """(cfg, format) of one file, checked: a plain text file has no fields to template (its paragraphs are the text)."""
    for p in (cfg.path, cfg.eval_path):
        if p is not None and not Path(p).exists():
            raise DataError(f"{p}: file not found (data.path / data.eval_path)")
    fmt = "json" if cfg.path is None else detect_format(cfg.path, cfg.format)
    if fmt == "text":
        cfg = dataclasses.replace(cfg, template="raw", fields=dataclasses.replace(cfg.fields, text="text"))
    return cfg, fmt


def check_inputs(cfg: DataConfig) -> None:
    """``DataError`` naming the first input ``cfg`` names that is not there (each source's path and eval path: a
    file, a folder, a Megatron prefix, or a glob pattern that matches something), before a command checks
    or writes anything else: a missing data file is reported as that, not as whatever was checked first."""
    for i, (_, c) in enumerate(source_configs(cfg)):
        for key, p in (("path", c.path), ("eval_path", c.eval_path)):
            name = f"data.sources[{i}].{key}" if cfg.sources else f"data.{key}"
            if p is None:
                continue
            if is_pattern(p):
                if not glob.glob(str(p), recursive=True):
                    raise DataError(f"{p}: no file matches this pattern ({name})")
            elif not (Path(p).exists() or (c.format == "megatron" and any(Path(f"{p}{x}").exists() for x in (".idx", ".bin")))):
                raise DataError(f"{p}: file not found ({name})")


def source_parts(cfg: DataConfig) -> list[Part]:
    """Every part of every source, in store order (see the module docstring)."""
    out = []
    for i, (name, c) in enumerate(source_configs(cfg)):
        if c.path is not None and is_pattern(c.path):
            if c.eval_path is not None and is_pattern(c.eval_path):
                raise DataError(f"{c.eval_path}: data.eval_path is one file, not a pattern")
            files = [str(f) for f in expand(c.path)]
        else:
            files = [c.path]
        for k, f in enumerate(files):  # data.eval_path is the source's eval split: the first file's part holds it
            one = (
                dataclasses.replace(c, path=f)
                if k == 0 or c.eval_path is None
                else dataclasses.replace(c, path=f, eval_path=None, eval_fraction=0.0)
            )
            out.append(Part(i, name, *resolved(one)))
    return out


def prepare_share(cfg: DataConfig, rank: int, world_size: int) -> int:
    """Under torchrun, before rank 0's ``prepare``: tokenise this rank's share of every chunk that is not
    prepared yet (chunks ``rank``, ``rank + world_size``, ... of each streamed part not in the cache)
    into the parts' chunk directories, so that every rank works and rank 0 then only assembles. Parts
    with a ``bpe:N`` tokenizer still to learn are left to rank 0. Returns the chunks this rank prepared."""
    if foreign_format(cfg) is not None or (cfg := own_sources(cfg)) is None:  # tokenised: rank 0's prepare indexes it
        return 0
    tok = load_data_tokenizer(cfg)
    if isinstance(tok, PendingBPE):  # learned by rank 0's prepare first: the chunks need its ids
        return 0
    done = 0
    parts = source_parts(cfg)
    for p, key in zip(parts, source_keys([p.cfg for p in parts], tok)):
        final = Path(p.cfg.cache_dir) / key
        if marker_ok(final):
            continue
        b = Builder(p.cfg, tok, PrepareSummary(source=p.cfg.path or p.name))
        done += len(
            prepare_chunks(
                b,
                path=p.cfg.path,
                fmt=p.fmt,
                stage=stage_dir(final, p.cfg),
                num_proc=workers(p.cfg),
                share=(rank, world_size),
                mine=True,
            )
        )
    return done

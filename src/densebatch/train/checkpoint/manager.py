"""Checkpoints: atomic, checksummed, pickle-free save and load of training state, by one process or many.

A checkpoint is a directory ``step-000120/``:

- tensor files: ``model.safetensors``, ``optimizer.safetensors`` and ``extra.safetensors`` (the last only
  when the extra state holds tensors or arrays) when one rank writes everything (one process, DDP);
  under FSDP every rank writes its own rows of each sharded tensor, ``model-00002-of-00004.safetensors``
  and ``optimizer-00002-of-00004.safetensors`` (``train/checkpoint/shards.py``). Tied tensors are stored
  once. No file holds more than one rank's share, plus rank 0's whole tensors (step counters, buffers);
- ``state.json``: the structure of the three states (tensors replaced by ``{"__tensor__": key}``, tuples
  and non-string keys tagged so they come back as they went in) and, for every tensor key, its dtype,
  global shape and the shards that hold it (file, first row, rows);
- ``manifest.json``, written last: size and SHA-256 of every file. Each rank hashes its files while it
  writes them (``tensor_files.py``), rank 0 writes ``state.json`` and the manifest once every rank's
  files are complete.

Guarantees: a directory named ``step-N`` is complete (staged as ``.tmp-step-N-<pid>-<random>``, manifest
last, every file and the directory fsynced, then renamed by rank 0 after every rank wrote its files);
``verify`` detects any flipped byte or truncation and names the file; loading reads only JSON and
safetensors: it never unpickles, never runs code. A checkpoint written on N ranks loads on any number:
each rank reads only the rows its own tensors hold (``targets``). Checkpoints of format 1 (one whole
file per part, before sharded saves) still load.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import SafetensorError

from densebatch.atomic import io_reason, make_staging, publish
from densebatch.errors import UserError
from densebatch.tensor_files import RowReader, write_safetensors
from densebatch.train.checkpoint.dirs import (
    FORMAT_VERSION,
    MANIFEST,
    PARTS,
    STATE,
    CheckpointWarning,
    checkpoint_step,
    cleanup_temp_dirs,
    latest_valid,
    list_checkpoints,
    mirror_checkpoint,
    prune,
    safetensors_keys,
    set_aside,
    sha256_file,
    step_dir_name,
    verify,
)
from densebatch.train.checkpoint.format import CheckpointError, decode_tree, encode_tree
from densebatch.train.checkpoint.shards import (
    file_name,
    index_of_file,
    merge_entries,
    read_part,
    shard_entries,
    split_for_rank,
)
from densebatch.train.dtensors import is_dtensor

__all__ = [
    "MANIFEST", "PARTS", "STATE", "Checkpoint", "CheckpointError", "CheckpointManager", "CheckpointWarning",
    "checkpoint_step", "cleanup_temp_dirs", "latest_valid", "list_checkpoints", "load_checkpoint",
    "mirror_checkpoint", "save_checkpoint", "set_aside", "step_dir_name", "verify",
]  # fmt: skip


class Checkpoint(NamedTuple):
    model_state: dict[str, torch.Tensor]
    optimizer_state: Any  # what was saved: the optimizer's state_dict, or None
    extra_state: Any  # what was saved: a JSON-able dict, or None


class _OneRank:
    """The collectives of one process (what ``Distributed()`` does), without importing the training side."""

    rank, world_size, is_main = 0, 1, True

    def broadcast_object(self, obj, src: int = 0):
        return obj

    def gather_object(self, obj) -> list:
        return [obj]


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(obj, indent=1))
        f.flush()
        os.fsync(f.fileno())


# ------------------------------------------------------------------------------ save
def save_checkpoint(
    root: str | Path,
    *,
    step: int,
    model_state: dict[str, torch.Tensor],
    optimizer_state: Any = None,
    extra_state: Any = None,
    keep_last: int = 3,
    mirror_dir: str | Path | None = None,
    dist: Any = None,
) -> Path:
    """Write ``root/step-NNNNNN`` atomically and return its path; then keep the newest ``keep_last``
    and, when ``mirror_dir`` is set, place a verified copy there (a failed mirror only warns).

    ``dist`` (a ``Distributed``): every rank calls, each with its own view of the states (DTensors under
    FSDP: each writes its rows; plain tensors and the extra state: rank 0's are written). A write that
    fails on any rank (no space left, not writable) leaves nothing under ``step-NNNNNN`` (the staged
    directory is removed) and raises ``CheckpointError`` on every rank in one line: the path, what went
    wrong, and the newest complete checkpoint, which stays the one a resume continues from."""
    if keep_last < 1 or step < 0:
        raise CheckpointError(f"expected keep_last >= 1 and step >= 0; got keep_last={keep_last}, step={step}")
    dist = dist or _OneRank()
    root = Path(root)
    final = root / step_dir_name(step)
    staged, failure = None, None
    if dist.rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            cleanup_temp_dirs(root)
            if final.exists() and not (check := verify(final, check_hashes=False))[0]:
                set_aside(final, check[1])  # a damaged checkpoint of the same step is kept, not replaced
            staged = make_staging(final)
        except (OSError, UserError) as e:
            failure = e
    name = dist.broadcast_object(str(staged) if staged is not None else None)
    if name is None:
        raise _failed(root, final=final, mirror_dir=mirror_dir, failure=failure, rank=dist.rank)
    tmp = Path(name)
    try:
        outcome, failure = _write_staged(
            tmp, final=final, step=step, states=(model_state, optimizer_state, extra_state), dist=dist
        )
    except BaseException:  # a second signal (KeyboardInterrupt) in the middle: nothing staged is left
        if dist.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if outcome is None:
        raise _failed(root, final=final, mirror_dir=mirror_dir, failure=failure, rank=dist.rank)
    if dist.rank == 0:
        prune(root, keep_last, step)
        if mirror_dir is not None and Path(mirror_dir).resolve() != root.resolve():
            try:
                mirror_checkpoint(final, mirror_dir, keep_last=keep_last)
            except (OSError, UserError) as e:  # UserError: CheckpointError, or staged_dir's "cannot be written"
                # A second storage location is a safety net: losing it must not kill a long run.
                warnings.warn(
                    f"checkpoint {final.name}: mirror copy to {mirror_dir} failed: {e}", CheckpointWarning, stacklevel=2
                )
    return Path(outcome)


def _write_staged(tmp: Path, *, final: Path, step: int, states: tuple, dist) -> tuple[str | None, BaseException | None]:
    """Every rank writes its files into ``tmp``; rank 0 then completes and publishes it. Returns (the
    published path, or None on every rank when any rank failed; this rank's failure)."""
    writers = dist.world_size if any(is_dtensor(t) for t in (states[0] or {}).values()) else 1
    failure = None
    try:
        written = _write_rank_files(tmp, dist.rank, writers, states)
    except (OSError, SafetensorError, CheckpointError) as e:  # safetensors reports I/O errors as SafetensorError
        written, failure = {"error": f"{io_reason(e)}{_which(e)}"}, e
    everyone = dist.gather_object(written)
    outcome = None
    if dist.rank == 0:
        try:
            if bad := [(r, w["error"]) for r, w in enumerate(everyone) if "error" in w]:
                raise failure or CheckpointError(f"rank {bad[0][0]}: {bad[0][1]}")
            _finish(tmp, final=final, step=step, states=states, everyone=everyone, writers=writers)
            outcome = str(final)
        except (OSError, SafetensorError, CheckpointError) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            failure = e
    return dist.broadcast_object(outcome), failure


def _write_rank_files(tmp: Path, rank: int, writers: int, states: tuple) -> dict:
    """This rank's tensor files in ``tmp``: ``{"files": {name: {size, sha256}}, "parts": {part: {entries,
    aliases, tree}}}`` (the trees and aliases are the same on every rank; rank 0's are kept)."""
    files, parts = {}, {}
    for part, obj in zip(PARTS, states):
        tree = encode_tree(obj, [], tensors := {})
        if part == "extra" and rank != 0:
            tensors = {}  # the extra state is rank 0's (it holds every rank's RNG states already)
        share, aliases = split_for_rank(tensors, rank)
        name = file_name(part, rank, writers if part != "extra" else 1)
        if share:
            files[name] = write_safetensors({k: t for k, (t, _, _) in share.items()}, tmp / name, {"format": "pt"})
        parts[part] = {"entries": shard_entries(share, name), "aliases": aliases, "tree": tree}
    return {"files": files, "parts": parts}


def _finish(tmp: Path, *, final: Path, step: int, states: tuple, everyone: list[dict], writers: int) -> None:
    """Rank 0, once every rank's files are in ``tmp``: ``state.json``, then the manifest, then the name."""
    parts = {}
    for part in PARTS:
        mine = everyone[0]["parts"][part]
        parts[part] = {
            "tensors": merge_entries([w["parts"][part]["entries"] for w in everyone]),
            "aliases": mine["aliases"],
            "tree": mine["tree"],
        }
    # Module versions that load_state_dict hands to _load_from_state_dict (e.g. BatchNorm's).
    parts["model"]["metadata"] = encode_tree(getattr(states[0], "_metadata", None), ["_metadata"], {})
    _write_json(tmp / STATE, {"format_version": FORMAT_VERSION, "step": step, "writers": writers, "parts": parts})
    files = {name: entry for w in everyone for name, entry in w["files"].items()}
    files[STATE] = {"size": (tmp / STATE).stat().st_size, "sha256": sha256_file(tmp / STATE)}
    _write_json(tmp / MANIFEST, {"format_version": FORMAT_VERSION, "step": step, "files": dict(sorted(files.items()))})
    publish(tmp, final)


def _failed(root: Path, *, final: Path, mirror_dir, failure: BaseException | None, rank: int) -> CheckpointError:
    """The one-line error of a save that did not complete, naming the checkpoint a resume would use."""
    if failure is None:  # another rank failed: its message is the one rank 0 prints
        return CheckpointError(f"checkpoint {final}: cannot be written (rank 0 says why); nothing half-written is left")
    try:
        newest = latest_valid(root, mirror_dir, on_skip=lambda path, why: None) if rank == 0 else None
    except OSError:
        newest = None
    kept = f"the newest complete checkpoint is {newest}" if newest is not None else "there is no earlier checkpoint"
    why = io_reason(failure) + _which(failure) if isinstance(failure, (OSError, SafetensorError)) else str(failure)
    err = CheckpointError(
        f"checkpoint {final}: cannot be written: {why}; nothing half-written is left, "
        f"{kept}: free some space (or fix the directory), then resume"
    )
    err.__cause__ = failure
    return err


def _which(e: BaseException) -> str:
    """`` (writing model.safetensors)`` when the error names the file."""
    name = getattr(e, "filename", None)
    return f" (writing {Path(name).name})" if name else ""


# ------------------------------------------------------------------------------ load
def load_checkpoint(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    parts: tuple[str, ...] = PARTS,
    targets: dict[str, dict[str, Any]] | None = None,
    verified: bool = False,
) -> Checkpoint:
    """Read a checkpoint: ``Checkpoint(model_state, optimizer_state, extra_state)`` with exact dtypes and
    structure (tied tensors come back as one shared tensor). Only ``parts`` are read (the others are None):
    ``parts=("extra",)`` reads a run's configuration and counters without its tensors.

    ``targets``: per part, the state this rank loads into (``encode_tree`` keys -> tensors): where a
    target is a row-sharded DTensor, only its rows are read and it comes back as a DTensor like it; every
    other tensor whole, on ``device``. ``verified``: the files' hashes were checked already (by
    ``latest_valid``): only sizes and headers are checked again. Raises CheckpointError."""
    path = Path(path)
    ok, reason = verify(path, check_hashes=not verified)
    if not ok:
        raise CheckpointError(f"{path}: not a valid checkpoint: {reason}")
    state = json.loads((path / STATE).read_text(encoding="utf-8"))
    out: list = []
    with RowReader(path) as reader:
        for part in PARTS:
            if part not in parts:
                out.append(None)
                continue
            entry = state["parts"][part]
            try:
                index = entry["tensors"] if "tensors" in entry else _format1_index(path, entry)
                tensors = read_part(reader, index, (targets or {}).get(part), device)
            except (SafetensorError, OSError, ValueError) as e:
                raise CheckpointError(f"{path}: the {part} tensors cannot be read as safetensors: {e}") from None
            try:
                out.append(decode_tree(entry["tree"], tensors, entry["aliases"]))
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise CheckpointError(f"{path}: {STATE} is malformed ({type(e).__name__}: {e})") from None
    if isinstance(out[0], dict):  # what nn.Module.state_dict() returns, with its version metadata
        out[0] = OrderedDict(out[0])
        if state["parts"]["model"].get("metadata") is not None:
            out[0]._metadata = decode_tree(state["parts"]["model"]["metadata"], {}, {})
    return Checkpoint(*out)


def _format1_index(path: Path, entry: dict) -> dict:
    if not entry.get("file"):
        return {}
    keys = safetensors_keys(path / entry["file"])
    if isinstance(keys, str):
        raise CheckpointError(f"{path}: {entry['file']}: {keys}")
    return index_of_file(entry["file"], keys)


class CheckpointManager:
    """The functions above bound to one run's settings (``CheckpointConfig``) and ranks (``dist``)."""

    def __init__(self, root: str | Path, keep_last: int = 3, mirror_dir: str | Path | None = None, dist: Any = None):
        self.root, self.keep_last = Path(root), keep_last
        self.mirror_dir = Path(mirror_dir) if mirror_dir is not None else None
        self.dist = dist

    def save(
        self, step: int, *, model_state: dict, optimizer_state: Any = None, extra_state: Any = None, dist: Any = None
    ) -> Path:
        return save_checkpoint(
            self.root, step=step, model_state=model_state, optimizer_state=optimizer_state, extra_state=extra_state,
            keep_last=self.keep_last, mirror_dir=self.mirror_dir, dist=dist or self.dist,
        )  # fmt: skip

    def latest_valid(self, on_skip: Callable[[Path, str], None] | None = None) -> Path | None:
        return latest_valid(self.root, self.mirror_dir, on_skip, dist=self.dist)

    def load(
        self,
        path: str | Path,
        *,
        device: str | torch.device = "cpu",
        parts: tuple[str, ...] = PARTS,
        targets=None,
        verified=False,
    ) -> Checkpoint:
        return load_checkpoint(path, device=device, parts=parts, targets=targets, verified=verified)

    verify = staticmethod(verify)

"""Checkpoint directories on disk: naming, listing, verifying, setting aside, pruning, mirroring.

``verify`` checks a ``step-N`` directory against its ``manifest.json`` (size and SHA-256 of every file)
and checks that every tensor file ``state.json`` needs is listed there and parses as safetensors (only
the header: a pickle or a zip fails without being run). Under torchrun the ranks share the hashing:
``latest_valid(..., dist=dist)`` has each rank hash every N-th file and agree on the verdict, so a
resume reads each file once in all, not once per rank.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from densebatch.atomic import remove_dir, remove_leftovers, staged_dir
from densebatch.train.checkpoint.format import CheckpointError

FORMAT_VERSION = 2  # 2: tensors indexed by shard (state.json "tensors"); 1: one whole-tensor file per part
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
STATE = "state.json"
PARTS = ("model", "optimizer", "extra")
_STEP_RE = re.compile(r"step-(\d+)")


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (corrupt or incomplete) or its mirror copy failed."""


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"  # zero-padded so that names sort like steps up to 999,999


def checkpoint_step(path: str | Path) -> int:
    """The step of a checkpoint directory, from its name ``step-000120``."""
    if not (m := _STEP_RE.fullmatch(Path(path).name)):
        raise CheckpointError(f"{path}: not a checkpoint directory name (expected step-NNNNNN)")
    return int(m.group(1))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def cleanup_temp_dirs(root: str | Path) -> list[Path]:
    """Remove ``.tmp-step-*`` / ``.old-step-*`` left by a crashed save (this process's or a dead one's).
    A temp dir of a live other process is left alone: it may be writing right now."""
    return remove_leftovers(root, r"step-\d+")


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``step-N`` directory under ``root``, newest first; not verified."""
    root = Path(root)
    found = [
        (int(m.group(1)), p)
        for p in (root.iterdir() if root.is_dir() else ())
        if (m := _STEP_RE.fullmatch(p.name)) and p.is_dir()
    ]
    return sorted(found, key=lambda sp: sp[0], reverse=True)


def set_aside(path: Path, why: str) -> Path:
    """Rename a damaged checkpoint to ``step-N.damaged`` (``-2``, ... if taken): no resume reads it, no prune
    counts or deletes it, and what it still holds (often intact weights) stays for the user to recover."""
    aside = path.with_name(f"{path.name}.damaged")
    n = 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.damaged-{n}")
    os.rename(path, aside)
    warnings.warn(f"checkpoint {path}: {why} — kept as {aside.name}, never deleted", CheckpointWarning, stacklevel=3)
    return aside


def prune(root: Path, keep_last: int, step: int) -> None:
    """Keep the newest ``keep_last`` intact checkpoints. A damaged one is never deleted nor counted: one in
    the way of a newer step is set aside (``set_aside``), older ones are left where they are."""
    for s, p in list_checkpoints(root):
        if s > step:  # this run resumed from an earlier step: never let auto-resume jump onto the abandoned one
            ok, why = verify(p, check_hashes=False)
            if not ok:
                set_aside(p, why)
                continue
            warnings.warn(
                f"checkpoint {p}: newer than the step just saved ({step}), from an abandoned run — removed",
                CheckpointWarning,
                stacklevel=3,
            )
            remove_dir(p)
    intact = [p for _, p in list_checkpoints(root) if verify(p, check_hashes=False)[0]]
    for p in intact[keep_last:]:
        remove_dir(p)


def mirror_checkpoint(src: str | Path, mirror_dir: str | Path, keep_last: int = 3) -> Path:
    """Copy a complete checkpoint into ``mirror_dir`` (temp + rename), verified before it is named."""
    src, mirror = Path(src), Path(mirror_dir)
    mirror.mkdir(parents=True, exist_ok=True)
    cleanup_temp_dirs(mirror)
    with staged_dir(mirror / src.name) as tmp:
        names = sorted(json.loads((src / MANIFEST).read_text(encoding="utf-8"))["files"]) + [MANIFEST]
        for name in names:  # manifest last, as in save
            shutil.copyfile(src / name, tmp / name)
        ok, reason = verify(tmp)  # before it gets its name: a bad copy is never a checkpoint
        if not ok or (tmp / MANIFEST).read_bytes() != (src / MANIFEST).read_bytes():
            raise CheckpointError(f"the copy does not verify against the source manifest: {reason}")
    prune(mirror, keep_last, checkpoint_step(src))
    return mirror / src.name


def safetensors_keys(path: Path) -> dict[str, dict] | str:
    """``{key: {"dtype", "shape"}}`` from the header only (no tensor data is read); a reason when ``path``
    is not a safetensors file (a pickle or a zip fails here, without being run)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: {"dtype": str(f.get_slice(k).get_dtype()), "shape": list(f.get_slice(k).get_shape())} for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        return f"not a safetensors file ({e})"


def part_files(entry: dict) -> list[str]:
    """The tensor files a part of ``state.json`` needs: format 1 names one, format 2 lists them by shard."""
    if "tensors" in entry:
        return sorted({s["file"] for t in entry["tensors"].values() for s in t["shards"]})
    return [entry["file"]] if entry.get("file") else []


def verify(path: str | Path, check_hashes: bool = True, share: tuple[int, int] | None = None) -> tuple[bool, str]:
    """``(True, "ok")`` when the manifest parses and every file it lists has its size and SHA-256;
    otherwise ``(False, reason)`` with the reason naming the file. ``check_hashes`` False: the same
    without reading the tensor files through (pruning: a cheap look at every checkpoint per save).
    ``share=(rank, ranks)``: hash only every ``ranks``-th file, from the ``rank``-th (the others check
    the rest: ``latest_valid`` with ``dist``)."""
    path = Path(path)
    if not path.is_dir():
        return False, "not a directory"
    if not (path / MANIFEST).is_file():
        return False, f"{MANIFEST} missing (incomplete write, or not a checkpoint)"
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
        version, files = manifest["format_version"], dict(manifest["files"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return False, f"{MANIFEST} is not a valid manifest"
    if version not in READABLE_VERSIONS:
        return False, f"{MANIFEST}: format_version {version!r} is not supported (expected one of {READABLE_VERSIONS})"
    m = _STEP_RE.fullmatch(path.name)
    if m and manifest.get("step") != int(m.group(1)):
        return False, f"{MANIFEST}: step {manifest.get('step')!r} does not match the directory name"
    if STATE not in files:
        return False, f"{STATE} is not listed in {MANIFEST}"
    rank, ranks = share or (0, 1)
    for i, (name, entry) in enumerate(sorted(files.items())):
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", "..", MANIFEST):
            return False, f"{MANIFEST} lists an invalid file name {name!r}"
        f = path / name
        if not f.is_file():
            return False, f"{name} missing"
        try:
            size, digest = int(entry["size"]), str(entry["sha256"])
        except (KeyError, TypeError, ValueError):
            return False, f"{MANIFEST}: bad entry for {name}"
        if f.stat().st_size != size:
            return False, f"{name} has {f.stat().st_size} bytes, the manifest says {size} (truncated?)"
        if check_hashes and i % ranks == rank and sha256_file(f) != digest:
            return False, f"{name} SHA-256 mismatch"
    try:
        state = json.loads((path / STATE).read_text(encoding="utf-8"))
        needed = [name for p in PARTS for name in part_files(state["parts"][p])]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, AttributeError):
        return False, f"{STATE} is not valid"
    for name in needed:
        if not isinstance(name, str) or name not in files or not name.endswith(".safetensors"):
            return False, f"{STATE} needs {name!r}, which the manifest does not list as a safetensors file"
        if isinstance(problem := safetensors_keys(path / name), str):
            return False, f"{name}: {problem}"
    return True, "ok"


def latest_valid(
    root: str | Path,
    mirror_dir: str | Path | None = None,
    on_skip: Callable[[Path, str], None] | None = None,
    dist: Any = None,
) -> Path | None:
    """Newest checkpoint that verifies, in ``root`` or ``mirror_dir`` (``root`` first at equal steps).
    Each skipped one is reported through ``on_skip(path, reason)`` (default: a CheckpointWarning
    "checkpoint …/step-000120: model.safetensors SHA-256 mismatch — skipped"). Removes leftovers of
    crashed saves. ``None`` when there is none. ``dist`` (a ``Distributed``; every rank calls): the ranks
    share the hashing and agree on the answer; rank 0 alone removes leftovers."""
    rank, ranks = (dist.rank, dist.world_size) if dist is not None else (0, 1)
    dirs = [Path(root)] + ([Path(mirror_dir)] if mirror_dir is not None else [])
    if len(dirs) == 2 and dirs[1].resolve() == dirs[0].resolve():
        dirs = dirs[:1]
    if rank == 0:
        for d in dirs:
            cleanup_temp_dirs(d)
    if ranks > 1:
        dist.barrier()
    candidates = [(step, -i, p) for i, d in enumerate(dirs) for step, p in list_checkpoints(d)]
    for _, _, p in sorted(candidates, key=lambda c: c[:2], reverse=True):
        ok, reason = verify(p, share=(rank, ranks))
        if ranks > 1:
            verdicts = dist.gather_object([ok, reason])
            ok = all(v[0] for v in verdicts)
            reason = next((v[1] for v in verdicts if not v[0]), "ok")
        if ok:
            return p
        if on_skip is not None:
            on_skip(p, reason)
        else:
            warnings.warn(f"checkpoint {p}: {reason} — skipped", CheckpointWarning, stacklevel=2)
    return None

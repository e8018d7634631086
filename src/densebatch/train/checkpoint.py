"""Checkpoints on disk: atomic, checksummed, pickle-free save / verify / find / load of training state.

A checkpoint is a directory ``step-000120/``: ``model.safetensors`` (tied tensors stored once),
``optimizer.safetensors`` (tensors keyed by their path, ``state.3.exp_avg``), ``extra.safetensors``
(only if the extra state holds tensors or arrays), ``state.json`` (everything else: the structure of
the three states, tensors replaced by ``{"__tensor__": key}``, tuples and non-string keys tagged so
they come back as they went in) and, written last, ``manifest.json`` (size and SHA-256 of each file).

Guarantees: a directory named ``step-N`` is complete (staged as ``.tmp-step-N-<pid>-<random>`` by
``densebatch.atomic.staged_dir``, manifest last, every file and the directory fsynced, then renamed); ``verify`` detects any flipped byte or truncation
and names the file; loading reads only JSON and safetensors: it never unpickles, never runs code.
Measured on a 2-core VM, 9.5M parameters + AdamW state (113 MB): save 0.4-0.8 s (with fsync),
verify 0.11-0.17 s (SHA-256), load about the same (it verifies; tensors are mmapped copy-on-write).
Only one process (rank 0) may save into a directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from densebatch.atomic import io_reason, remove_dir, remove_leftovers, staged_dir
from densebatch.errors import UserError
from densebatch.train.checkpoint_format import CheckpointError, decode_tree, dedupe_tensors, encode_tree

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
STATE = "state.json"
PARTS = ("model", "optimizer", "extra")
_STEP_RE = re.compile(r"step-(\d+)")


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (corrupt or incomplete) or its mirror copy failed."""


class Checkpoint(NamedTuple):
    model_state: dict[str, torch.Tensor]
    optimizer_state: Any  # what was saved: the optimizer's state_dict, or None
    extra_state: Any  # what was saved: a JSON-able dict, or None


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"  # zero-padded so that names sort like steps up to 999,999


def checkpoint_step(path: str | Path) -> int:
    """The step of a checkpoint directory, from its name ``step-000120``."""
    if not (m := _STEP_RE.fullmatch(Path(path).name)):
        raise CheckpointError(f"{path}: not a checkpoint directory name (expected step-NNNNNN)")
    return int(m.group(1))


# --------------------------------------------------------------------------- files on disk
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=1), encoding="utf-8")  # inside a staged directory: fsynced on publish


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


def _prune(root: Path, keep_last: int, step: int) -> None:
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


# ------------------------------------------------------------------------------ public API
def save_checkpoint(
    root: str | Path,
    step: int,
    model_state: dict[str, torch.Tensor],
    optimizer_state: Any = None,
    extra_state: Any = None,
    *,
    keep_last: int = 3,
    mirror_dir: str | Path | None = None,
) -> Path:
    """Write ``root/step-NNNNNN`` atomically and return its path; then keep the newest ``keep_last``
    and, when ``mirror_dir`` is set, place a verified copy there (a failed mirror only warns).

    A write that fails (no space left, not writable) leaves nothing under ``step-NNNNNN`` (the staged
    directory is removed) and raises ``CheckpointError`` in one line: the path, what went wrong, and the
    newest complete checkpoint, which stays the one a resume continues from."""
    if keep_last < 1 or step < 0:
        raise CheckpointError(f"expected keep_last >= 1 and step >= 0; got keep_last={keep_last}, step={step}")
    root = Path(root)
    final = root / step_dir_name(step)
    try:
        root.mkdir(parents=True, exist_ok=True)
        cleanup_temp_dirs(root)
        if final.exists() and not (check := verify(final, check_hashes=False))[0]:
            set_aside(final, check[1])  # a damaged checkpoint of the same step is kept, not replaced
        _write_checkpoint(final, step, (model_state, optimizer_state, extra_state))
    except (OSError, SafetensorError) as e:  # safetensors reports its I/O errors (ENOSPC too) as SafetensorError
        try:
            newest = latest_valid(root, mirror_dir, on_skip=lambda path, why: None)
        except OSError:
            newest = None
        kept = f"the newest complete checkpoint is {newest}" if newest is not None else "there is no earlier checkpoint"
        raise CheckpointError(
            f"checkpoint {final}: cannot be written: {io_reason(e)}{_which(e)}; nothing half-written is left, "
            f"{kept}: free some space (or fix the directory), then resume"
        ) from e
    _prune(root, keep_last, step)
    if mirror_dir is not None and Path(mirror_dir).resolve() != root.resolve():
        try:
            mirror_checkpoint(final, mirror_dir, keep_last=keep_last)
        except (OSError, UserError) as e:  # UserError: CheckpointError, or staged_dir's "cannot be written"
            # A second storage location is a safety net: losing it must not kill a long run.
            warnings.warn(f"checkpoint {final.name}: mirror copy to {mirror_dir} failed: {e}", CheckpointWarning, stacklevel=2)
    return final


def _write_checkpoint(final: Path, step: int, states: tuple) -> None:
    """The files of a checkpoint, staged beside ``final`` and published under its name (manifest last)."""
    with staged_dir(final) as tmp:
        parts = {}
        for part, obj in zip(PARTS, states):
            tree = encode_tree(obj, [], tensors := {})
            unique, aliases = dedupe_tensors(tensors)
            if file := f"{part}.safetensors" if unique else None:
                save_file(unique, str(tmp / file), metadata={"format": "pt"})
            parts[part] = {"file": file, "aliases": aliases, "tree": tree}
        # Module versions that load_state_dict hands to _load_from_state_dict (e.g. BatchNorm's).
        parts["model"]["metadata"] = encode_tree(getattr(states[0], "_metadata", None), ["_metadata"], {})
        _write_json(tmp / STATE, {"format_version": FORMAT_VERSION, "step": step, "parts": parts})
        files = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)} for p in sorted(tmp.iterdir())}
        _write_json(tmp / MANIFEST, {"format_version": FORMAT_VERSION, "step": step, "files": files})


def _which(e: BaseException) -> str:
    """`` (writing model.safetensors)`` when the error names the file."""
    name = getattr(e, "filename", None)
    return f" (writing {Path(name).name})" if name else ""


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
    _prune(mirror, keep_last, checkpoint_step(src))
    return mirror / src.name


def _check_safetensors_header(path: Path) -> str | None:
    """Parse only the header (no tensor data is read): a pickle or zip fails here."""
    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except (SafetensorError, OSError, ValueError) as e:
        return f"not a safetensors file ({e})"
    return None


def verify(path: str | Path, check_hashes: bool = True) -> tuple[bool, str]:
    """``(True, "ok")`` when the manifest parses and every file it lists has its size and SHA-256;
    otherwise ``(False, reason)`` with the reason naming the file. ``check_hashes`` False: the same
    without reading the tensor files through (pruning: a cheap look at every checkpoint per save)."""
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
    if version != FORMAT_VERSION:
        return False, f"{MANIFEST}: format_version {version!r} is not supported (expected {FORMAT_VERSION})"
    m = _STEP_RE.fullmatch(path.name)
    if m and manifest.get("step") != int(m.group(1)):
        return False, f"{MANIFEST}: step {manifest.get('step')!r} does not match the directory name"
    if STATE not in files:
        return False, f"{STATE} is not listed in {MANIFEST}"
    for name, entry in files.items():
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
        if check_hashes and _sha256(f) != digest:
            return False, f"{name} SHA-256 mismatch"
    try:
        state = json.loads((path / STATE).read_text(encoding="utf-8"))
        needed = [state["parts"][p]["file"] for p in PARTS]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return False, f"{STATE} is not valid"
    for name in filter(None, needed):
        if not isinstance(name, str) or name not in files or not name.endswith(".safetensors"):
            return False, f"{STATE} needs {name!r}, which the manifest does not list as a safetensors file"
        if problem := _check_safetensors_header(path / name):
            return False, f"{name}: {problem}"
    return True, "ok"


def latest_valid(
    root: str | Path, mirror_dir: str | Path | None = None, on_skip: Callable[[Path, str], None] | None = None
) -> Path | None:
    """Newest checkpoint that verifies, in ``root`` or ``mirror_dir`` (``root`` first at equal steps).
    Each skipped one is reported through ``on_skip(path, reason)`` (default: a CheckpointWarning
    "checkpoint …/step-000120: model.safetensors SHA-256 mismatch — skipped"). Removes leftovers of
    crashed saves. ``None`` when there is none."""
    candidates = []
    dirs = [Path(root)] + ([Path(mirror_dir)] if mirror_dir is not None else [])
    if len(dirs) == 2 and dirs[1].resolve() == dirs[0].resolve():
        dirs = dirs[:1]
    for rank, d in enumerate(dirs):
        cleanup_temp_dirs(d)
        candidates += [(step, -rank, p) for step, p in list_checkpoints(d)]
    for _, _, p in sorted(candidates, key=lambda c: c[:2], reverse=True):
        ok, reason = verify(p)
        if ok:
            return p
        if on_skip is not None:
            on_skip(p, reason)
        else:
            warnings.warn(f"checkpoint {p}: {reason} — skipped", CheckpointWarning, stacklevel=2)
    return None


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu", parts: tuple[str, ...] = PARTS) -> Checkpoint:
    """Verify, then read a checkpoint: ``Checkpoint(model_state, optimizer_state, extra_state)`` with
    exact dtypes and structure (tied tensors come back as one shared tensor). Only ``parts`` are read
    (the others are None): ``parts=("extra",)`` reads a run's configuration and counters without
    its tensors. Raises CheckpointError."""
    path = Path(path)
    ok, reason = verify(path)
    if not ok:
        raise CheckpointError(f"{path}: not a valid checkpoint: {reason}")
    state = json.loads((path / STATE).read_text(encoding="utf-8"))
    out: list = []
    for part in PARTS:
        if part not in parts:
            out.append(None)
            continue
        entry = state["parts"][part]
        try:
            tensors = load_file(str(path / entry["file"]), device=str(device)) if entry["file"] else {}
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{path}: {entry['file']} cannot be read as safetensors: {e}") from None
        try:
            out.append(decode_tree(entry["tree"], tensors, entry["aliases"]))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CheckpointError(f"{path}: {STATE} is malformed ({type(e).__name__}: {e})") from None
    if isinstance(out[0], dict):  # what nn.Module.state_dict() returns, with its version metadata
        out[0] = OrderedDict(out[0])
        if state["parts"]["model"].get("metadata") is not None:
            out[0]._metadata = decode_tree(state["parts"]["model"]["metadata"], {}, {})
    return Checkpoint(*out)


class CheckpointManager:
    """The functions above bound to one run's settings (``CheckpointConfig``)."""

    def __init__(self, root: str | Path, keep_last: int = 3, mirror_dir: str | Path | None = None):
        self.root, self.keep_last = Path(root), keep_last
        self.mirror_dir = Path(mirror_dir) if mirror_dir is not None else None

    def save(self, step: int, model_state: dict, optimizer_state: Any = None, extra_state: Any = None) -> Path:
        return save_checkpoint(
            self.root, step, model_state, optimizer_state, extra_state, keep_last=self.keep_last, mirror_dir=self.mirror_dir
        )

    def latest_valid(self, on_skip: Callable[[Path, str], None] | None = None) -> Path | None:
        return latest_valid(self.root, self.mirror_dir, on_skip)

    def load(self, path: str | Path, device: str | torch.device = "cpu", parts: tuple[str, ...] = PARTS) -> Checkpoint:
        return load_checkpoint(path, device, parts)

    verify = staticmethod(verify)

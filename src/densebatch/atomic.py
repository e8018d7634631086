"""Atomic writes: a file or a whole directory appears complete under its final name, or not at all.

The one way densebatch writes anything a later run trusts (document stores, checkpoints, the
metrics file when a resume truncates it, ``final/``):

- ``write_file(path, data)``: bytes or text to ``.tmp-<name>-<pid>-<random>`` beside ``path``,
  flushed and fsynced, renamed over ``path``, the directory fsynced. A reader sees the old file or
  the new one, never half of one.
- ``staged_dir(final)``: a temporary sibling directory to fill; on success every file in it and the
  directory are fsynced and it is renamed to ``final`` (an existing ``final`` is first renamed aside
  and removed: ``rename(2)`` cannot replace a non-empty directory); on failure it is removed.

Files are created with mode 0644 less the umask (``tempfile`` alone would leave 0600), so what a run
writes is readable like every other file it writes. A directory where ``staged_dir`` cannot create its
temporary directory (not writable, not a directory) is a ``UserError`` naming it and the operation.
``check_writable`` tries a directory before any work; ``remove_leftovers`` removes what a crashed writer
left (its pid is gone). A leaf module: imports nothing of densebatch but ``errors``.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from densebatch.errors import UserError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fsync_dir(path: str | Path) -> None:
    """Make a rename or a file creation inside ``path`` durable (a no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: str | Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine (a temp name or a lock names its writer's pid)."""
    try:
        os.kill(int(pid), 0)
    except OSError as e:  # PermissionError: it exists, owned by someone else
        return not isinstance(e, ProcessLookupError)
    return True


def temp_name(final: str | Path, kind: str = "tmp") -> Path:
    """``.tmp-<name>-<pid>-<random>`` beside ``final``: unique per process and call."""
    final = Path(final)
    return final.with_name(f".{kind}-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def remove_leftovers(root: str | Path, name: str, locked: bool = False) -> list[Path]:
    """Remove the ``temp_name`` directories and files (``.tmp-*`` staged, ``.old-*`` set aside) in ``root``
    whose final name matches the regular expression ``name``, left by this process or by one that is gone
    (a crashed writer); those of a live other process are left alone: it may be writing right now.
    ``locked``: the caller holds the lock every writer of ``name`` takes, so no other process is writing
    one: all are removed (a writer killed a moment ago may still look alive, as a zombie not yet reaped)."""
    pattern = re.compile(rf"\.(?:tmp|old)-(?:{name})-(\d+)(?:-[0-9a-f]+)?")
    root = Path(root)
    try:
        entries = list(root.iterdir()) if root.is_dir() else []
    except OSError:
        return []
    leftovers = [
        p
        for p in entries
        if (m := pattern.fullmatch(p.name)) and (locked or int(m.group(1)) == os.getpid() or not pid_alive(int(m.group(1))))
    ]
    for p in leftovers:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                p.unlink()
    return leftovers


def io_reason(e: BaseException) -> str:
    """What made a write fail, in words ("no space left on device"): an ``OSError``'s, or the OS error that
    a library's own exception names ("... (os error 28)", as safetensors reports I/O errors)."""
    code = e.errno if isinstance(e, OSError) and e.errno else None
    if code is None and (m := re.search(r"\(os error (\d+)\)", str(e))):
        code = int(m.group(1))
    text = os.strerror(code) if code else (str(e).splitlines() or [type(e).__name__])[0]
    return text[:1].lower() + text[1:]


def write_file(path: str | Path, data: bytes | str, mode: int = 0o644) -> None:
    """Replace ``path`` atomically with ``data`` (text is written as UTF-8)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode & ~_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def remove_dir(path: str | Path) -> None:
    """Rename aside first (atomic), then delete: a crash mid-delete leaves a hidden ``.old-*``
    directory, never a half-deleted one under the real name."""
    path = Path(path)
    aside = temp_name(path, "old")
    os.rename(path, aside)
    shutil.rmtree(aside, ignore_errors=True)


def fix_modes(directory: str | Path, mode: int = 0o644) -> None:
    """Give every file under ``directory`` ``mode`` less the umask (libraries that write through
    ``tempfile`` leave 0600), and its directories 0755 less the umask."""
    mask = _umask()
    for root, dirs, files in os.walk(directory):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o755 & ~mask)
        for f in files:
            os.chmod(os.path.join(root, f), mode & ~mask)


def check_writable(directory: str | Path, what: str) -> None:
    """``UserError`` in one line (``what``, the directory, the operation) unless a file can be created in
    ``directory``; tried for real (permission bits say nothing to root, nor of a read-only mount). Leaves
    nothing behind: the probe file goes, and so do the directories made for it."""
    d = Path(directory)
    made = [p for p in (d, *d.parents) if not p.exists()]  # innermost first
    try:
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"{what} {d}: cannot be created (mkdir: {io_reason(e)})") from e
        probe = temp_name(d / "write-check")
        try:
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            os.unlink(probe)
        except OSError as e:
            raise UserError(f"{what} {d}: cannot be written (creating a file in it: {io_reason(e)})") from e
    finally:
        for p in made:
            try:
                p.rmdir()
            except OSError:  # not empty: someone else's now
                break


def make_staging(final: str | Path) -> Path:
    """An empty temporary directory beside ``final`` (``temp_name``), for ``publish`` to name ``final``.
    ``UserError`` (the directory and the operation, one line) when it cannot be created."""
    final = Path(final)
    tmp = temp_name(final)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as e:  # not writable, a file in the way, no space: before anything was written
        raise UserError(f"{final.parent}: cannot be written (creating a directory for {final.name}: {io_reason(e)})") from e
    return tmp


def publish(tmp: Path, final: Path, replace: bool = True) -> None:
    """Name the filled directory ``tmp`` ``final``: every file in it and the directory fsynced first, the
    parent after the rename. An existing ``final`` is renamed aside and removed, or with
    ``replace=False`` kept, ``tmp`` then discarded. On any failure ``tmp`` is removed."""
    try:
        fix_modes(tmp)
        os.chmod(tmp, 0o755 & ~_umask())
        for root, _, files in os.walk(tmp):
            for f in files:
                fsync_file(os.path.join(root, f))
            fsync_dir(root)
        if final.exists():
            if not replace:
                shutil.rmtree(tmp, ignore_errors=True)
                return
            remove_dir(final)
        os.rename(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def staged_dir(final: str | Path, replace: bool = True) -> Iterator[Path]:
    """Yield an empty temporary directory beside ``final``; publish it as ``final`` on success.

    With ``replace=False`` an existing ``final`` (another writer won the race) is kept and the staged
    copy discarded. Every file is fsynced before the rename, the parent directory after it. ``UserError``
    (the directory and the operation, one line) when the temporary directory cannot be created.
    """
    final = Path(final)
    tmp = make_staging(final)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish(tmp, final, replace)

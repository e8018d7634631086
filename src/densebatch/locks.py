"""Exclusive locks that name their holder: one writer at a time for a run directory or a cache entry.

``FileLock(path)`` holds ``fcntl.flock`` on ``path`` (created if missing) and writes its holder into it
(pid, host, start time, command), so whoever finds it taken can say who holds it. The operating system
drops the lock when its holder dies, however it dies: a lock file left by a killed process is simply
free again, and ``previous`` (what the file said when the lock was taken) tells whether a holder that
is gone left it. Released, the file is emptied (no holder named), and removed only on request: a process
that opened it just before is then told, once it holds the lock, that the file is not the one at ``path``
any more, and opens it again.

``flock`` is local to a machine (and advisory): two machines writing one directory on a network file
system are not kept apart by it. A leaf module: imports nothing of densebatch but ``atomic``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from densebatch.atomic import pid_alive


def holder_record() -> dict:
    """What a lock file says about the process that holds it."""
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime()),
        "command": " ".join(sys.argv[:6]),
    }


def describe(info: dict) -> str:
    """``pid 123 on host, started 2025-01-01 12:00:00`` (what a one-line message says of a holder)."""
    return f"pid {info.get('pid')} on {info.get('host')}, started {info.get('started')}"


def holder_gone(info: dict) -> bool:
    """Whether ``info`` names a process on this machine that no longer exists (a killed writer)."""
    return info.get("pid") is not None and info.get("host") == socket.gethostname() and not pid_alive(info["pid"])


class FileLock:
    """An exclusive ``flock`` on ``path`` that names its holder (see the module docstring)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.previous: dict = {}  # what the file named when the lock was taken ({} when nobody)
        self._fd: int | None = None

    def acquire(self, wait: bool = False) -> dict | None:
        """Take the lock: None once held; without ``wait``, the holder's record when another process
        holds it (nothing taken). ``OSError`` when the lock file cannot be created or opened."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                info = _read(fd)
                os.close(fd)
                return info
            except BaseException:  # interrupted while waiting
                os.close(fd)
                raise
            if _same_file(fd, self.path):
                break
            os.close(fd)  # the holder removed the file (release(remove=True)) between our open and our lock: again
        try:
            self.previous = _read(fd)
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(holder_record()) + "\n").encode(), 0)
        except BaseException:
            os.close(fd)  # closing drops the lock
            raise
        self._fd = fd
        return None

    def release(self, remove: bool = False) -> None:
        """Let go (the file emptied: no holder named); ``remove``: delete the file first, while still holding it
        (a process that opened it meanwhile finds, once it has the lock, that it is not the file any more)."""
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)
        if remove:
            with contextlib.suppress(OSError):
                self.path.unlink()
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except OSError:
        return False


def _read(fd: int) -> dict:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return info if isinstance(info, dict) else {}

"""One writer per run directory: an exclusive lock on ``output_dir`` for the whole of a ``train`` command.

The lock is ``output_dir/.densebatch.lock``, held with ``fcntl.flock`` by rank 0 of the job (one holder per
torchrun job; every rank learns the outcome). The file names its holder (pid, host, start time, command),
so a second run is refused at once with one line naming it. The operating system drops the lock when its
holder dies, however it dies: a lock file left by a killed run is taken over, with a message naming the
run that is gone. Readers (``plot``, ``eval``, ``generate``) never take it.

``flock`` is local to a machine (and advisory): two machines writing one directory on a network file
system are not kept apart by it.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from densebatch.atomic import pid_alive
from densebatch.errors import UserError
from densebatch.train.distributed import Distributed

LOCK_FILE = ".densebatch.lock"


def _holder() -> dict:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime()),
        "command": " ".join(sys.argv[:6]),
    }


def _describe(info: dict) -> str:
    return f"pid {info.get('pid')} on {info.get('host')}, started {info.get('started')}"


class RunLock:
    """``with RunLock(output_dir, dist):`` — the job's exclusive hold on ``output_dir`` (see the module docstring)."""

    def __init__(self, output_dir: str | Path, dist: Distributed | None = None):
        self.path = Path(output_dir) / LOCK_FILE
        self.dist = dist or Distributed()
        self._fd: int | None = None
        self._made: list[Path] = []  # the directories this lock created (removed again if the run wrote nothing)

    def __enter__(self) -> RunLock:
        problem = self._acquire() if self.dist.is_main else None
        if self.dist.agree(problem is not None):
            raise UserError(problem or f"{self.path.parent}: rank 0 could not lock the run directory (see its message)")
        return self

    def _acquire(self) -> str | None:
        """Take the lock on rank 0; the one-line reason when it cannot be had."""
        out = self.path.parent
        try:
            self._made = [d for d in (out, *out.parents) if not d.exists()][::-1]  # outermost first
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            return f"output_dir {out}: cannot be created or written ({e.strerror or e})"
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                return f"output_dir {out}: cannot be created or written ({e.strerror or e})"
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                info = _read(fd)
                os.close(fd)
                return (
                    f"output_dir {out} is in use by another run ({_describe(info)}): wait for it to finish, or set --output_dir"
                )
            if _same_file(fd, self.path):
                break
            os.close(fd)  # a run that wrote nothing removed the file between our open and our lock: open it again
        before = _read(fd)
        if before.get("pid") is not None and before.get("host") == socket.gethostname() and not pid_alive(before["pid"]):
            print(f"taking over the lock of {out} from a run that is gone ({_describe(before)})", file=sys.stderr, flush=True)
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(_holder()) + "\n").encode(), 0)
        self._fd = fd
        return None

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)  # no holder named: the directory is free
            self._remove_if_unused()
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def _remove_if_unused(self) -> None:
        """A run refused before it wrote anything leaves no trace: the lock file, and the directories the lock
        created, go (while the lock is still held; a run that opened the file meanwhile sees it replaced)."""
        out = self.path.parent
        try:
            if [p.name for p in out.iterdir()] != [LOCK_FILE]:
                return
            self.path.unlink()
            for d in reversed(self._made):  # innermost first; each only if empty
                d.rmdir()
        except OSError:
            pass


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except OSError:
        return False


def _read(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError, UnicodeDecodeError):
        return {}

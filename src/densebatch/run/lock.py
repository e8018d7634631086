"""One writer per run directory: an exclusive lock on ``output_dir`` for the whole of a ``train`` command.

The lock is ``output_dir/.densebatch.lock``, a ``densebatch.locks.FileLock`` held by rank 0 of the job (one
holder per torchrun job; every rank learns the outcome). The file names its holder (pid, host, start time,
command), so a second run is refused at once with one line naming it. The operating system drops the lock
when its holder dies, however it dies: a lock file left by a killed run is taken over, with a message naming
the run that is gone. Readers (``plot``, ``eval``, ``generate``) never take it. An ``output_dir`` that cannot
be created or written is refused here, before any work, in one line naming it and the operation.

``flock`` is local to a machine (and advisory): two machines writing one directory on a network file
system are not kept apart by it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from densebatch.atomic import io_reason
from densebatch.errors import UserError
from densebatch.locks import FileLock, describe, holder_gone
from densebatch.train.distributed import Distributed

LOCK_FILE = ".densebatch.lock"


class RunLock:
    """``with RunLock(output_dir, dist):`` — the job's exclusive hold on ``output_dir`` (see the module docstring)."""

    def __init__(self, output_dir: str | Path, dist: Distributed | None = None):
        self.path = Path(output_dir) / LOCK_FILE
        self.dist = dist or Distributed()
        self._lock = FileLock(self.path)
        self._made: list[Path] = []  # the directories this lock created (removed again if the run wrote nothing)

    def __enter__(self) -> RunLock:
        problem = self._acquire() if self.dist.is_main else None
        if self.dist.agree(problem is not None):
            raise UserError(problem or f"{self.path.parent}: rank 0 could not lock the run directory (see its message)")
        return self

    def _acquire(self) -> str | None:
        """Take the lock on rank 0; the one-line reason (the path and the operation) when it cannot be had."""
        out = self.path.parent
        try:
            self._made = [d for d in (out, *out.parents) if not d.exists()][::-1]  # outermost first
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            return f"output_dir {out}: cannot be created (mkdir: {io_reason(e)})"
        try:
            holder = self._lock.acquire()
        except OSError as e:
            self._remove_made()
            return f"output_dir {out}: cannot be written (creating {LOCK_FILE}: {io_reason(e)})"
        if holder is not None:
            return f"output_dir {out} is in use by another run ({describe(holder)}): wait for it to finish, or set --output_dir"
        if holder_gone(before := self._lock.previous):
            print(f"taking over the lock of {out} from a run that is gone ({describe(before)})", file=sys.stderr, flush=True)
        return None

    def __exit__(self, *exc) -> None:
        if not self._lock.held:
            return
        # A run refused before it wrote anything leaves no trace: the lock file, and the directories the lock
        # created, go (the file while the lock is still held: see densebatch.locks).
        try:
            unused = [p.name for p in self.path.parent.iterdir()] == [LOCK_FILE]
        except OSError:
            unused = False
        self._lock.release(remove=unused)
        if unused:
            self._remove_made()

    def _remove_made(self) -> None:
        for d in reversed(self._made):  # innermost first; each only if empty
            try:
                d.rmdir()
            except OSError:
                return

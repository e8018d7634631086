"""One writer per cache entry: two processes preparing the same data into one ``data.cache_dir`` at once.

The second waits for the first (one line naming it) and reads the entry the first published; when the
first dies in the middle of writing, the second removes what it left and builds the entry itself. Real
processes (``tests/fault_driver.py``: ``hold_prepare`` keeps the first inside its locked build until the
test says go), compared file for file with an entry prepared alone. Plus the lock file itself
(``densebatch.locks.FileLock``) in process.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import fault_driver as fd
import pytest

from densebatch.locks import FileLock

ENTRY_FILES = [
    f"{split}/{name}"
    for split in ("train", "eval")
    for name in ("index.json", "shard-000000/tokens.npy", "shard-000000/lengths.npy")
]


def _wait_for_holder(cache: Path, pid: int, proc: subprocess.Popen, timeout: float = 120) -> Path:
    """The lock file in ``cache`` once it names ``pid`` (the first process is inside its locked build)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        for p in cache.glob(".*.lock") if cache.is_dir() else ():
            try:
                if json.loads(p.read_text() or "{}").get("pid") == pid:
                    return p
            except (OSError, ValueError):
                pass
        time.sleep(0.02)
    raise TimeoutError(f"no lock in {cache} names pid {pid}")


def _line_with(stream, text: str) -> str:
    """Read ``stream`` until a line holds ``text`` (AssertionError at its end)."""
    seen = []
    for line in stream:
        if text in line:
            return line.strip()
        seen.append(line)
    raise AssertionError(f"no line with {text!r} in {''.join(seen)}")


def _reference_entry(tmp_path: Path) -> Path:
    """The same data prepared alone (in this process) into a cache of its own."""
    cfg = fd.write_config(tmp_path / "ref.yaml", tmp_path / "ref-out", tmp_path / "ref-cache")
    assert fd.run_in_process(["prepare", str(cfg)]) == 0
    (entry,) = [p for p in (tmp_path / "ref-cache").iterdir()]
    return entry


def _race(tmp_path: Path, kill_first: bool) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess, str, int]:
    """Start a first ``prepare`` held inside its locked build, then a second one; let the first go once the
    second says it waits. Returns both results, the second's waiting line and the first's pid."""
    cache, go = tmp_path / "cache", tmp_path / "go"
    cfg = fd.write_config(tmp_path / "run.yaml", tmp_path / "out", cache)
    first = fd.start(["prepare", str(cfg)], faults={"hold_prepare": {"go": str(go), "kill": kill_first}})
    second = None
    try:
        _wait_for_holder(cache, first.pid, first)
        second = fd.start(["prepare", str(cfg)])
        waiting = _line_with(second.stderr, "waiting for")
        go.touch()
        out1, err1 = first.communicate(timeout=120)
        out2, err2 = second.communicate(timeout=120)
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.communicate()
    return (
        subprocess.CompletedProcess(first.args, first.returncode, out1, err1),
        subprocess.CompletedProcess(second.args, second.returncode, out2, err2),
        waiting,
        first.pid,
    )


def _assert_one_complete_entry_like(cache: Path, reference: Path) -> None:
    """``cache`` holds exactly the entry (no lock file, no temporary directory), complete and equal to ``reference``."""
    assert sorted(p.name for p in cache.iterdir()) == [reference.name]
    entry = cache / reference.name
    assert (entry / "COMPLETE").is_file() and (entry / "train" / "COMPLETE").is_file()
    for name in ENTRY_FILES + ["train/meta.json", "eval/meta.json", "eval_records.jsonl"]:
        assert (entry / name).read_bytes() == (reference / name).read_bytes(), name


@pytest.mark.slow
def test_the_second_process_waits_for_the_first_and_reads_its_entry(tmp_path):
    reference = _reference_entry(tmp_path)
    first, second, waiting, pid = _race(tmp_path, kill_first=False)
    assert first.returncode == 0, first.stderr
    assert second.returncode == 0, second.stderr
    entry = tmp_path / "cache" / reference.name
    assert waiting.startswith(f"waiting for {entry} being written by pid {pid} on "), waiting
    assert f"(built: {entry})" in first.stdout
    assert f"(cache hit: {entry})" in second.stdout  # built once
    assert "Traceback" not in first.stderr + second.stderr
    _assert_one_complete_entry_like(tmp_path / "cache", reference)


@pytest.mark.slow
def test_when_the_first_dies_mid_write_the_second_builds_the_entry_itself(tmp_path):
    reference = _reference_entry(tmp_path)
    first, second, waiting, pid = _race(tmp_path, kill_first=True)
    assert first.returncode == -9  # SIGKILL in the middle of writing: a torn store in its temporary directory
    assert second.returncode == 0, second.stderr
    assert f"by pid {pid} on " in waiting
    entry = tmp_path / "cache" / reference.name
    assert f"(built: {entry})" in second.stdout
    _assert_one_complete_entry_like(tmp_path / "cache", reference)  # the dead writer's leftovers are gone


def test_a_lock_file_names_its_holder_and_a_removed_one_is_opened_again(tmp_path):
    path = tmp_path / ".entry.lock"
    a, b = FileLock(path), FileLock(path)
    assert a.acquire() is None and a.held
    assert json.loads(path.read_text())["pid"] == os.getpid()
    assert b.acquire()["pid"] == os.getpid() and not b.held  # busy: the holder's record, nothing taken
    waiter = threading.Thread(target=b.acquire, kwargs={"wait": True})
    waiter.start()
    time.sleep(0.2)  # b has opened the file and waits for its lock
    a.release(remove=True)
    waiter.join(timeout=10)
    # b was granted the lock of the removed file, saw that it is not the file at `path` any more, and took a new one
    assert b.held and path.is_file() and os.path.samestat(os.stat(path), os.fstat(b._fd))
    b.release()
    assert path.read_text() == ""  # released without removal: kept, naming nobody

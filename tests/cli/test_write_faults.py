"""Writing that fails, and a stop that cannot wait: each ends in one line and an exit code, never a traceback,
and never costs what was already saved.

- a disk that fills during a checkpoint (``ENOSPC`` injected into the safetensors or the JSON write of the
  second periodic save): the run stops with exit 2 and one line naming the checkpoint and "no space left
  on device"; the previous checkpoint stays the newest valid one, nothing half-written is left, and
  ``--resume`` continues from it to the uninterrupted run's losses;
- directories that cannot be written (``data.cache_dir``, ``output_dir``, ``export``'s target): one line
  naming the path and the operation, exit 2, before any data is prepared. Real ``chmod 0o500`` when not
  root; as root (who writes anyway) creating anything in the directory is made to fail with ``EACCES``;
- a second SIGINT or SIGTERM while the stop's checkpoint is being written: exit 130 at once with
  "densebatch: interrupted", the half-written checkpoint dropped, ``--resume`` continues from the one before.
"""

from __future__ import annotations

import errno
import os
import signal
import time
import warnings
from pathlib import Path

import fault_driver as fd
import pytest
import torch
from cli_args import TINY
from safetensors import SafetensorError

from densebatch.cli import main
from densebatch.train.checkpoint import manager as checkpoint
from densebatch.train.checkpoint.manager import CheckpointWarning, latest_valid, list_checkpoints, save_checkpoint, verify

ENOSPC = os.strerror(errno.ENOSPC)  # "No space left on device"


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("densebatch: error: "), err
    return lines[0]


# ------------------------------------------------------------------------------ a full disk
@pytest.mark.slow
@pytest.mark.parametrize("where", ["model.safetensors", "state.json"])
def test_a_full_disk_during_a_checkpoint_keeps_the_previous_one_and_stops_in_one_line(where, tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    sections = {"train": {"max_steps": 8}, "checkpoint": {"every_steps": 2, "keep_last": 5}}
    ref = fd.write_config(tmp_path / "ref.yaml", tmp_path / "ref", cache, **sections)
    assert fd.run_in_process(["train", str(ref)]) == 0
    cfg = fd.write_config(tmp_path / "run.yaml", tmp_path / "out", cache, **sections)
    out, ck = tmp_path / "out", tmp_path / "out" / "checkpoints"

    saves, orig_save_file, orig_write_json = {"n": 0}, checkpoint.write_safetensors, checkpoint._write_json

    def save_file(tensors, filename, metadata=None):  # the disk fills during the 2nd save (step 4)
        if Path(filename).name == "model.safetensors":
            saves["n"] += 1
        if saves["n"] == 2 and Path(filename).name == where:
            Path(filename).write_bytes(b"\0" * 64)  # what fitted
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return orig_save_file(tensors, filename, metadata=metadata)

    def write_json(path, obj):
        if saves["n"] == 2 and Path(path).name == where:
            Path(path).write_text("{")
            raise OSError(errno.ENOSPC, ENOSPC, str(path))
        orig_write_json(path, obj)

    monkeypatch.setattr(checkpoint, "write_safetensors", save_file)
    monkeypatch.setattr(checkpoint, "_write_json", write_json)
    capsys.readouterr()
    assert fd.run_in_process(["train", str(cfg)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"checkpoint {ck / 'step-000004'}: cannot be written: no space left on device" in line, line
    assert f"the newest complete checkpoint is {ck / 'step-000002'}" in line, line
    assert latest_valid(ck) == ck / "step-000002"
    assert sorted(p.name for p in ck.iterdir()) == ["step-000002"]  # nothing of step 4, no temporary directory
    assert not (out / "final").exists()

    monkeypatch.undo()  # space freed
    capsys.readouterr()
    assert fd.run_in_process(["train", str(cfg), "--resume"]) == 0
    assert f"resumed from {ck / 'step-000002'} (step 2)" in capsys.readouterr().out
    assert fd.train_losses(out) == fd.train_losses(tmp_path / "ref")
    assert verify(ck / "step-000008") == (True, "ok")


def test_a_mirror_that_cannot_be_written_only_warns(tmp_path, monkeypatch):
    mirror = tmp_path / "mirror"
    _deny_writes_in(mirror, monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = save_checkpoint(tmp_path / "ck", step=1, model_state={"w": torch.ones(3)}, mirror_dir=mirror)
    assert verify(path) == (True, "ok")
    (w,) = [w for w in caught if issubclass(w.category, CheckpointWarning)]
    assert "mirror copy" in str(w.message) and "cannot be written" in str(w.message)


# --------------------------------------------------------------------- directories that cannot be written
def _deny_writes_in(directory: Path, monkeypatch) -> None:
    """Make creating anything directly in ``directory`` fail with EACCES, as ``chmod 0o500`` does: for real
    when not root; as root (whom permission bits do not stop) by patching ``os.open`` and ``os.mkdir``."""
    directory.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        directory.chmod(0o500)  # given back by _writable_again
        return
    target = directory.resolve()
    orig_open, orig_mkdir = os.open, os.mkdir

    def denied(path) -> bool:
        return Path(os.path.abspath(path)).parent == target

    def deny(path):
        return PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    def open_(path, flags, *args, **kwargs):
        if flags & os.O_CREAT and denied(path):
            raise deny(path)
        return orig_open(path, flags, *args, **kwargs)

    def mkdir(path, *args, **kwargs):
        if denied(path):
            raise deny(path)
        return orig_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "mkdir", mkdir)


@pytest.fixture(autouse=True)
def _writable_again(tmp_path):
    """Give back write permission (when the test took it for real), so pytest can remove tmp_path."""
    yield
    if os.geteuid() != 0:
        for d in tmp_path.rglob("*"):
            if d.is_dir() and not d.is_symlink():
                d.chmod(0o755)


def _args(tmp_path: Path) -> list[str]:
    return [*TINY, f"--output_dir={tmp_path / 'out'}", f"--data.cache_dir={tmp_path / 'cache'}"]


@pytest.mark.parametrize("command", ["train", "prepare"])
def test_a_cache_dir_that_cannot_be_written_is_one_line_before_any_work(command, tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    _deny_writes_in(cache, monkeypatch)
    assert main([command, *_args(tmp_path)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"data.cache_dir {cache}: cannot be written (creating ." in line and "permission denied" in line, line
    assert not any(cache.iterdir())
    assert not (tmp_path / "out").exists()  # the refused run left no output_dir


def test_a_complete_entry_in_a_cache_that_cannot_be_written_is_still_read(tmp_path, monkeypatch, capsys):
    assert main(["prepare", *_args(tmp_path)]) == 0
    _deny_writes_in(tmp_path / "cache", monkeypatch)
    capsys.readouterr()
    assert main(["prepare", *_args(tmp_path)]) == 0  # reading takes no lock
    assert "(cache hit: " in capsys.readouterr().out


@pytest.mark.parametrize("command", ["train", "find-lr"])
def test_an_output_dir_that_cannot_be_written_is_one_line_before_any_work(command, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    _deny_writes_in(out, monkeypatch)
    assert main([command, *_args(tmp_path)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"output_dir {out}: cannot be written (creating " in line and "permission denied" in line, line
    assert not (tmp_path / "cache").exists()  # refused before the data was prepared
    assert not any(out.iterdir())


def test_export_into_a_directory_that_cannot_be_written_is_one_line(tmp_path, monkeypatch, capsys):
    assert main(["train", *_args(tmp_path), "--train.max_steps=2"]) == 0
    target = tmp_path / "exports"
    _deny_writes_in(target, monkeypatch)
    capsys.readouterr()
    assert main(["export", str(tmp_path / "out"), str(target / "hf")]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"{target}: cannot be written (creating a directory for hf: permission denied)" in line, line
    assert not any(target.iterdir())


# ------------------------------------------------------------------------------ a second signal
def _wait(condition, proc, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended before {what}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.01)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_second_signal_during_the_stop_exits_130_at_once_and_loses_nothing_saved(sig, tmp_path, capsys):
    out, ck, marker = tmp_path / "out", tmp_path / "out" / "checkpoints", tmp_path / "in-save"
    cfg = fd.write_config(
        tmp_path / "run.yaml",
        out,
        tmp_path / "cache",
        train={"max_steps": 100_000},
        checkpoint={"every_steps": 2, "keep_last": 5},
    )
    # The stop's checkpoint takes 60 s more once its model.safetensors is written: the second signal lands there.
    p = fd.start(["train", str(cfg)], faults={"slow_stop_save": {"marker": str(marker), "seconds": 60}})
    try:
        _wait(lambda: fd.last_step(out) >= 5, p, 120, "step 5")
        p.send_signal(sig)
        _wait(marker.exists, p, 60, "the stop's checkpoint")
        t0 = time.monotonic()
        p.send_signal(sig)
        stdout, stderr = p.communicate(timeout=30)
        elapsed = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 130, stderr
    assert elapsed < 10  # at once, not after the slow save
    assert f"{sig.name}: finishing the current step, then saving a checkpoint" in stderr
    assert stderr.strip().splitlines()[-1] == "densebatch: interrupted" and "Traceback" not in stderr, stderr
    assert "stopped by signal" not in stdout
    assert not [q for q in ck.iterdir() if q.name.startswith(".")]  # the dropped checkpoint left nothing
    newest = latest_valid(ck)
    assert newest is not None and all(verify(q) == (True, "ok") for _, q in list_checkpoints(ck))
    step = int(newest.name.split("-")[1])
    assert 4 <= step <= fd.last_step(out)

    capsys.readouterr()
    assert fd.run_in_process(["train", str(cfg), "--resume", f"--train.max_steps={step + 2}"]) == 0
    assert f"resumed from {newest} (step {step})" in capsys.readouterr().out


def test_a_full_disk_while_documents_are_cached_is_one_line_and_leaves_no_entry(tmp_path, monkeypatch, capsys):
    from densebatch.data.prepare import assemble

    def full(directory, *args, **kwargs):
        Path(directory).mkdir(exist_ok=True)
        (Path(directory) / "tokens.npy").write_bytes(b"\0" * 64)
        raise OSError(errno.ENOSPC, ENOSPC, str(Path(directory) / "tokens.npy"))

    monkeypatch.setattr(assemble, "StoreWriter", full)  # every prepare streams its documents into StoreWriters
    assert main(["prepare", *_args(tmp_path)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"data.cache_dir {tmp_path / 'cache'}: cannot be written" in line and "no space left on device" in line, line
    assert not any((tmp_path / "cache").iterdir())  # no entry, no temporary directory, no lock file


def test_a_cache_dir_under_a_file_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "blocker"
    blocker.write_text("a user's file")
    assert main(["prepare", *_args(tmp_path), f"--data.cache_dir={blocker / 'cache'}"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"data.cache_dir {blocker / 'cache'}: cannot be created (mkdir: not a directory)" in line, line
    assert blocker.read_text() == "a user's file"

"""Nothing a user made is destroyed without ``--overwrite``: ``--resume`` into a run whose checkpoints are all
damaged refuses and changes nothing; a damaged checkpoint is never deleted (pruning keeps the newest intact
ones and leaves or sets aside the damaged ones); one writer per run directory (a second run is refused
while the first finishes; a lock left by a killed run is taken over)."""

from __future__ import annotations

import json
import shutil
import socket
import time
import warnings
from pathlib import Path

import fault_driver as fd
import pytest
import torch
from cli_args import TINY

from densebatch.cli import main
from densebatch.run.lock import LOCK_FILE, RunLock
from densebatch.train.checkpoint.manager import CheckpointWarning, latest_valid, list_checkpoints, save_checkpoint


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_resume_with_only_damaged_checkpoints_refuses_and_changes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    args = [*TINY, f"--output_dir={out}", f"--data.cache_dir={tmp_path / 'cache'}"]
    assert main(["train", *args, "--train.max_steps=4"]) == 0
    (only,) = [p for _, p in list_checkpoints(out / "checkpoints")]
    (only / "state.json").unlink()
    before = _snapshot(out)
    capsys.readouterr()
    assert main(["train", *args, "--resume", "--train.max_steps=8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "no checkpoint that verifies" in err[-1] and only.name in err[-1] and "--overwrite" in err[-1]
    assert _snapshot(out) == before  # final/, metrics.jsonl and the damaged checkpoint, byte for byte


def _state(step: int) -> dict:
    return {"w": torch.full((4,), float(step))}


def test_pruning_keeps_intact_checkpoints_and_never_deletes_a_damaged_one(tmp_path):
    root = tmp_path / "ck"
    for step in (1, 2):
        save_checkpoint(root, step=step, model_state=_state(step), keep_last=2)
    (root / "step-000001" / "model.safetensors").unlink()  # damaged: an intact weight file may be elsewhere
    for step in (3, 4):
        save_checkpoint(root, step=step, model_state=_state(step), keep_last=2)
    names = sorted(p.name for _, p in list_checkpoints(root))
    assert names == ["step-000001", "step-000003", "step-000004"]  # 2 intact kept; the damaged one left alone


def test_a_damaged_checkpoint_in_the_way_of_a_save_is_set_aside_not_replaced(tmp_path):
    root = tmp_path / "ck"
    for step in (2, 4):
        save_checkpoint(root, step=step, model_state=_state(step), keep_last=3)
    (root / "step-000004" / "state.json").write_text("{")  # the newest is damaged
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert latest_valid(root, on_skip=lambda p, why: None).name == "step-000002"
        save_checkpoint(root, step=3, model_state=_state(3), keep_last=3)  # a resumed run saves an earlier step
        save_checkpoint(root, step=4, model_state=_state(4), keep_last=3)
    assert (root / "step-000004.damaged" / "model.safetensors").is_file()
    assert any("never deleted" in str(w.message) for w in caught if issubclass(w.category, CheckpointWarning))
    assert latest_valid(root).name == "step-000004"


@pytest.mark.slow
def test_a_second_run_into_the_same_directory_is_refused_while_the_first_finishes(tmp_path, capsys):
    out, cache = tmp_path / "run", tmp_path / "cache"
    config = fd.write_config(tmp_path / "run.yaml", out, cache, train={"max_steps": 12})
    assert main(["prepare", str(config)]) == 0  # both runs read the same cache: the race is on the run directory
    first = fd.start(["train", str(config)])
    try:
        deadline = time.monotonic() + 60
        while not (out / ".densebatch.lock").is_file() or not (out / ".densebatch.lock").read_text():
            assert first.poll() is None and time.monotonic() < deadline, "the first run did not take its lock"
            time.sleep(0.05)
        capsys.readouterr()
        t0 = time.monotonic()
        assert main(["train", str(config)]) == 2
        assert time.monotonic() - t0 < 10
        err = capsys.readouterr().err.strip()
        assert "in use by another run" in err and f"pid {first.pid}" in err and len(err.splitlines()) == 1
    finally:
        stdout, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines() if '"train"' in line]
    assert steps == list(range(1, 13))  # every line parses, every step once
    assert (out / ".densebatch.lock").read_text() == ""  # released: no holder named


def test_a_lock_left_by_a_killed_run_is_taken_over(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK_FILE).write_text(json.dumps({"pid": 2**22 + 12345, "host": socket.gethostname(), "started": "x"}))
    with RunLock(out):
        assert "taking over the lock" in capsys.readouterr().err
        with pytest.raises(Exception, match="in use by another run"):
            with RunLock(out):
                pass
    with RunLock(out):  # released: free again, and no take-over message
        assert "taking over" not in capsys.readouterr().err


def test_a_run_that_wrote_nothing_leaves_no_directory_behind(tmp_path):
    out = tmp_path / "a" / "run"
    with RunLock(out):
        assert (out / LOCK_FILE).is_file()
    assert not (tmp_path / "a").exists()  # refused before it wrote: the directories the lock made are gone
    with RunLock(out):
        (out / "metrics.jsonl").write_text("{}\n")
    assert (out / "metrics.jsonl").is_file()  # a run that wrote keeps its directory (the lock file stays, empty)
    (tmp_path / "mine").mkdir()
    with RunLock(tmp_path / "mine"):
        pass
    assert (tmp_path / "mine").is_dir()  # a directory the user made is never removed


def test_a_checkpoint_mirror_is_one_runs_and_is_never_pruned_by_another(tmp_path, capsys):
    """checkpoint.mirror_dir is marked as its run's: a second run pointed at it is refused (before, it pruned the
    first run's checkpoints there, and with checkpoint.resume: auto resumed from them), so is a directory of files
    that is no mirror; the run itself, fresh after its directory is gone, counts its mirrored checkpoints as a
    run, and --overwrite deletes them with the rest."""
    mirror, cache = tmp_path / "mirror", f"--data.cache_dir={tmp_path / 'cache'}"
    run = lambda out, *more: main(["train", *TINY, cache, f"--output_dir={out}", f"--checkpoint.mirror_dir={mirror}", *more])  # noqa: E731
    assert run(tmp_path / "a", "--train.max_steps=3", "--checkpoint.every_steps=1", "--checkpoint.keep_last=2") == 0
    assert [s for s, _ in list_checkpoints(mirror)] == [3, 2]
    (mirror / "densebatch-mirror.json").unlink()  # as a mirror written before mirrors were marked
    assert run(tmp_path / "b", "--train.max_steps=2") == 2  # still not another run's
    assert run(tmp_path / "a", "--resume", "--train.max_steps=4", "--checkpoint.every_steps=1", "--checkpoint.keep_last=2") == 0
    assert (mirror / "densebatch-mirror.json").is_file()  # its own run took it over, and marked it
    shutil.rmtree(mirror / "step-000004")  # the mirror's newest is step 3 again: the resume's later steps out of the way
    mirrored = _snapshot(mirror)
    for more in ([], ["--checkpoint.resume=auto"], ["--overwrite"]):
        capsys.readouterr()
        assert run(tmp_path / "b", "--train.max_steps=2", *more) == 2
        err = capsys.readouterr().err.strip()
        assert "the checkpoint mirror of another run" in err and str(tmp_path / "a") in err and len(err.splitlines()) == 1
        assert _snapshot(mirror) == mirrored and not (tmp_path / "b" / "metrics.jsonl").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    assert main(["train", *TINY, cache, f"--output_dir={tmp_path / 'c'}", f"--checkpoint.mirror_dir={tmp_path / 'mine'}"]) == 2
    assert (
        "is no run's checkpoint mirror" in capsys.readouterr().err and (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    )
    for p in (tmp_path / "a").iterdir():  # the run's own directory lost; its mirror stays: still a run
        p.unlink() if p.is_file() else shutil.rmtree(p)
    assert run(tmp_path / "a", "--train.max_steps=2") == 2
    assert "checkpoint.mirror_dir" in capsys.readouterr().err and _snapshot(mirror) == mirrored
    assert run(tmp_path / "a", "--train.max_steps=2", "--checkpoint.every_steps=1", "--overwrite") == 0
    assert [s for s, _ in list_checkpoints(mirror)] == [2, 1]  # the deleted run's step 3 is gone with it


def test_files_a_run_would_write_over_are_refused_where_no_run_is(tmp_path, capsys):
    """A config.yaml of the user's (output_dir: . beside it), plots or tracker files in an output_dir holding no
    run: refused, untouched; --overwrite replaces them. An empty output_dir (the current directory) is refused."""
    out, cache = tmp_path / "proj", f"--data.cache_dir={tmp_path / 'cache'}"
    out.mkdir()
    (out / "config.yaml").write_text("# my notes\ntrain: {max_steps: 2}\n")
    (out / "plots").mkdir()
    (out / "plots" / "loss.png").write_bytes(b"mine")
    before = _snapshot(out)
    assert main(["train", *TINY, cache, f"--output_dir={out}", "--train.max_steps=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds no run, but files a run writes (plots, config.yaml)" in err and "--overwrite" in err
    assert {k: v for k, v in _snapshot(out).items() if k != LOCK_FILE} == before  # the lock file stays, empty
    assert main(["train", *TINY, cache, f"--output_dir={out}", "--train.max_steps=2", "--overwrite"]) == 0
    assert "# my notes" not in (out / "config.yaml").read_text() and not (out / "plots" / "loss.png").exists()
    assert main(["train", *TINY, cache, "--output_dir=", "--train.max_steps=2"]) == 2
    assert "output_dir: empty" in capsys.readouterr().err


def test_overwrite_deletes_the_old_run_only_once_the_new_one_is_set_up(tmp_path, capsys):
    """--overwrite with a typo in the new run's data or model leaves the old run as it was (before, the old run
    was deleted first, and the typo then left neither)."""
    out, cache = tmp_path / "run", f"--data.cache_dir={tmp_path / 'cache'}"
    assert main(["train", *TINY, cache, f"--output_dir={out}", "--train.max_steps=2"]) == 0
    before = _snapshot(out)
    for typo in (f"--data.path={tmp_path / 'missing.jsonl'}", "--model.kind=hf", "--model.block_size=8"):
        assert main(["train", *TINY, cache, f"--output_dir={out}", "--overwrite", typo]) == 2
        assert _snapshot(out) == before, typo
    capsys.readouterr()
    assert main(["train", *TINY, cache, f"--output_dir={out}", "--overwrite", "--train.max_steps=1"]) == 0
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines() if '"train"' in line] == [1]

"""Crash and resume: ``densebatch train`` killed with SIGKILL (between steps, and in the middle of writing a
checkpoint) and resumed with ``--resume`` logs the same per-step losses, bit for bit, as an uninterrupted run.

Every batching strategy is covered. Runs that get killed are real subprocesses started through
``fault_driver.py`` (real SIGKILLs, no production hooks); the packed test also resumes in subprocesses.
Runs that nothing kills (the uninterrupted references, the other resumes, the negative controls) call
the same CLI in this process: identical losses (one intra-op thread everywhere) without paying ~3 s of
interpreter and torch start-up each. Kill moments come from a seeded RNG
(``DENSEBATCH_FAULT_SEED`` changes them all): the run is killed once ``metrics.jsonl`` shows step k,
after a random extra delay, so the kill lands anywhere in a later step (forward, backward, update,
metrics write or a checkpoint). Negative controls resume the same crashed run with the batch order off
by one, or without the RNG restore, and show that the comparison catches it.
"""

from __future__ import annotations

import re
import shutil
import signal

import fault_driver as fd
import pytest
import torch

import densebatch.train.session as session
from densebatch.data.load.loader import StepLoader
from densebatch.train.checkpoint.manager import list_checkpoints, load_checkpoint, verify

STEPS = 16


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("data-cache")  # prepared documents shared by the runs of this module


def _setup(tmp_path, cache_dir, name, **sections):
    cfg = fd.write_config(tmp_path / f"{name}.yaml", tmp_path / name, cache_dir, **sections)
    return ["train", str(cfg)], tmp_path / name


def _reference(tmp_path, cache_dir, **sections):
    """The uninterrupted run, in this process (no interpreter start-up; same thread count and kernels)."""
    args, out = _setup(tmp_path, cache_dir, "reference", **sections)
    assert fd.run_in_process(args) == 0
    losses = fd.train_losses(out)
    assert [s for s, _ in losses] == list(range(1, STEPS + 1))
    return losses


def _killed(r):
    assert r.returncode == -signal.SIGKILL, f"expected death by SIGKILL, got {r.returncode}\n{r.stderr[-2000:]}"


def _resume(args, out, faults=None):
    """Resume to the end; returns (train losses of the whole run, the step resumed from)."""
    r = fd.run(args + ["--resume"], faults)
    assert r.returncode == 0, r.stderr
    m = re.search(r"resumed from \S+ \(step (\d+)\)", r.stdout)
    assert m, r.stdout + r.stderr
    return fd.train_losses(out), int(m.group(1))


def _resume_in_process(args, out, capsys):
    capsys.readouterr()
    assert fd.run_in_process(args + ["--resume"]) == 0
    m = re.search(r"resumed from \S+ \(step (\d+)\)", capsys.readouterr().out)
    assert m
    return fd.train_losses(out), int(m.group(1))


def _assert_clean(out):
    """Nothing but complete, verifying checkpoints is left behind."""
    root = out / "checkpoints"
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")], "temporary checkpoint dirs left behind"
    for _, p in list_checkpoints(root):
        assert verify(p) == (True, "ok"), p


CASES = {
    # strategy: extra config sections (each case also exercises a different part of the step machinery)
    "packed": {"batching": {"max_tokens_per_batch": 2048}},  # ~11 batches an epoch: the run crosses into epoch 1
    "random": {
        "model": {"dropout": 0.1},
        "batching": {"rows_per_batch": 4},
    },  # dropout draws from torch's RNG: the RNG restore matters
    "length_grouped": {"batching": {"strategy": "length_grouped", "mega_batch_mult": 4, "rows_per_batch": 4}},
    "token_budget": {"train": {"grad_accum_batches": 2}},  # two batches per step; crosses into epoch 1 at step ~11
}


def _sections(strategy):
    sections = {k: dict(v) for k, v in CASES[strategy].items()}
    sections["batching"] = {"strategy": strategy, **sections.get("batching", {})}
    sections["train"] = {"max_steps": STEPS, **sections.get("train", {})}
    return sections


def test_packed_killed_three_times_resumes_bit_for_bit(tmp_path, cache_dir):
    """The issue's check: three kills (the first one mid-checkpoint, two at random moments), resumed each
    time, end with the same metrics.jsonl losses, step by step, as the uninterrupted run."""
    sections = _sections("packed")
    reference = _reference(tmp_path, cache_dir, **sections)
    args, out = _setup(tmp_path, cache_dir, "crashed", **sections)
    rng = fd.seeded_rng("packed")

    # 1. killed while writing its 3rd checkpoint (step 6): optimizer.safetensors torn in the temp dir
    _killed(fd.run(args, {"kill_in_save": {"save": 3, "file": "optimizer"}}))
    assert [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith(".tmp-step-000006")]
    assert fd.last_step(out) == 6
    # 2. and 3. resumed, then killed at random moments after steps k2 < k3
    k2, k3 = sorted(rng.sample(range(7, STEPS - 1), 2))
    for k in (k2, k3):
        _killed(fd.signal_at_step(args + ["--resume"], out, k, delay_s=rng.uniform(0, 0.03)))
        assert fd.last_step(out) < STEPS
    losses, _ = _resume(args, out)

    assert losses == reference  # exact float equality, every step, no step missing or repeated
    _assert_clean(out)


@pytest.mark.parametrize("strategy", ["random", "length_grouped", "token_budget"])
def test_killed_once_resumes_bit_for_bit(tmp_path, cache_dir, strategy, monkeypatch, capsys):
    sections = _sections(strategy)
    reference = _reference(tmp_path, cache_dir, **sections)
    args, out = _setup(tmp_path, cache_dir, "crashed", **sections)
    rng = fd.seeded_rng(strategy)
    if strategy == "length_grouped":  # killed with a torn manifest in the temp dir of its 4th save (step 8)
        _killed(fd.run(args, {"kill_in_save": {"save": 4, "file": "manifest"}}))
        assert fd.last_step(out) == 8
    else:
        k = rng.randrange(3, STEPS - 2)
        _killed(fd.signal_at_step(args, out, k, delay_s=rng.uniform(0, 0.03)))
        assert fd.last_step(out) < STEPS
    crashed = tmp_path / "crashed-copy"
    shutil.copytree(out, crashed)

    # Resumed in this process (a fresh Session; the kill above needed the subprocess, a resume does not,
    # and the packed test resumes in subprocesses); the negative controls resume copies of the same crash.
    assert _resume_in_process(args, out, capsys)[0] == reference
    _assert_clean(out)

    if strategy == "random":  # dropout masks: without the RNG restore the resumed steps differ
        monkeypatch.setattr(session, "restore_rng_state", lambda state: None)
    elif strategy == "length_grouped":  # one row off after the restore
        load = StepLoader.load_state_dict
        monkeypatch.setattr(StepLoader, "load_state_dict", lambda self, st: load(self, dict(st, row=st["row"] + 1)))
    else:
        return
    shutil.rmtree(out)
    shutil.copytree(crashed, out)
    wrong, resumed_from = _resume_in_process(args, out, capsys)
    assert [s for s, _ in wrong] == [s for s, _ in reference]
    differing = [s for (s, a), (_, b) in zip(wrong, reference) if a != b]
    assert differing, "the negative control resumed identically: the comparison would not catch the fault"
    assert min(differing) == resumed_from + 1  # the first resumed step already differs; the kept ones do not


def test_killed_during_a_background_write_keeps_the_previous_checkpoint_and_resumes_bit_for_bit(tmp_path, cache_dir, capsys):
    """checkpoint.async: training goes on while a checkpoint is written; the process dies by SIGKILL in the
    middle of the 3rd background write (step 6, optimizer file torn): step 4's checkpoint stays the newest
    valid one, holds the same tensors as a synchronous save of step 4, and the resume is bit for bit."""
    sections = _sections("token_budget")
    sections["checkpoint"] = {"keep_last": STEPS}  # the reference keeps its step-4 checkpoint to compare with
    reference = _reference(tmp_path, cache_dir, **sections)
    sections["checkpoint"] = {"keep_last": STEPS, "async": True}
    args, out = _setup(tmp_path, cache_dir, "crashed", **sections)
    _killed(fd.run(args, {"kill_in_save": {"save": 3, "file": "optimizer"}}))
    root = out / "checkpoints"
    assert [p.name for p in root.iterdir() if p.name.startswith(".tmp-step-000006")]  # the write that died
    assert [s for s, _ in list_checkpoints(root)] == [4, 2]
    saves = [r for r in fd.records(out) if r["kind"] == "checkpoint"]
    assert [r["step"] for r in saves] == [2, 4, 6] and all(r["background"] and r["blocked_s"] >= 0 for r in saves)
    ours, sync = (load_checkpoint(d / "checkpoints" / "step-000004") for d in (out, tmp_path / "reference"))
    for a, b in ((ours.model_state, sync.model_state), (ours.optimizer_state["state"], sync.optimizer_state["state"])):
        assert a.keys() == b.keys() and all(torch.equal(x, y) for x, y in zip(_tensors(a), _tensors(b)))
    assert _resume_in_process(args, out, capsys)[0] == reference
    _assert_clean(out)


def _tensors(tree):
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    return [tree] if isinstance(tree, torch.Tensor) else []

"""Batch-size schedule under crashes: ``densebatch train`` with a ramp and back-offs, killed with SIGKILL mid-ramp and
again after a back-off, resumed with ``--resume``, logs the same losses, sizes and events, bit for bit, as an
uninterrupted run.

The kills are real subprocesses through ``fault_driver.py`` (as in test_resume.py); the uninterrupted reference
runs in this process. A high learning rate and an evaluation every 2 steps on the tiny eval split make the eval
loss stall within the ramp, so the run backs off for real (the test fails if it does not: then it would prove
nothing about back-offs).
"""

from __future__ import annotations

import re
import signal

import fault_driver as fd
import pytest

STEPS = 30
SECTIONS = {
    "batching": {"max_tokens_per_batch": 2048},  # 8 packed rows of 256 per step: a quarter is 2 rows
    "train": {
        "max_steps": STEPS,
        "lr": 0.1,
        "guard": {"spike_zscore": 0},  # no rollbacks here: they have their own tests
        "batch_schedule": {"ramp_steps": 20, "ramp_start": 0.25, "backoff_patience": 1, "backoff_max": 2, "lr_scaling": "sqrt"},
    },
    "eval": {"every_steps": 2},
    "checkpoint": {"every_steps": 5},
}


def _records(out, kind):
    return [r for r in fd.metrics(out) if r.get("kind") == kind]


def _view(out):
    """What must match: every train step's loss, size and learning rate; every size change; every eval loss."""
    train = [
        (r["step"], r["loss"], r["batch_fraction"], r["slot_tokens"], r["real_tokens"], r["lr"]) for r in _records(out, "train")
    ]
    events = [(r["step"], r["fraction"], r["reason"]) for r in _records(out, "batch_size")]
    evals = [(r["step"], r["loss"]) for r in _records(out, "eval")]
    return train, events, evals


@pytest.mark.slow
def test_ramp_and_backoff_resume_bit_for_bit_after_sigkill(tmp_path):
    cache = tmp_path / "cache"
    ref_cfg = fd.write_config(tmp_path / "ref.yaml", tmp_path / "ref", cache, **SECTIONS)
    assert fd.run_in_process(["train", str(ref_cfg)]) == 0
    reference = _view(tmp_path / "ref")
    train, events, _ = reference
    assert [t[0] for t in train] == list(range(1, STEPS + 1))
    # Sizes: the first step is a quarter of the target (2 of 8 rows; a row is at most 256 slots, padded to the
    # batch's longest); every step holds its fraction of 8 rows, rounded to whole rows (or fewer at an epoch's end).
    assert [t[2] for t in train[:2]] == [0.25, 0.2875] and 256 < train[0][3] <= 2048 // 4
    assert all(slots / 256 <= fraction * 8 + 1 for _, _, fraction, slots, _, _ in train)
    backoffs = [s for s, _, reason in events if reason == "backoff"]
    assert events[0] == (0, 0.25, "ramp_start") and backoffs, f"no back-off in the reference run: {events}"
    every = SECTIONS["checkpoint"]["every_steps"]
    saved = -(-backoffs[0] // every) * every  # the first checkpoint that holds the back-off
    assert saved + 1 < STEPS

    args = ["train", str(fd.write_config(tmp_path / "crashed.yaml", tmp_path / "crashed", cache, **SECTIONS))]
    out = tmp_path / "crashed"
    rng = fd.seeded_rng("schedule")
    # killed mid-ramp (resumes from step 10), then once the checkpoint holding the first back-off is written
    for i, k in enumerate((12, saved + 1)):
        r = fd.signal_at_step(args + ["--resume"] * (i > 0), out, k, delay_s=rng.uniform(0, 0.03))
        assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
        assert fd.last_step(out) < STEPS
    r = fd.run(args + ["--resume"])
    assert r.returncode == 0, r.stderr
    m = re.search(r"resumed from \S+ \(step (\d+)\)", r.stdout)
    assert m and int(m.group(1)) >= backoffs[0], r.stdout  # its saved schedule state holds the change
    assert _view(out) == reference  # losses, sizes, learning rates, events and evals: exact, none repeated or missing

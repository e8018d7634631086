"""Faults a long run meets, through the real ``densebatch`` CLI: a corrupt checkpoint, a checkpoint carrying a
pickle payload, a NaN loss, a loss spike, and SIGTERM.

Runs that nothing kills go through ``densebatch.cli.main`` in this process (faults patched in with
``monkeypatch``); the SIGTERM run is a real subprocess. Tiny model and data: see ``fault_driver.TINY``.
"""

from __future__ import annotations

import hashlib
import json
import math
import pickle
import re
import shutil
import signal
import struct

import fault_driver as fd
import pytest
import torch
from safetensors.torch import load_file

from densebatch.cli import main as cli_main
from densebatch.model.gpt import GPT
from densebatch.train.checkpoint.manager import MANIFEST, list_checkpoints, load_checkpoint, verify

BASE_STEPS = 10


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("data-cache")


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, cache_dir):
    """One finished run: 10 steps, checkpoints at steps 2, 4, ..., 10 (all kept). Tests work on copies."""
    d = tmp_path_factory.mktemp("base")
    cfg = fd.write_config(
        d / "run.yaml", d / "out", cache_dir, train={"max_steps": BASE_STEPS}, checkpoint={"every_steps": 2, "keep_last": 5}
    )
    assert fd.run_in_process(["train", str(cfg)]) == 0
    return d / "out"


def _copy_run(base_run, tmp_path, cache_dir):
    out = tmp_path / "out"
    shutil.copytree(base_run, out)
    cfg = fd.write_config(
        tmp_path / "run.yaml", out, cache_dir, train={"max_steps": BASE_STEPS}, checkpoint={"every_steps": 2, "keep_last": 5}
    )
    return str(cfg), out


def _rewrite_manifest(ckpt, name):
    """Make the manifest agree with the file as it is now (the attacker's move: hashes that match)."""
    manifest = json.loads((ckpt / MANIFEST).read_text())
    data = (ckpt / name).read_bytes()
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / MANIFEST).write_text(json.dumps(manifest))


def _resumed_from(text):
    m = re.search(r"resumed from (\S+) \(step (\d+)\)", text)
    assert m, text
    return m.group(1), int(m.group(2))


def test_flipped_byte_is_detected_named_and_skipped(base_run, tmp_path, cache_dir, capsys):
    cfg, out = _copy_run(base_run, tmp_path, cache_dir)
    newest = out / "checkpoints" / "step-000010"
    target = newest / "model.safetensors"
    data = bytearray(target.read_bytes())
    (header_len,) = struct.unpack("<Q", data[:8])
    data[8 + header_len + (len(data) - 8 - header_len) // 2] ^= 0x01  # one bit in the tensor data, header intact
    target.write_bytes(bytes(data))
    # What the issue measured: safetensors itself loads such a file without a word, values changed.
    original = load_file(str(base_run / "checkpoints" / "step-000010" / "model.safetensors"))
    flipped = load_file(str(target))
    assert any(not torch.equal(original[k], flipped[k]) for k in original)

    assert verify(newest) == (False, "model.safetensors SHA-256 mismatch")
    capsys.readouterr()
    assert fd.run_in_process(["train", cfg, "--resume"]) == 0
    cap = capsys.readouterr()
    assert f"warning: checkpoint {newest}: model.safetensors SHA-256 mismatch — skipped" in cap.err
    path, step = _resumed_from(cap.out)
    assert (path, step) == (str(out / "checkpoints" / "step-000008"), 8)
    # Steps 9 and 10 ran again from step 8, exactly as the first time; the corrupt step 10 was replaced.
    assert fd.train_losses(out) == fd.train_losses(base_run)
    assert verify(newest) == (True, "ok")


class _Payload:
    """Unpickling this creates ``path``: proof that code ran."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pickle_payload_in_a_checkpoint_is_never_executed(base_run, tmp_path, cache_dir, capsys):
    cfg, out = _copy_run(base_run, tmp_path, cache_dir)
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Payload(marker))
    # the payload is live: plain unpickling runs it (on a different marker)
    pickle.loads(pickle.dumps(_Payload(tmp_path / "control")))
    assert (tmp_path / "control").exists()

    ckpt = out / "checkpoints" / "step-000010"
    for name in ("model.safetensors", "optimizer.safetensors"):  # both tensor files of the newest checkpoint
        (ckpt / name).write_bytes(payload)
        _rewrite_manifest(ckpt, name)
    ok, reason = verify(ckpt)
    assert not ok and reason.startswith("model.safetensors: not a safetensors file"), reason

    # resume skips it (naming the file) and continues from the one before
    capsys.readouterr()
    assert fd.run_in_process(["train", cfg, "--resume"]) == 0
    cap = capsys.readouterr()
    assert f"checkpoint {ckpt}: model.safetensors: not a safetensors file" in cap.err
    assert _resumed_from(cap.out)[1] == 8
    assert not marker.exists()


def test_pickle_payload_is_refused_by_eval_and_generate(base_run, tmp_path, cache_dir, capsys):
    cfg, out = _copy_run(base_run, tmp_path, cache_dir)
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Payload(marker))
    ckpt = out / "checkpoints" / "step-000010"
    (ckpt / "model.safetensors").write_bytes(payload)
    _rewrite_manifest(ckpt, "model.safetensors")
    capsys.readouterr()
    assert cli_main(["eval", cfg, "--checkpoint", str(ckpt)]) == 2
    assert cli_main(["generate", "--checkpoint", str(ckpt), "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("model.safetensors: not a safetensors file") == 2, err
    # a saved final model (model/ reads it with safetensors) whose weights file is the payload
    final = out / "final"
    (final / "model.safetensors").write_bytes(payload)
    assert cli_main(["eval", cfg, "--checkpoint", str(final), "--json"]) == 2  # a clear error, no traceback
    assert "model.safetensors: cannot be loaded" in capsys.readouterr().err
    assert not marker.exists()


def test_nan_loss_skips_the_step_and_weights_stay_finite(tmp_path, cache_dir, monkeypatch):
    cfg = fd.write_config(tmp_path / "run.yaml", tmp_path / "out", cache_dir, train={"max_steps": 10})
    calls, orig = [0], GPT.token_losses

    def token_losses(self, batch):
        losses = orig(self, batch)
        if self.training:
            calls[0] += 1
            if calls[0] == 5:
                return losses * float("nan")  # the batch of step 5
        return losses

    monkeypatch.setattr(GPT, "token_losses", token_losses)
    assert fd.run_in_process(["train", str(cfg)]) == 0
    records = [r for r in fd.metrics(tmp_path / "out") if r["kind"] == "train"]
    assert [r["step"] for r in records] == list(range(1, 11))
    assert records[4]["outcome"] == "skipped" and records[4]["loss"] is None  # NaN written as null
    assert [r for r in records if r["outcome"] != "applied"] == [records[4]]
    assert records[4]["documents"] and "documents" not in records[3]  # what to inspect, for the skipped step
    assert all(math.isfinite(r["loss"]) for r in records if r["outcome"] == "applied")
    weights = load_file(str(tmp_path / "out" / "final" / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in weights.values())
    # the optimizer never applied step 5: AdamW counted 9 updates in 10 steps
    ck = load_checkpoint(tmp_path / "out" / "checkpoints" / "step-000010")
    assert {float(s["step"]) for s in ck.optimizer_state["state"].values()} == {9.0}
    assert ck.extra_state["parts"]["counters"]["skipped_steps"] == 1


def test_loss_spike_rolls_back_logs_and_lowers_the_lr(tmp_path, cache_dir, monkeypatch, capsys):
    steps, spike = 30, 25  # the guard needs 20 accepted losses before it judges a spike
    cfg = fd.write_config(
        tmp_path / "run.yaml",
        tmp_path / "out",
        cache_dir,
        train={"max_steps": steps, "guard": {"spike_window": 20, "rollback_lr_factor": 0.5}},
        checkpoint={"every_steps": 4, "keep_last": 2},
    )
    calls, orig = [0], GPT.token_losses

    def token_losses(self, batch):
        losses = orig(self, batch)
        if self.training:
            calls[0] += 1
            if calls[0] == spike:
                return losses * 50.0
        return losses

    monkeypatch.setattr(GPT, "token_losses", token_losses)
    capsys.readouterr()
    assert fd.run_in_process(["train", str(cfg)]) == 0
    err = capsys.readouterr().err
    assert f"rollback at step {spike}: back to step 24, learning rate x0.5" in err

    records = fd.metrics(tmp_path / "out")
    events = [r for r in records if r["kind"] == "rollback"]
    assert len(events) == 1
    assert events[0]["step"] == spike and events[0]["to_step"] == 24 and events[0]["lr_scale"] == 0.5
    assert events[0]["loss"] > 10  # the spiked loss, for the post-mortem
    train = [r for r in records if r["kind"] == "train"]
    i = train.index(next(r for r in train if r["outcome"] != "applied"))
    bad, after = train[i], train[i + 1 :]
    assert bad["step"] == spike and bad["outcome"] == "rollback"
    # the rollback skips the steps after the checkpoint (the spike's only, here) and names their documents
    assert events[0]["skipped_steps"] == [spike] and events[0]["skipped_documents"] == bad["documents"] != []
    assert records.index(events[0]) == records.index(bad) + 1  # logged right after the step that caused it
    # training continued from step 24's weights, at half the learning rate, to the end
    assert [r["step"] for r in after] == list(range(24 + 1, steps + 1))
    assert after[0]["lr"] == 0.5 * bad["lr"]  # same schedule position (step 24 → 25), halved
    assert all(r["outcome"] == "applied" for r in after)
    # the batch that caused the spike is not fed again: the data position moved on past it
    assert after[0]["epoch"] > bad["epoch"]
    ck = load_checkpoint(tmp_path / "out" / "checkpoints" / f"step-{steps:06d}")
    assert ck.extra_state["parts"]["counters"]["lr_scale"] == 0.5  # a later resume keeps the lowered lr
    assert ck.extra_state["parts"]["guard"]["rollbacks"] == 1
    weights = load_file(str(tmp_path / "out" / "final" / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in weights.values())


def test_sigterm_saves_a_clean_checkpoint_exits_0_and_resumes_exactly(tmp_path, cache_dir, capsys):
    steps = 24
    sections = {"train": {"max_steps": steps}, "checkpoint": {"every_steps": 0}}  # SIGTERM's is the only checkpoint
    ref_cfg = fd.write_config(tmp_path / "ref.yaml", tmp_path / "ref", cache_dir, **sections)
    assert fd.run_in_process(["train", str(ref_cfg)]) == 0
    saves = lambda run: [rec["step"] for rec in fd.metrics(run) if rec["kind"] == "checkpoint"]  # noqa: E731
    assert saves(tmp_path / "ref") == [steps]  # the run's last checkpoint is in metrics.jsonl too
    cfg = fd.write_config(tmp_path / "run.yaml", tmp_path / "out", cache_dir, **sections)
    out = tmp_path / "out"

    r = fd.signal_at_step(["train", str(cfg)], out, 3, sig=signal.SIGTERM)
    assert r.returncode == 0, r.stderr
    assert "SIGTERM: finishing the current step, then saving a checkpoint" in r.stderr
    assert "stopped by signal; continue with --resume" in r.stdout
    stopped_at = fd.last_step(out)
    assert 3 <= stopped_at < steps
    found = list_checkpoints(out / "checkpoints")
    assert [s for s, _ in found] == [stopped_at]
    assert verify(found[0][1]) == (True, "ok")
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]
    assert not (out / "final").exists()  # interrupted: no final model, no final eval
    assert not [rec for rec in fd.metrics(out) if rec["kind"] == "eval"]
    assert saves(out) == [stopped_at]  # the stop's checkpoint is recorded like any other

    capsys.readouterr()
    assert fd.run_in_process(["train", str(cfg), "--resume"]) == 0
    assert _resumed_from(capsys.readouterr().out)[1] == stopped_at
    assert fd.train_losses(out) == fd.train_losses(tmp_path / "ref")
    assert saves(out) == [stopped_at, steps]
    assert (out / "final" / "model.safetensors").is_file()

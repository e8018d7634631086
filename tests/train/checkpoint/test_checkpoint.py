"""Checkpoints: bit-exact round trip, corruption and crash detection, pruning, mirror, no code execution."""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import random
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from densebatch.errors import UserError
from densebatch.train.checkpoint.manager import (
    CheckpointError,
    CheckpointManager,
    CheckpointWarning,
    cleanup_temp_dirs,
    latest_valid,
    load_checkpoint,
    save_checkpoint,
    verify,
)
from densebatch.train.checkpoint.rng import capture_rng_state

SRC = str(Path(__file__).resolve().parents[3] / "src")


class TinyLM(nn.Module):
    """Embedding tied to the output head, plus buffers of other dtypes."""

    def __init__(self, vocab: int = 40, width: int = 8):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.mid = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("counts", torch.arange(5, dtype=torch.int64))
        self.register_buffer("scale_bf16", torch.linspace(0, 1, 7, dtype=torch.bfloat16))

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.emb(ids))))


def train_steps(model, opt, n: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        ids = torch.randint(0, 40, (4, 6), generator=g)
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.roll(-1, 1).flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()


def make_state(seed: int = 0):
    torch.manual_seed(seed)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    train_steps(model, opt, 3, seed)
    extra = {
        "schedule": {"step": 3, "lr_scale": 0.5},
        "loader": {"epoch": 1, "position": 17, "order": np.arange(6, dtype=np.int64)},
        "counters": {"skipped_steps": 1, "best_eval_loss": float("inf")},
        "rng": capture_rng_state(),
        "shapes": (3, (4, 5)),
        "by_rank": {0: "a", 1: "b"},
        "__tensor__": "a key that looks like a tag",
        "tagged": {"__tuple__": [1, 2]},
    }
    return model, opt, extra


def assert_same(a, b, where="state"):
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}.{i}")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def flip_byte(path: Path, where: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    i = int(len(data) * where)
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


def test_round_trip_is_bit_exact_and_training_continues_identically(tmp_path):
    model, opt, extra = make_state()
    path = save_checkpoint(tmp_path, step=3, model_state=model.state_dict(), optimizer_state=opt.state_dict(), extra_state=extra)
    assert path.name == "step-000003"
    assert verify(path) == (True, "ok")
    assert sorted(p.name for p in path.iterdir()) == [
        "extra.safetensors",
        "manifest.json",
        "model.safetensors",
        "optimizer.safetensors",
        "state.json",
    ]
    # Tied weights are stored once; the optimizer tensors are keyed by their path.
    assert "head.weight" not in load_file(str(path / "model.safetensors"))
    assert {"state.0.exp_avg", "state.0.exp_avg_sq", "state.0.step"} <= set(load_file(str(path / "optimizer.safetensors")))

    ck = load_checkpoint(path)
    assert_same(model.state_dict(), ck.model_state, "model")
    assert_same(opt.state_dict(), ck.optimizer_state, "optimizer")
    assert_same(extra, ck.extra_state, "extra")
    assert ck.model_state["head.weight"] is ck.model_state["emb.weight"]
    assert ck.model_state._metadata == model.state_dict()._metadata

    torch.manual_seed(123)  # a different initialisation, overwritten by the checkpoint
    model2 = TinyLM()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    model2.load_state_dict(ck.model_state)
    opt2.load_state_dict(ck.optimizer_state)
    train_steps(model, opt, 2, seed=9)
    train_steps(model2, opt2, 2, seed=9)
    assert_same(model.state_dict(), model2.state_dict(), "model after 2 more steps")
    assert model2.head.weight is model2.emb.weight


def test_views_sharing_storage_are_stored_apart(tmp_path):
    fused = torch.arange(12.0).reshape(3, 4)
    state = {"q": fused[0], "k": fused[1], "all": fused, "again": fused, "empty": torch.zeros(0)}
    ck = load_checkpoint(save_checkpoint(tmp_path, step=1, model_state=state))
    assert_same(state, dict(ck.model_state))
    assert ck.model_state["again"] is ck.model_state["all"]
    assert ck.optimizer_state is None and ck.extra_state is None


def test_unsupported_value_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match=r"extra\.fn .*function"):
        save_checkpoint(
            tmp_path, step=1, model_state={"w": torch.ones(2)}, optimizer_state=None, extra_state={"extra": {"fn": len}}
        )
    assert list(tmp_path.iterdir()) == []  # nothing half-written is left behind


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.safetensors", "extra.safetensors", "state.json"])
@pytest.mark.parametrize("where", [0.02, 0.5, 0.999])
def test_flipped_byte_is_detected_and_skipped(tmp_path, name, where):
    model, opt, extra = make_state()
    first = save_checkpoint(tmp_path, step=1, model_state=model.state_dict(), optimizer_state=opt.state_dict(), extra_state=extra)
    second = save_checkpoint(
        tmp_path, step=2, model_state=model.state_dict(), optimizer_state=opt.state_dict(), extra_state=extra
    )
    flip_byte(second / name, where)
    ok, reason = verify(second)
    assert not ok and reason == f"{name} SHA-256 mismatch"
    with pytest.warns(CheckpointWarning, match=rf"step-000002: {name} SHA-256 mismatch — skipped"):
        assert latest_valid(tmp_path) == first
    with pytest.raises(CheckpointError, match=name) as err:
        load_checkpoint(second)
    assert isinstance(err.value, UserError)


def test_damaged_manifest_or_truncated_file_is_skipped(tmp_path):
    state = {"w": torch.randn(100)}
    first = save_checkpoint(tmp_path, step=1, model_state=state)
    save_checkpoint(tmp_path, step=2, model_state=state)
    third = save_checkpoint(tmp_path, step=3, model_state=state)
    (tmp_path / "step-000002" / "manifest.json").write_text('{"format_version": 1, "files": ')
    size = (third / "model.safetensors").stat().st_size
    with open(third / "model.safetensors", "r+b") as f:
        f.truncate(100)
    assert verify(third) == (False, f"model.safetensors has 100 bytes, the manifest says {size} (truncated?)")
    reasons = []
    assert latest_valid(tmp_path, on_skip=lambda p, r: reasons.append((p.name, r))) == first
    assert reasons == [("step-000003", verify(third)[1]), ("step-000002", "manifest.json is not a valid manifest")]


def test_incomplete_directories_are_never_returned(tmp_path):
    good = save_checkpoint(tmp_path, step=1, model_state={"w": torch.ones(3)})
    # A writer without our protocol (no manifest), and a temp dir of a dead process.
    (tmp_path / "step-000007").mkdir()
    (tmp_path / "step-000007" / "model.safetensors").write_bytes(b"\0" * 10)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    leftover = tmp_path / f".tmp-step-000009-{dead.pid}"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"partial")
    alive = tmp_path / f".tmp-step-000010-{os.getppid()}"  # a live process may still be writing it
    alive.mkdir()
    with pytest.warns(CheckpointWarning, match="step-000007: manifest.json missing"):
        assert latest_valid(tmp_path) == good
    assert not leftover.exists() and alive.exists()


def run_child(code: str, root: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), str(root)], env=env, stdout=subprocess.PIPE, text=True)


def test_sigkill_in_the_middle_of_a_save_leaves_the_previous_checkpoint(tmp_path):
    # The child dies by SIGKILL right after the optimizer tensors hit the disk, before the manifest.
    child = run_child(
        """
        import os, signal, sys, torch
        import densebatch.train.checkpoint.manager as ck
        root = sys.argv[1]
        state = {"w": torch.full((1 << 20,), 1.0)}
        ck.save_checkpoint(root, step=1, model_state=state, optimizer_state={"m": torch.ones(4)})
        real = ck.write_safetensors
        def dying(tensors, path, metadata=None):
            written = real(tensors, path, metadata=metadata)
            if str(path).endswith("optimizer.safetensors"):
                os.kill(os.getpid(), signal.SIGKILL)
            return written
        ck.write_safetensors = dying
        ck.save_checkpoint(root, step=2, model_state={"w": torch.full((1 << 20,), 2.0)}, optimizer_state={"m": torch.ones(4)})
    """,
        tmp_path,
    )
    child.wait(timeout=120)
    assert child.returncode == -signal.SIGKILL
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-step-000002")]  # it died mid-write
    assert latest_valid(tmp_path) == tmp_path / "step-000001"
    assert load_checkpoint(tmp_path / "step-000001").model_state["w"][0] == 1.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001"]  # leftover cleaned up


def test_sigkill_at_a_random_moment_of_repeated_saves(tmp_path):
    child = run_child(
        """
        import sys, torch
        import densebatch.train.checkpoint.manager as ck
        root = sys.argv[1]
        for step in range(1, 10_000):
            ck.save_checkpoint(root, step=step, model_state={"w": torch.full((1 << 21,), float(step))}, keep_last=2)
            print(step, flush=True)
    """,
        tmp_path,
    )
    for _ in range(3):  # a few completed saves, then kill it at some point of the next one
        child.stdout.readline()
    # 0-100 ms lands mid-write (a .tmp dir), mid-prune (an .old dir) or between: every case must hold.
    time.sleep(random.uniform(0.0, 0.1))
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=60)
    left = sorted(p.name for p in tmp_path.iterdir())
    path = latest_valid(tmp_path)
    assert path is not None, left
    ck = load_checkpoint(path)
    assert torch.equal(ck.model_state["w"], torch.full((1 << 21,), float(int(path.name[5:]))))
    assert all(verify(p)[0] for p in tmp_path.iterdir())  # any temp dir was removed, the rest verify


def test_keep_last_prunes_oldest_and_a_resumed_run_drops_the_abandoned_future(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in (10, 20, 30, 40):
        mgr.save(step, model_state={"w": torch.tensor([float(step)])})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000030", "step-000040"]
    mgr.save(40, model_state={"w": torch.tensor([41.0])})  # same step again: replaced, not merged
    assert mgr.load(tmp_path / "step-000040").model_state["w"].item() == 41.0
    with pytest.warns(CheckpointWarning, match="step-000040: newer than the step just saved"):
        mgr.save(35, model_state={"w": torch.tensor([35.0])})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000030", "step-000035"]


def test_mirror_gets_a_verified_copy_and_is_the_fallback(tmp_path):
    root, mirror = tmp_path / "run", tmp_path / "mirror"
    mgr = CheckpointManager(root, keep_last=2, mirror_dir=mirror)
    model, opt, extra = make_state()
    for step in (1, 2, 3):
        mgr.save(step, model_state=model.state_dict(), optimizer_state=opt.state_dict(), extra_state=extra)
    assert sorted(p.name for p in mirror.iterdir()) == ["step-000002", "step-000003"]
    for name in ("manifest.json", "model.safetensors", "optimizer.safetensors", "state.json"):
        assert (mirror / "step-000003" / name).read_bytes() == (root / "step-000003" / name).read_bytes()
    assert verify(mirror / "step-000003") == (True, "ok")

    flip_byte(root / "step-000003" / "model.safetensors")
    with pytest.warns(CheckpointWarning, match=r"run/step-000003: model.safetensors SHA-256 mismatch — skipped"):
        assert mgr.latest_valid() == mirror / "step-000003"
    assert_same(opt.state_dict(), mgr.load(mirror / "step-000003").optimizer_state)


def test_a_failing_mirror_warns_and_keeps_the_primary(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    with pytest.warns(CheckpointWarning, match="mirror copy to .* failed"):
        path = save_checkpoint(tmp_path / "run", step=1, model_state={"w": torch.ones(2)}, mirror_dir=blocker)
    assert verify(path)[0]


class Payload:
    """Unpickling this writes a marker file: proof that code ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.write_text, (pathlib.Path(self.marker), "code ran"))


def write_manifest(d: Path, step: int) -> None:
    import hashlib

    files = {p.name: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()} for p in d.iterdir()}
    (d / "manifest.json").write_text(json.dumps({"format_version": 1, "step": step, "files": files}))


def test_a_pickle_payload_is_never_executed(tmp_path):
    # Control: the payload is live when unpickled.
    control = tmp_path / "control-marker"
    pickle.loads(pickle.dumps(Payload(control)))
    assert control.read_text() == "code ran"

    marker = tmp_path / "marker"
    payload = pickle.dumps(Payload(marker))
    root = tmp_path / "run"
    # 1. A torch-style checkpoint: model.pt only. Not ours; nothing reads it.
    (root / "step-000001").mkdir(parents=True)
    (root / "step-000001" / "model.pt").write_bytes(payload)
    torch.save({"x": Payload(marker)}, root / "step-000001" / "optimizer.pt")
    # 2. Our layout with correct hashes, but model.safetensors is a pickle (and torch.save zip).
    for step, blob in ((2, payload), (3, (root / "step-000001" / "optimizer.pt").read_bytes())):
        d = root / f"step-{step:06d}"
        d.mkdir()
        (d / "model.safetensors").write_bytes(blob)
        parts = {
            "model": {"file": "model.safetensors", "aliases": {}, "tree": {"w": {"__tensor__": "w"}}},
            "optimizer": {"file": None, "aliases": {}, "tree": None},
            "extra": {"file": None, "aliases": {}, "tree": None},
        }
        (d / "state.json").write_text(json.dumps({"format_version": 1, "step": step, "parts": parts}))
        write_manifest(d, step)
        assert verify(d)[1].startswith("model.safetensors: not a safetensors file")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert latest_valid(root) is None
    assert len(caught) == 3
    for step in (1, 2, 3):
        with pytest.raises(CheckpointError, match="not a valid checkpoint"):
            load_checkpoint(root / f"step-{step:06d}")
    with pytest.raises(SafetensorError):  # even the bare reader refuses it without running it
        load_file(str(root / "step-000002" / "model.safetensors"))
    assert not marker.exists()


def test_cleanup_keeps_other_live_writers(tmp_path):
    mine = tmp_path / f".tmp-step-000001-{os.getpid()}"
    mine.mkdir()
    theirs = tmp_path / f".old-step-000002-{os.getppid()}"
    theirs.mkdir()
    assert cleanup_temp_dirs(tmp_path) == [mine]


@pytest.mark.parametrize("offset", [(1 << 20) + 1, 3 << 20, -1])
def test_a_byte_flipped_far_into_a_large_file_is_detected(tmp_path, offset):
    """Every other checkpoint test writes files under 1 MiB: a verifier that hashed only a file's
    first megabyte would pass them all. Here the model file is > 4 MiB and the byte is past 1 MiB."""
    state = {"big": torch.arange(1_300_000, dtype=torch.float32), "small": torch.ones(3)}  # (5.2 MB)
    first = save_checkpoint(tmp_path, step=1, model_state=state)
    second = save_checkpoint(tmp_path, step=2, model_state=state)
    f = second / "model.safetensors"
    data = bytearray(f.read_bytes())
    assert len(data) > 4 << 20
    data[offset] ^= 0x10
    f.write_bytes(bytes(data))
    assert verify(second) == (False, "model.safetensors SHA-256 mismatch")
    with pytest.raises(CheckpointError, match=r"step-000002.*model\.safetensors"):
        load_checkpoint(second)
    skipped = []
    assert latest_valid(tmp_path, on_skip=lambda p, why: skipped.append((p.name, why))) == first
    assert skipped == [("step-000002", "model.safetensors SHA-256 mismatch")]

"""Run ``densebatch train`` in a subprocess with injected faults; helpers shared by test_resume.py and test_faults.py.

As a script, ``python fault_driver.py ARGS...`` is ``densebatch ARGS...`` with the faults described by
the JSON in the environment variable ``DENSEBATCH_FAULTS`` patched in first (no production hooks):

- ``kill_in_save: {"save": n, "file": "model" | "optimizer" | "manifest"}``: on this process's n-th
  checkpoint save, write that file of the temporary directory *torn* (half of its bytes), then SIGKILL
  the process: a crash in the middle of writing a checkpoint.
- ``loss_fault: {"call": c, "kind": "nan" | "scale", "factor": f}``: the c-th training call of
  ``GPT.token_losses`` (1-based; one call per step with one batch per step) returns NaN losses, or
  losses multiplied by ``f`` (a spike).
- ``skip_batch_on_restore: true``: ``StepLoader.load_state_dict`` lands one row too far (a wrong
  batch order after resume; negative control).
- ``no_rng_restore: true``: resume without restoring the RNG states (negative control).
- ``slow_stop_save: {"marker": path, "seconds": s, "step_pause": p}``: the checkpoint a stop by signal
  saves takes ``s`` seconds longer, after writing ``model.safetensors`` into its temporary directory (and
  creating ``marker`` then): a second signal lands in the middle of that write. Each step also pauses
  ``p`` seconds (default 0.05) before its checkpoint decision, so that a first signal lands before the
  step's save and not after it (a stop at a step already saved writes nothing more: no stop's save).
- ``hold_prepare: {"go": path, "kill": bool}``: building a cache entry (under its lock) first waits until
  ``go`` exists before writing it (in memory, or assembling its chunks when streamed); with ``kill``, the
  process then dies by SIGKILL in the middle of writing the entry.

Every run uses one intra-op thread (``torch.set_num_threads(1)``) so that the subprocesses and the
reference run compute with the same kernels and do not fight over the CI's two cores.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from support import subprocess_env

HERE = Path(__file__).resolve()
FAULTS_ENV = "DENSEBATCH_FAULTS"


# ------------------------------------------------------------------------------ driver side
def _kill_self() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _torn(path: str | Path) -> None:
    """Cut a just-written file to half its size (what a crash mid-write leaves)."""
    p = Path(path)
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


def install_faults(faults: dict) -> None:
    import torch

    torch.set_num_threads(int(faults.get("threads", 1)))
    if spec := faults.get("kill_in_save"):
        from densebatch.train.checkpoint import manager as checkpoint

        nth, which = int(spec["save"]), spec.get("file", "model")
        saves = {"n": 0}
        orig_save_file, orig_write_json = checkpoint.write_safetensors, checkpoint._write_json

        def save_file(tensors, filename, metadata=None):
            if Path(filename).name == "model.safetensors":
                saves["n"] += 1
            written = orig_save_file(tensors, filename, metadata=metadata)
            if saves["n"] == nth and Path(filename).name == f"{which}.safetensors":
                _torn(filename)
                _kill_self()
            return written

        def write_json(path, obj):
            orig_write_json(path, obj)
            if saves["n"] == nth and which == "manifest" and Path(path).name == checkpoint.MANIFEST:
                _torn(path)
                _kill_self()

        checkpoint.write_safetensors, checkpoint._write_json = save_file, write_json
    if spec := faults.get("loss_fault"):
        from densebatch.model.gpt import GPT

        calls = {"n": 0}
        orig = GPT.token_losses

        def token_losses(self, batch):
            losses = orig(self, batch)
            if not self.training:
                return losses
            calls["n"] += 1
            if calls["n"] == int(spec["call"]):
                return losses * float("nan") if spec["kind"] == "nan" else losses * float(spec["factor"])
            return losses

        GPT.token_losses = token_losses
    if faults.get("skip_batch_on_restore"):
        from densebatch.data.load.loader import StepLoader

        orig_load = StepLoader.load_state_dict

        def load_state_dict(self, state):
            orig_load(self, dict(state, row=int(state["row"]) + 1))

        StepLoader.load_state_dict = load_state_dict
    if slow := faults.get("slow_stop_save"):
        from densebatch.train.checkpoint import manager as checkpoint
        from densebatch.train.session import Session

        stopping, marker, seconds = {"trainer": None}, Path(slow["marker"]), float(slow["seconds"])
        orig_session_save, orig_save_file = Session.save, checkpoint.write_safetensors

        def session_save(self):
            stopping["trainer"] = self.trainer
            return orig_session_save(self)

        def slow_save_file(tensors, filename, metadata=None):
            # Judged when each file is written, not when the save began: a signal that lands during a step's
            # regular save makes that save the stop's (the run then saves nothing more at that step).
            written = orig_save_file(tensors, filename, metadata=metadata)
            t = stopping["trainer"]
            if t is not None and t.should_stop and not marker.exists():
                marker.write_text(str(filename))
                time.sleep(seconds)
            return written

        orig_after_step, pause = Session.after_step, float(slow.get("step_pause", 0.05))

        def after_step(self, result):
            time.sleep(pause)  # steps of a few ms: the first signal then lands here, before the step's save
            return orig_after_step(self, result)

        Session.save, checkpoint.write_safetensors, Session.after_step = session_save, slow_save_file, after_step
    if hold := faults.get("hold_prepare"):
        from densebatch.data.prepare import pipeline

        go, kill = Path(hold["go"]), bool(hold.get("kill"))
        orig_assemble = pipeline.assemble

        def assemble(b, **kwargs):  # the writer of every prepared entry
            deadline = time.monotonic() + 120
            while not go.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            out = orig_assemble(b, **kwargs)
            if kill:
                _torn(Path(kwargs["train_dir"]) / "shard-000000" / "tokens.npy")
                _kill_self()
            return out

        pipeline.assemble = assemble
    if faults.get("no_rng_restore"):
        import densebatch.train.session as session

        session.restore_rng_state = lambda state: None


def main(argv: list[str]) -> int:
    install_faults(json.loads(os.environ.get(FAULTS_ENV) or "{}"))
    from densebatch.cli import main as cli_main

    return cli_main(argv)


# ------------------------------------------------------------------------------- test side
TINY = {
    "seed": 0,
    # 120 generated records → ~87 short training documents: an epoch is ~20 batches, so 24 steps cross it.
    "data": {"default": {"num_records": 120}, "max_seq_len": 256},
    "batching": {"strategy": "packed", "max_tokens_per_batch": 1024, "seq_len": 256},
    "model": {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 256},
    "train": {"max_steps": 12, "lr": 3e-3, "warmup_steps": 2, "progress": False, "device": "cpu"},
    "eval": {"accuracy_samples": 0},
    "checkpoint": {"every_steps": 2, "keep_last": 3},
}


def write_config(path: Path, output_dir: Path, cache_dir: Path, **sections: dict) -> Path:
    """A YAML run config: ``TINY`` with ``sections`` merged in (e.g. ``train={"max_steps": 20}``)."""
    import yaml

    cfg = {k: dict(v) if isinstance(v, dict) else v for k, v in TINY.items()}
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    cfg["output_dir"] = str(output_dir)
    cfg["data"]["cache_dir"] = str(cache_dir)
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def _env(faults: dict | None) -> dict:
    return subprocess_env(**{FAULTS_ENV: json.dumps(faults or {})})


def start(args: list[str], faults: dict | None = None, cwd: Path | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(HERE), *args], env=_env(faults), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def run(args: list[str], faults: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the driver to completion (or to its own SIGKILL)."""
    p = start(args, faults)
    out, err = p.communicate(timeout=timeout)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def run_in_process(args: list[str]) -> int:
    """``densebatch ARGS`` in this (pytest) process: no interpreter start-up, for runs nothing kills.
    One intra-op thread, as the subprocesses use; the global RNGs (training reseeds them) are put back.
    Patch faults in with pytest's ``monkeypatch`` around the call."""
    import torch

    from densebatch.cli import main as cli_main
    from densebatch.train.checkpoint.rng import capture_rng_state, restore_rng_state

    rng, threads = capture_rng_state(), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return cli_main(list(args))
    finally:
        restore_rng_state(rng)
        torch.set_num_threads(threads)


def metrics(output_dir: Path) -> list[dict]:
    """Complete records of ``metrics.jsonl``. Only the last line may be torn (a kill in the middle
    of a write) and is then ignored; a bad line anywhere else is a bug and fails the test."""
    path = Path(output_dir) / "metrics.jsonl"
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    out = []
    for i, line in enumerate(lines):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise AssertionError(f"{path}:{i + 1}: not a JSON record, and not the last line: {line[:80]!r}") from None
    return out


def records(output_dir: Path) -> list[dict]:
    """Every record of ``output_dir/metrics.jsonl``."""
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]


def train_losses(output_dir: Path) -> list[tuple[int, float | None]]:
    """``(step, loss)`` of every train record, in file order (floats exactly as written)."""
    return [(r["step"], r["loss"]) for r in metrics(output_dir) if r.get("kind") == "train"]


def last_step(output_dir: Path) -> int:
    steps = [r["step"] for r in metrics(output_dir) if r.get("kind") == "train"]
    return max(steps, default=0)


def signal_at_step(
    args: list[str],
    output_dir: Path,
    step: int,
    sig: int = signal.SIGKILL,
    delay_s: float = 0.0,
    faults: dict | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess:
    """Start a run, wait until ``metrics.jsonl`` shows ``step`` (plus ``delay_s``), send ``sig``, wait for the end."""
    p = start(args, faults)
    deadline = time.monotonic() + timeout
    while p.poll() is None and last_step(output_dir) < step:
        if time.monotonic() > deadline:
            p.kill()
            raise TimeoutError(f"step {step} not reached in {timeout} s")
        time.sleep(0.002)
    if p.poll() is None:
        time.sleep(delay_s)
        p.send_signal(sig)
    out, err = p.communicate(timeout=timeout)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def seeded_rng(name: str) -> random.Random:
    """A per-test RNG; DENSEBATCH_FAULT_SEED changes every 'random moment' at once (default fixed)."""
    return random.Random(f"{os.environ.get('DENSEBATCH_FAULT_SEED', '0')}:{name}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

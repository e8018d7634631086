"""``python -m benchmarks.scale.memory_driver ARGS...`` is ``densebatch ARGS...`` recording each rank's peak memory by phase.

Run under torchrun (or alone) by ``benchmarks/scale/state_memory.py``. The peak resident memory (``VmHWM``)
is reset (``/proc/self/clear_refs``, Linux) at the start of each phase and read at its end; no production
hook, the phases are wrapped here:

- ``build``: building the model (``run.build.build_run_model``) up to the trainer's creation, so the
  sharding and, under FSDP, materialising the shards are inside; every parameter is read once at its
  end, so weights a loader left memory-mapped and untouched (``from_pretrained``) count, as they do
  from the first step on;
- ``save``: each checkpoint save (``Session.save``; the largest is kept);
- ``resume``: restoring a checkpoint (``Session.restore``);
- ``final``: writing ``output_dir/final``;
- ``step``: each training step (``Trainer.train_step``: forward, backward, update; the largest is kept), with
  ``before_step``, the resident memory just before the first one (so ``step - before_step`` is the most a step
  held above what the process held before its first forward: activations and what the backward pass keeps);
- ``run``: the whole process (never reset: the peak over everything);
- ``<phase>_own``: the most one call of the phase added to the resident memory it began with.

At exit each rank writes ``$DENSEBATCH_MEMORY/rank<RANK>.json``: MiB per phase, and the resident memory
just before the build began (``before_build``: the interpreter, torch and the prepared data).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import sys
from pathlib import Path

import torch

import densebatch.run.build as build
import densebatch.run.training as training
from densebatch.cli import main
from densebatch.train.loop import Trainer
from densebatch.train.session import Session

peaks: dict[str, float] = {}
run_peak = {"mib": 0.0}


def _status(field: str) -> float:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024


def _reset() -> None:
    run_peak["mib"] = max(run_peak["mib"], _status("VmHWM"))
    Path("/proc/self/clear_refs").write_text("5")


def _phase(name: str, fn):
    def wrapped(*args, **kwargs):
        before = _status("VmRSS")
        _reset()
        try:
            return fn(*args, **kwargs)
        finally:
            peak = _status("VmHWM")
            peaks[name] = max(peaks.get(name, 0.0), peak)
            peaks[f"{name}_own"] = max(peaks.get(f"{name}_own", 0.0), peak - before)

    return wrapped


_build, _trainer_init = build.build_run_model, Trainer.__init__


def build_run_model(*args, **kwargs):
    peaks["before_build"] = _status("VmRSS")
    _reset()
    return _build(*args, **kwargs)


def trainer_init(self, model, *args, **kwargs):
    if "build" not in peaks:
        # every parameter read once: weights a loader left memory-mapped and untouched count here, as they
        # do from the first step on (the first forward reads them all)
        with torch.no_grad():
            for p in model.parameters():
                (p.to_local() if hasattr(p, "to_local") else p).float().sum()
        peaks["build"] = _status("VmHWM")
    return _trainer_init(self, model, *args, **kwargs)


_train_step = _phase("step", Trainer.train_step)


def train_step(self, step):
    peaks.setdefault("before_step", _status("VmRSS"))
    return _train_step(self, step)


build.build_run_model = build_run_model
Trainer.__init__ = trainer_init
Trainer.train_step = train_step
Session.save = _phase("save", Session.save)
Session.restore = _phase("resume", Session.restore)
training.write_final = _phase("final", training.write_final)


@atexit.register
def write() -> None:
    out = Path(os.environ["DENSEBATCH_MEMORY"])
    out.mkdir(parents=True, exist_ok=True)
    peaks["run"] = max(run_peak["mib"], _status("VmHWM"))
    (out / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(peaks))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

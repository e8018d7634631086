"""Where a training step's time goes: densebatch, Hugging Face Trainer and the plain loop, side by side.

The full-loss workload of issue 10 (``benchmarks/throughput/fullloss_sets.py``; HF GPT-2 config 4 x 256,
vocabulary 50,257; HF Trainer group_by_length batches of 8; densebatch token_budget and the plain
loop at the same real tokens per step). Each tool runs unmodified; its phases are timed from the
outside (wrappers around its own methods, forward hooks on the transformer body and a gradient hook
on the body's output, which fires when the head's backward is done):

    data      waiting for the step's batches (densebatch: the prefetch queue; HF: fetch + collate)
    collate   building the batches (densebatch: in the prefetch thread, overlapped; HF: in the loop)
    h2d       moving the batch to the device           body fwd / body bwd   the transformer blocks
    head fwd / head bwd   output projection + cross-entropy (densebatch's fused head computes its
              gradient in the forward pass, so compare the sum "head")
    clip, optimizer, zero_grad, schedule, logging (metrics, callbacks, counters), other (the rest)

Then ``torch.profiler`` over a few steps: operators by self CPU time, and how many calls would
synchronise a GPU with the host per step (``item`` / ``_local_scalar_dense``, ``nonzero``, ``equal``).

    .venv/bin/python -m benchmarks.throughput.profile_step --set tune --steps 8 --repeats 2
    .venv/bin/python -m benchmarks.throughput.profile_step --set tune --ops      # operator tables too
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
import warnings
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import require_shared_data
from benchmarks.throughput.baselines import build_hf_trainer, dense_rows, hf_features
from benchmarks.throughput.comparison import build_hf_model
from benchmarks.throughput.pipeline import build_trainer
from benchmarks.throughput.train_throughput import match_hf_window, prepare_setup

PHASES = ("data", "collate", "h2d", "body fwd", "head fwd", "head bwd", "body bwd", "clip", "optimizer")
PHASES += ("zero_grad", "schedule", "logging", "other")
SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::equal", "aten::is_nonzero")


def _now() -> np.ndarray:
    """(wall, process CPU) seconds: CPU time is what the step costs whatever else the machine runs."""
    return np.array([time.perf_counter(), time.process_time()])


class Clock:
    """Per-step sums of phase times (main thread; wall and process CPU), and the step boundaries."""

    def __init__(self):
        self.steps: list[dict[str, np.ndarray]] = []
        self.cur: dict[str, np.ndarray] = defaultdict(lambda: np.zeros(2))
        self.last_end = _now()
        self.hidden_grad_at: np.ndarray | None = None
        self.collate: list[float] = []  # wall seconds per call, any thread

    @contextlib.contextmanager
    def phase(self, name: str):
        t = _now()
        try:
            yield
        finally:
            self.cur[name] += _now() - t

    def wrap(self, obj, attr: str, name: str) -> None:
        fn = getattr(obj, attr)

        def timed(*a, **kw):
            with self.phase(name):
                return fn(*a, **kw)

        setattr(obj, attr, timed)

    def end_step(self) -> None:
        now = _now()
        total = now - self.last_end
        self.last_end = now
        rec = dict(self.cur)
        forward = rec.pop("forward", np.zeros(2))
        rec["head fwd"] = np.maximum(0.0, forward - rec.get("body fwd", np.zeros(2)))
        # collate is part of "data" (HF) or runs in another thread (densebatch): not added again.
        rec["other"] = total - sum((v for k, v in rec.items() if k in PHASES and k != "collate"), np.zeros(2))
        rec["step"] = total
        self.steps.append(rec)
        self.cur = defaultdict(lambda: np.zeros(2))

    def hook_body(self, body: torch.nn.Module) -> None:
        """Time the transformer body's forward; mark when the gradient reaches its output."""
        state = {}

        def pre(module, args, kwargs):
            state["t"] = _now()

        def post(module, args, kwargs, output):
            self.cur["body fwd"] += _now() - state["t"]
            h = output[0] if isinstance(output, tuple) else output.last_hidden_state
            if h.requires_grad:
                h.register_hook(self._hidden_grad)

        body.register_forward_pre_hook(pre, with_kwargs=True)
        body.register_forward_hook(post, with_kwargs=True)

    def _hidden_grad(self, grad):
        self.hidden_grad_at = _now()

    @contextlib.contextmanager
    def backward(self):
        """Split one backward pass at the moment the body's output receives its gradient."""
        self.hidden_grad_at = None
        t = _now()
        try:
            yield
        finally:
            end = _now()
            mid = self.hidden_grad_at if self.hidden_grad_at is not None else t
            self.cur["head bwd"] += mid - t
            self.cur["body bwd"] += end - mid

    def timed_backward(self, fn):
        def run(*a, **kw):
            with self.backward():
                return fn(*a, **kw)

        return run


# ---------------------------------------------------------------------------------- densebatch
def profile_densebatch(setup, clock: Clock, steps: int):
    from densebatch.train.observe.monitor import Console

    out = tempfile.mkdtemp()
    trainer = build_trainer(setup, "token_budget", out, steps)
    model = trainer.model
    clock.hook_body(model.hf.base_model)
    clock.wrap(model, "token_losses", "forward")
    collate = trainer.data.collator

    def timed_collate(*a, **kw):
        t = time.perf_counter()
        try:
            return collate(*a, **kw)
        finally:
            clock.collate.append(time.perf_counter() - t)

    trainer.data.collator = timed_collate
    clock.wrap(trainer, "next_step", "data")
    clock.wrap(trainer.optimizer, "step", "optimizer")
    clock.wrap(trainer.optimizer, "zero_grad", "zero_grad")
    clock.wrap(trainer, "_set_lr", "schedule")
    clock.wrap(trainer, "write_record", "logging")
    clock.wrap(trainer.guard, "check", "logging")
    import importlib

    patches = [(Console, "step", Console.step, "logging")]
    # Where the loop finds these functions (the loop's modules move as it is refactored).
    for modname in ("densebatch.train.loop", "densebatch.train.passes", "densebatch.train.update"):
        with contextlib.suppress(ImportError):
            mod = importlib.import_module(modname)
            for attr, name in (("to_device", "h2d"), ("clip_gradients", "clip")):
                if hasattr(mod, attr):
                    patches.append((mod, attr, getattr(mod, attr), name))
    for mod, attr, _fn, name in patches:
        clock.wrap(mod, attr, name)
    tensor_backward = torch.Tensor.backward
    torch.Tensor.backward = clock.timed_backward(tensor_backward)
    trainer.after_step = lambda result: clock.end_step()
    try:
        clock.last_end = _now()
        trainer.run()
    finally:
        torch.Tensor.backward = tensor_backward
        for mod, attr, fn, _ in patches:
            setattr(mod, attr, fn)
        trainer.reset_data_iterator()


# ---------------------------------------------------------------------------------------- HF
def profile_hf(setup, clock: Clock, features):
    from transformers import Trainer, TrainerCallback

    class Timed(Trainer):
        def get_batch_samples(self, *a, **kw):
            with clock.phase("data"):
                return super().get_batch_samples(*a, **kw)

        def _prepare_inputs(self, *a, **kw):
            with clock.phase("h2d"):
                return super()._prepare_inputs(*a, **kw)

        def compute_loss(self, *a, **kw):
            with clock.phase("forward"):
                return super().compute_loss(*a, **kw)

        def _clip_grad_norm(self, *a, **kw):
            with clock.phase("clip"):
                return super()._clip_grad_norm(*a, **kw)

        def _maybe_log_save_evaluate(self, *a, **kw):
            with clock.phase("logging"):
                return super()._maybe_log_save_evaluate(*a, **kw)

        def create_scheduler(self, *a, **kw):
            out = super().create_scheduler(*a, **kw)
            clock.wrap(self.lr_scheduler, "step", "schedule")
            return out

        def floating_point_ops(self, *a, **kw):
            with clock.phase("logging"):
                return super().floating_point_ops(*a, **kw)

    class Steps(TrainerCallback):
        def on_pre_optimizer_step(self, *a, **kw):
            self.t = _now()

        def on_optimizer_step(self, *a, **kw):
            clock.cur["optimizer"] += _now() - self.t

        def on_step_end(self, *a, **kw):
            clock.end_step()

    out = tempfile.mkdtemp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer, collator = build_hf_trainer(setup, "group_by_length", features, out, [Steps()], trainer_cls=Timed)
        inner = collator.inner

        def timed_collate(feats):
            with clock.phase("collate"):
                return inner(feats)

        collator.inner = timed_collate
        clock.hook_body(trainer.model.transformer)
        clock.wrap(trainer.model, "zero_grad", "zero_grad")
        trainer.accelerator.backward = clock.timed_backward(trainer.accelerator.backward)
        clock.last_end = _now()
        trainer.train()


# ------------------------------------------------------------------------------------- plain
def profile_plain(setup, clock: Clock):
    ids, _ = dense_rows(setup)
    model = build_hf_model(setup).train()
    clock.hook_body(model.transformer)
    opt = torch.optim.AdamW(model.parameters(), lr=setup.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    clock.last_end = _now()
    for x in ids:
        with clock.phase("forward"):
            loss = model(input_ids=x, labels=x, use_cache=False).loss
        with clock.backward():
            loss.backward()
        with clock.phase("clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with clock.phase("optimizer"):
            opt.step()
        with clock.phase("zero_grad"):
            opt.zero_grad(set_to_none=True)
        with clock.phase("logging"):
            float(loss.detach())  # what any loop prints
        clock.end_step()


# ------------------------------------------------------------------------------------ report
def summarise(steps: list[dict], real_per_step: float) -> dict[str, np.ndarray]:
    """Median (wall, CPU) milliseconds per phase over ``steps``, plus head = head fwd + head bwd."""
    out = {k: np.median([s.get(k, np.zeros(2)) for s in steps], axis=0) * 1000 for k in (*PHASES, "step")}
    out["head"] = out["head fwd"] + out["head bwd"]
    out["real tok/s"] = real_per_step / (out["step"] / 1000)
    return out


def op_table(fn, rows: int):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    avg = prof.key_averages()
    syncs = {e.key: e.count for e in avg if e.key in SYNC_OPS}
    return avg.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=44), syncs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", default="tune", help="a set of benchmarks/throughput/fullloss_sets.py")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per tool")
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="alternate the tools this many times; medians over all steps")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--ops", action="store_true", help="also print torch.profiler operator tables (3 steps each)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ns = argparse.Namespace(
        full_loss=args.set, seq_len=1024, hf_rows=8, tokens_per_step=None, steps=args.steps,
        warmup_steps=args.warmup_steps, lr=3e-4, seed=args.seed,
    )  # fmt: skip
    tools = ("densebatch", "hf", "plain")
    clocks = {t: [] for t in tools}
    with tempfile.TemporaryDirectory() as tmpd:
        setup = prepare_setup(args.set, ns, require_shared_data(), Path(tmpd))
        features = hf_features(setup.store)
        match_hf_window(setup, ns, features)  # the same real tokens per step as HF's timed steps
        print(
            f"{args.set}: {setup.tokens_per_step} real tokens/step (HF window fill {setup.notes['hf_window_fill']:.3f}), "
            f"{torch.get_num_threads()} threads, "
            f"load average {os.getloadavg()[0]:.1f}",
            flush=True,
        )
        run = {
            "densebatch": lambda c: profile_densebatch(setup, c, setup.warmup + setup.steps),
            "hf": lambda c: profile_hf(setup, c, features),
            "plain": lambda c: profile_plain(setup, c),
        }
        for rep in range(args.repeats):
            for t in tools[rep % 3 :] + tools[: rep % 3]:
                clock = Clock()
                run[t](clock)
                clocks[t].append(clock)
                print(f"  repeat {rep + 1}: {t} done, load {os.getloadavg()[0]:.1f}", flush=True)
        real = setup.tokens_per_step
        rows = {}
        for t in tools:
            steps = [st for c in clocks[t] for st in c.steps[args.warmup_steps :]]
            rows[t] = summarise(steps, real)
            collate = [x for c in clocks[t] for x in c.collate]
            if collate and not rows[t]["collate"].any():  # densebatch: per call, in the prefetch thread
                rows[t]["collate"] = np.array([statistics.median(collate) * 1000, np.nan])
        print(
            f"\nmedian ms per step, wall / process CPU ({args.steps} steps x {args.repeats}); densebatch's "
            "collate runs in the prefetch thread (wall per call, overlapped)"
        )
        print("| phase | " + " | ".join(tools) + " |\n|---|" + "---|" * len(tools))
        for k in ("step", *PHASES, "head", "real tok/s"):
            print(f"| {k} | " + " | ".join(f"{rows[t][k][0]:.1f} / {rows[t][k][1]:.1f}" for t in tools) + " |")
        if args.ops:
            setup.steps, setup.warmup = 3, 1
            for t in tools:
                table, syncs = op_table(lambda t=t: run[t](Clock()), 18)
                per_step = {k: v / (setup.steps + setup.warmup) for k, v in syncs.items()}
                print(f"\n### {t}: operators by self CPU time (4 steps); host-sync ops per step {per_step}\n{table}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

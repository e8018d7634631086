"""densebatch's side of the throughput benchmark: its real pipeline, timed step by step.

``prepare`` (done once by the driver) -> ``PlanSettings`` -> ``StepLoader`` (prefetch thread) ->
collator -> ``HFCausalLM`` -> ``densebatch.train.loop.Trainer``. A step's time is the wall time
between the ends of consecutive optimizer steps (data wait, collation, forward, backward, clipping,
optimizer and logging included).
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time

import torch

from benchmarks.throughput.comparison import Run, Setup
from benchmarks.throughput.interleave import StepTimer


def build_trainer(setup: Setup, strategy: str, out: str, steps: int, prefetch: int = 2, loss_head: str = "fused", before=False):
    """The Trainer ``densebatch train --model.kind=hf --batching.strategy=<strategy>`` would build here.

    ``before``: the model path and optimizer as they were before issue 10, inside today's loop (see
    ``as_before``)."""
    from densebatch.config import BatchingConfig, GuardConfig, TrainConfig
    from densebatch.data.load.collate import collator_from_config
    from densebatch.data.load.loader import StepLoader
    from densebatch.data.plan.planner import PlanSettings
    from densebatch.data.plan.steps import StepSettings
    from densebatch.model import HFCausalLM
    from densebatch.train.loop import Trainer
    from densebatch.train.parts import Placement, Reporting

    if strategy == "packed":
        bcfg = BatchingConfig(strategy="packed", max_tokens_per_batch=setup.tokens_per_step, seq_len=setup.seq_len)
    else:
        bcfg = BatchingConfig(strategy="token_budget", max_tokens_per_batch=setup.budget, seq_len=setup.seq_len)
    collator = collator_from_config(bcfg, setup.store.meta, setup.seed)
    if before:  # batches without the planner's facts: the model rediscovers them each forward
        inner = collator
        collator = lambda *a, **kw: dataclasses.replace(inner(*a, **kw), single_doc_rows=None, max_position=None)  # noqa: E731
    loader = StepLoader(
        setup.store,
        settings=PlanSettings.from_config(bcfg),
        collator=collator,
        seed=setup.seed,
        steps=StepSettings(),
        prefetch=prefetch,
    )
    torch.manual_seed(setup.seed)
    model = HFCausalLM(setup.model_dir, loss_head="plain" if before else loss_head)
    tcfg = TrainConfig(
        max_steps=steps, lr=setup.lr, progress=False, device="cpu", guard=GuardConfig(spike_zscore=0.0), log_every=1
    )
    optimizer = as_before(model, tcfg) if before else None
    placement, reporting = Placement(device="cpu"), Reporting(console=False)
    return Trainer(model, loader, tcfg, output_dir=out, placement=placement, reporting=reporting, optimizer=optimizer)


def as_before(model, tcfg):
    """Turn today's ``HFCausalLM`` back into its state before issue 10 and return that optimizer:
    position_ids always passed (transformers then builds a 4-D packed-sequence mask for rows whose
    padding restarts the positions), the plain head (boolean-indexed logits of every loss position),
    multi-tensor (foreach) AdamW."""
    import types

    from densebatch.train.optim import param_groups

    def old_inputs(self, input_ids, positions, single_doc_rows):
        mask = None if single_doc_rows else self._mask(positions)
        return dict(input_ids=input_ids, position_ids=positions, attention_mask=mask, use_cache=False)

    model._inputs = types.MethodType(old_inputs, model)
    groups = param_groups(model, tcfg)
    adam = tcfg.optimizer
    return torch.optim.AdamW(groups, lr=tcfg.lr, betas=(adam.beta1, adam.beta2), eps=adam.eps, foreach=True)


def run_densebatch(setup: Setup, strategy: str, timer: StepTimer, **kw) -> Run:
    recs: list[dict] = []

    def after_step(result):
        timer.step_end()
        recs.append(dict(result.record))

    with tempfile.TemporaryDirectory() as out:
        trainer = build_trainer(setup, strategy, out, setup.warmup + setup.steps, **kw)
        trainer.after_step = after_step
        trainer.run()
        trainer.reset_data_iterator()  # stop the loader's prefetch thread now, not at garbage collection
    m = recs[setup.warmup :]
    wall, cpu = timer.seconds(setup.warmup)
    return Run(
        f"db_{strategy}",
        wall,
        [r["real_tokens"] for r in m],
        [r["slot_tokens"] for r in m],
        [r["loss_tokens"] for r in m],
        cpu,
    )


def attention_cost(setup: Setup, repeats: int) -> None:
    """What document isolation costs densebatch's model path: one packed batch (from the real loader)
    through ``HFCausalLM.token_losses`` forward + backward, with its positions (4-D document mask, SDPA
    over all T x T pairs) and with ``positions = arange(T)`` (plain causal SDPA, no mask), same tokens
    and labels; alternating, median of ``repeats`` (at least 3) each."""
    import dataclasses

    from densebatch.config import BatchingConfig
    from densebatch.data.load.collate import collator_from_config
    from densebatch.data.load.loader import StepLoader
    from densebatch.data.plan.planner import PlanSettings
    from densebatch.model import HFCausalLM
    from densebatch.model.attention import document_mask

    bcfg = BatchingConfig(strategy="packed", max_tokens_per_batch=setup.tokens_per_step, seq_len=setup.seq_len)
    loader = StepLoader(
        setup.store,
        settings=PlanSettings.from_config(bcfg),
        collator=collator_from_config(bcfg, setup.store.meta),
        seed=setup.seed,
        prefetch=0,
    )
    packed = next(iter(loader.iter_epoch(0)))
    rows, T = packed.input_ids.shape
    causal = dataclasses.replace(packed, positions=torch.arange(T).expand(rows, T).contiguous(), single_doc_rows=True)
    torch.manual_seed(setup.seed)
    model = HFCausalLM(setup.model_dir)
    times: dict[str, list[float]] = {"packed (document mask)": [], "causal (no mask)": [], "mask build only": []}
    for i in range(max(3, repeats) + 1):
        for name, batch in (("packed (document mask)", packed), ("causal (no mask)", causal)):
            t0 = time.perf_counter()
            model.token_losses(batch).sum().backward()
            model.zero_grad(set_to_none=True)
            if i:
                times[name].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        document_mask(packed.positions)
        if i:
            times["mask build only"].append(time.perf_counter() - t0)
    segs = int((packed.positions == 0).sum())
    print(
        f"\n### attention cost, {setup.name}: one packed batch {rows} x {T}, {segs} segments, "
        f"{packed.num_real_tokens} real / {packed.num_loss_tokens} loss tokens; forward + backward, median of {len(times['mask build only'])}"
    )
    base = statistics.median(times["causal (no mask)"])
    for name, ts in times.items():
        print(f"  {name:24s} {statistics.median(ts):7.3f} s  ({statistics.median(ts) / base:.2f} x causal)")

"""The runs of the GPU check (``bench.py``): densebatch and Hugging Face Trainer on the same model, documents
and real tokens per optimizer step, each timed per optimizer step with CUDA synchronised at step ends."""

from __future__ import annotations

import gc
import math
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Result:
    """One run's timed steps: seconds, real tokens and token slots per optimizer step; the run's true peak memory
    (GiB, allocated and reserved; NaN on CPU); losses; the kernel it ran and any note; compiled graph breaks."""

    def __init__(self, seconds, real, slots, peak=(math.nan, math.nan), losses=(), note="", kernel="", graph_breaks=None):
        self.seconds, self.real, self.slots = list(seconds), list(real), list(slots)
        self.peak_alloc, self.peak_reserved = peak
        self.losses, self.note, self.kernel, self.graph_breaks = list(losses), note, kernel, graph_breaks

    @property
    def tokens_per_s(self) -> float:
        return sum(self.real) / sum(self.seconds)

    @property
    def fill(self) -> float:
        return sum(self.real) / max(1, sum(self.slots))

    @property
    def real_per_step(self) -> float:
        return sum(self.real) / max(1, len(self.real))


class OutOfMemory(Exception):
    """A run that ran out of device memory: a result ("OOM at N padded slots"), not a failure."""


def reset(device: torch.device) -> None:
    """A clean slate between runs: garbage collected, no compiled graphs, graph-break counts cleared, no cached
    blocks, CUDA's peak counters reset (so each run's peak is its own)."""
    gc.collect()
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def graph_breaks() -> int:
    """Graph breaks dynamo counted since the last ``reset`` (one run's)."""
    from torch._dynamo.utils import counters

    return int(sum(counters["graph_break"].values()))


def cuda_peak(device: torch.device) -> tuple[float, float]:
    """(allocated, reserved) GiB at their peak since the last reset; NaN on CPU."""
    if device.type != "cuda":
        return math.nan, math.nan
    return torch.cuda.max_memory_allocated(device) / 2**30, torch.cuda.max_memory_reserved(device) / 2**30


def gib(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.1f}"


def best_hf_attention(device: torch.device, model_class) -> tuple[str, str]:
    """What a Hugging Face user would pick for flattened rows, and why: flash_attention_2 when ``flash_attn``
    imports (CUDA), else flex_attention where the model class supports it (Llama; not GPT-2 in transformers
    5.17), else sdpa (whose mask transformers builds from the restarting position_ids)."""
    if device.type == "cuda":
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2", "flash_attn imports"
        except ImportError:
            pass
        if getattr(model_class, "_supports_flex_attn", False):
            return "flex_attention", "no flash_attn"
        return "sdpa", f"no flash_attn; {model_class.__name__} has no flex_attention"
    return "sdpa", "CPU"


# -------------------------------------------------------------------------------------- runners
def run_densebatch(a, store, device, model_dir: Path, precision: str, compile_: bool) -> Result:
    """densebatch ``packed``, ``a.slots`` token slots a step in rows of ``a.seq_len``, the Hugging Face model
    through ``HFCausalLM`` (attention densebatch). Its peak memory is the run's true peak from the summary (the
    monitor resets CUDA's counter every step); the kernel is what the summary says its layers ran."""
    from densebatch.config import BatchingConfig, ModelConfig, TrainConfig
    from densebatch.data.load.collate import collator_from_config
    from densebatch.data.load.loader import StepLoader
    from densebatch.data.plan.planner import PlanSettings
    from densebatch.model import build_model
    from densebatch.train.loop import Trainer
    from densebatch.train.parts import Placement, Reporting

    bcfg = BatchingConfig(strategy="packed", max_tokens_per_batch=a.slots, seq_len=a.seq_len)
    loader = StepLoader(
        store,
        settings=PlanSettings.from_config(bcfg),
        collator=collator_from_config(bcfg, store.meta, a.seed),
        seed=a.seed,
        prefetch=bcfg.prefetch,
    )
    torch.manual_seed(a.seed)
    model = build_model(ModelConfig(kind="hf", path=str(model_dir)), a.vocab)
    tcfg = TrainConfig(
        max_steps=a.warmup_steps + a.steps,
        lr=3e-4,
        precision=precision,
        device=device.type,
        progress=False,
        compile=compile_,
        loss_tokens_per_step=None,
    )
    ends, recs = [], []

    def after_step(result):
        sync(device)
        ends.append(time.perf_counter())
        recs.append(dict(result.record))

    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(
            model, loader, tcfg, output_dir=out, placement=Placement(device=device), reporting=Reporting(console=False)
        )
        trainer.after_step = after_step
        summary = trainer.run().summary
        trainer.reset_data_iterator()
    peak = (summary.get("memory_peak") or [{}])[0]
    gb = 1e9 / 2**30
    mem = (peak.get("cuda_peak_allocated_gb", math.nan) * gb, peak.get("cuda_peak_reserved_gb", math.nan) * gb)
    kernels = summary.get("attention") or {}
    kernel = "; ".join(f"{k} x{n}" for k, n in kernels.items()) if len(kernels) > 1 else next(iter(kernels), "?")
    w = a.warmup_steps
    m = recs[w:]
    return Result(
        np.diff(ends[w - 1 :]),
        [r["real_tokens"] for r in m],
        [r["slot_tokens"] for r in m],
        mem,
        [r["loss"] for r in recs],
        kernel=f"attention {kernel}",
        graph_breaks=graph_breaks() if compile_ else None,
    )


class PadCollator:
    """Right-pad to the longest feature: input_ids with pad_id, labels with -100, attention_mask 0/1
    (what DataCollatorForSeq2Seq does, without needing a tokenizer). Logs (real, slots) per micro-batch."""

    def __init__(self, pad_id: int):
        self.pad_id, self.log = pad_id, []

    def __call__(self, features):
        T = max(len(f["input_ids"]) for f in features)
        ids = torch.full((len(features), T), self.pad_id, dtype=torch.long)
        labels = torch.full((len(features), T), -100, dtype=torch.long)
        am = torch.zeros((len(features), T), dtype=torch.long)
        for i, f in enumerate(features):
            n = len(f["input_ids"])
            ids[i, :n] = torch.as_tensor(f["input_ids"])
            labels[i, :n] = ids[i, :n]
            am[i, :n] = 1
        self.log.append((int(am.sum()), int(am.numel())))
        return {"input_ids": ids, "labels": labels, "attention_mask": am}


class Flattening:
    """transformers' ``DataCollatorWithFlattening`` (the examples of a batch concatenated into one row,
    ``position_ids`` restarting per example; flash-attention kwargs when the attention is flash), logging
    (real, slots) per batch."""

    def __init__(self, flash: bool):
        from transformers import DataCollatorWithFlattening

        self.inner, self.log = DataCollatorWithFlattening(return_flash_attn_kwargs=flash), []

    def __call__(self, features):
        out = self.inner(features)
        n = int(out["input_ids"].numel())
        self.log.append((n, n))
        return out


def run_hf(a, store, device, model_dir: Path, compile_: bool, flatten: bool) -> Result:
    """``transformers.Trainer`` with ``a.examples`` documents an optimizer step (densebatch's real tokens a step on
    average). ``flatten``: ``DataCollatorWithFlattening`` + the best attention the image has (named). Else the
    ``group_by_length`` peer: padded micro-batches of at most ``a.slots // a.seq_len`` rows (HF's sampler puts
    its longest batch first: unbounded, one step of ~100 documents pads to 5-8x densebatch's slots), with
    gradient accumulation up to the same documents a step, SDPA; out of memory raises ``OutOfMemory`` naming
    the padded slots of the micro-batch that did not fit."""
    from transformers import AutoConfig, AutoModelForCausalLM, PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    feats = [{"input_ids": store.document(i)[0].tolist()} for i in range(len(store))]
    config = AutoConfig.from_pretrained(model_dir)
    cls = AutoModelForCausalLM._model_mapping[type(config)]
    attn, why = best_hf_attention(device, cls) if flatten else ("sdpa", "padded rows")
    collator = Flattening(attn == "flash_attention_2") if flatten else PadCollator(a.vocab - 1)
    rows = max(1, a.slots // a.seq_len)  # a micro-batch's rows: at most densebatch's slots, padded
    accum = 1 if flatten else math.ceil(a.examples / rows)
    per_step = a.examples if flatten else math.ceil(a.examples / accum)
    ends: list[float] = []
    losses: list[float] = []

    class Timer(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            sync(device)
            ends.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    torch.manual_seed(a.seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    with tempfile.TemporaryDirectory() as out:
        kw = dict(
            output_dir=out,
            per_device_train_batch_size=per_step,
            gradient_accumulation_steps=accum,
            max_steps=a.warmup_steps + a.steps,
            learning_rate=3e-4,
            report_to="none",
            save_strategy="no",
            logging_strategy="steps",
            logging_steps=1,
            disable_tqdm=True,
            remove_unused_columns=False,
            seed=a.seed,
            data_seed=a.seed,
            torch_compile=compile_,
        )
        if not flatten:
            kw["train_sampling_strategy"] = "group_by_length"
        if device.type == "cuda":
            kw.update(bf16=True, optim="adamw_torch_fused", dataloader_pin_memory=True)
        else:
            kw.update(use_cpu=True, dataloader_pin_memory=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = Trainer(
                model=model, args=TrainingArguments(**kw), train_dataset=feats, data_collator=collator, callbacks=[Timer()]
            )
            trainer.remove_callback(PrinterCallback)  # the losses are logged every step for Timer, not printed
            try:
                trainer.train()
            except torch.OutOfMemoryError:
                slots = collator.log[-1][1] if collator.log else 0
                del trainer, model
                raise OutOfMemory(f"OOM at {slots:,} padded slots ({per_step} rows x {accum} micro-batches a step)") from None
    w = a.warmup_steps
    m = collator.log[w * accum : (w + a.steps) * accum]
    real = [sum(x for x, _ in m[i : i + accum]) for i in range(0, len(m), accum)]
    slots = [sum(y for _, y in m[i : i + accum]) for i in range(0, len(m), accum)]
    note = (
        "" if flatten else f"{per_step} rows x {accum} micro-batches a step, longest micro-batch {max(y for _, y in m):,} slots"
    )
    return Result(
        np.diff(ends[w - 1 :]),
        real,
        slots,
        cuda_peak(device),
        losses,
        note=note,
        kernel=f"attention {attn} ({why})",
        graph_breaks=graph_breaks() if compile_ else None,
    )

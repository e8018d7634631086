"""The runs of the GPU benchmark (``bench.py``): densebatch and Hugging Face Trainer on the same model,
documents and real tokens per step, each timed per optimizer step with CUDA synchronised at step ends."""

from __future__ import annotations

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
    def __init__(self, method: str, seconds, real, slots, peak_mem: float, losses=(), note: str = ""):
        self.method, self.seconds, self.real, self.slots, self.peak_mem = method, list(seconds), list(real), list(slots), peak_mem
        self.losses, self.note = list(losses), note

    @property
    def tokens_per_s(self) -> float:
        return sum(self.real) / sum(self.seconds)

    @property
    def fill(self) -> float:
        return sum(self.real) / max(1, sum(self.slots))

    @property
    def real_per_step(self) -> float:
        return sum(self.real) / max(1, len(self.real))


def reset(device: torch.device) -> None:
    """A clean slate between runs: no compiled graphs, no cached blocks, peak memory counters reset."""
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def gib(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.1f}"


def peak_mem(device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")


def best_hf_attention(device: torch.device) -> str:
    """What a Hugging Face user would pick for packed (flattened) rows: flash_attention_2 when the package
    imports, else flex_attention on CUDA, else sdpa (which then builds a mask from position_ids)."""
    if device.type == "cuda":
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            return "flex_attention"
    return "sdpa"


# -------------------------------------------------------------------------------------- runners
def run_densebatch(a, store, device, model_dir: Path, precision: str, compile_: bool, kind: str = "hf") -> Result:
    """densebatch ``packed``, ``a.slots`` token slots a step in rows of ``a.seq_len``: the same Hugging
    Face model as the peers (``kind`` hf, attention densebatch: varlen FlashAttention on CUDA), or the
    reference GPT of the same shape (``kind`` gpt, GPT-2 only)."""
    from densebatch.config import BatchingConfig, ModelConfig, TrainConfig
    from densebatch.data.load.collate import collator_from_config
    from densebatch.data.load.loader import StepLoader
    from densebatch.data.plan.planner import PlanSettings
    from densebatch.model import build_model
    from densebatch.train.loop import Trainer
    from densebatch.train.parts import Placement, Reporting

    bcfg = BatchingConfig(strategy="packed", max_tokens_per_batch=a.slots, seq_len=a.seq_len)
    loader = StepLoader(
        store, PlanSettings.from_config(bcfg), collator_from_config(bcfg, store.meta, a.seed), a.seed, prefetch=bcfg.prefetch
    )
    torch.manual_seed(a.seed)
    if kind == "gpt":
        mcfg = ModelConfig(kind="gpt", n_layer=a.layers, n_head=a.heads, n_embd=a.width, block_size=a.seq_len)
    else:
        mcfg = ModelConfig(kind="hf", path=str(model_dir))
    model = build_model(mcfg, a.vocab)
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

    reset(device)
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(
            model, loader, tcfg, output_dir=out, placement=Placement(device=device), reporting=Reporting(console=False)
        )
        trainer.after_step = after_step
        trainer.run()
        trainer.reset_data_iterator()
        note = trainer.compiled.line() if trainer.compiled is not None else ""
    w = a.warmup_steps
    m = recs[w:]
    return Result(
        "densebatch",
        np.diff(ends[w - 1 :]),
        [r["real_tokens"] for r in m],
        [r["slot_tokens"] for r in m],
        peak_mem(device),
        [r["loss"] for r in recs],
        note,
    )


class PadCollator:
    """Right-pad to the longest feature: input_ids with pad_id, labels with -100, attention_mask 0/1
    (what DataCollatorForSeq2Seq does, without needing a tokenizer). Logs (real, slots) per batch."""

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


def run_hf(a, store, device, model_dir: Path, precision: str, compile_: bool, flatten: bool) -> Result:
    """``transformers.Trainer``: ``flatten`` = ``DataCollatorWithFlattening`` + the best attention there is
    (HF's recommended packing); otherwise padded batches under ``group_by_length`` with SDPA. Both take
    ``a.examples`` documents a step, so their real tokens per step match densebatch's on average."""
    from transformers import AutoConfig, AutoModelForCausalLM, PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    feats = [{"input_ids": store.document(i)[0].tolist()} for i in range(len(store))]
    attn = best_hf_attention(device) if flatten else "sdpa"
    collator = Flattening(attn == "flash_attention_2") if flatten else PadCollator(a.vocab - 1)
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
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), attn_implementation=attn)
    reset(device)
    with tempfile.TemporaryDirectory() as out:
        kw = dict(
            output_dir=out,
            per_device_train_batch_size=a.examples,
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
            kw.update(bf16=precision == "bf16", optim="adamw_torch_fused", dataloader_pin_memory=True)
        else:
            kw.update(use_cpu=True, dataloader_pin_memory=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = Trainer(
                model=model, args=TrainingArguments(**kw), train_dataset=feats, data_collator=collator, callbacks=[Timer()]
            )
            trainer.remove_callback(PrinterCallback)  # the losses are logged every step for Timer, not printed
            trainer.train()
    w = a.warmup_steps
    m = collator.log[w : w + a.steps]
    return Result(
        "hf", np.diff(ends[w - 1 :]), [x for x, _ in m], [y for _, y in m], peak_mem(device), losses, f"attention {attn}"
    )

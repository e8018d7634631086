"""The runs of the GPU benchmark (``bench.py``): densebatch, Hugging Face Trainer and the dense
ceiling at the same memory cap, each timed per optimizer step with CUDA synchronised at step ends."""

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
    def __init__(self, method: str, seconds: list[float], real: list[int], slots: list[int], peak_mem: float):
        self.method, self.seconds, self.real, self.slots, self.peak_mem = method, seconds, real, slots, peak_mem

    @property
    def tokens_per_s(self) -> float:
        return sum(self.real) / sum(self.seconds)

    @property
    def fill(self) -> float:
        return sum(self.real) / max(1, sum(self.slots))


def _reset_mem(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def gib(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.1f}"


def _peak_mem(device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")


# -------------------------------------------------------------------------------------- runners
def run_densebatch(a, store, device, kind: str, model_dir: Path) -> Result:
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
        mcfg = ModelConfig(
            kind="gpt", n_layer=a.layers, n_head=a.heads, n_embd=a.width, block_size=a.seq_len, attention=a.attention
        )
    else:
        mcfg = ModelConfig(kind="hf", path=str(model_dir))
    model = build_model(mcfg, a.vocab)
    tcfg = TrainConfig(
        max_steps=a.warmup_steps + a.steps, lr=3e-4, precision=a.precision, device=device.type, progress=False, compile=a.compile
    )
    ends, recs = [], []

    def after_step(result):
        sync(device)
        ends.append(time.perf_counter())
        recs.append(dict(result.record))

    _reset_mem(device)
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(
            model, loader, tcfg, output_dir=out, placement=Placement(device=device), reporting=Reporting(console=False)
        )
        trainer.after_step = after_step
        backend = getattr(trainer.model, "attention_backend", None)
        if callable(backend):
            print(f"  densebatch attention backend: {backend(device)}", flush=True)
        trainer.run()
        trainer.reset_data_iterator()
    w = a.warmup_steps
    m = recs[w:]
    return Result(
        "db_packed" if kind == "gpt" else "db_packed_hf",
        list(np.diff(ends[w - 1 :])),
        [r["real_tokens"] for r in m],
        [r["slot_tokens"] for r in m],
        _peak_mem(device),
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


def run_hf(a, store, device, model_dir: Path) -> Result:
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    feats = [{"input_ids": store.document(i)[0]} for i in range(len(store))]
    collator = PadCollator(a.vocab - 1)
    ends: list[float] = []

    class Timer(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            sync(device)
            ends.append(time.perf_counter())

    torch.manual_seed(a.seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), attn_implementation="sdpa")
    rows = max(1, a.slots // a.seq_len)
    _reset_mem(device)
    with tempfile.TemporaryDirectory() as out:
        kw = dict(
            output_dir=out,
            per_device_train_batch_size=rows,
            max_steps=a.warmup_steps + a.steps,
            learning_rate=3e-4,
            train_sampling_strategy="group_by_length",
            report_to="none",
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            remove_unused_columns=False,
            seed=a.seed,
            data_seed=a.seed,
            torch_compile=a.compile,
        )
        if device.type == "cuda":
            kw.update(bf16=a.precision == "bf16", optim="adamw_torch_fused", dataloader_pin_memory=True)
        else:
            kw.update(use_cpu=True, dataloader_pin_memory=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            Trainer(
                model=model, args=TrainingArguments(**kw), train_dataset=feats, data_collator=collator, callbacks=[Timer()]
            ).train()
    w = a.warmup_steps
    m = collator.log[w : w + a.steps]
    return Result("hf_group_by_length", list(np.diff(ends[w - 1 :])), [x for x, _ in m], [y for _, y in m], _peak_mem(device))


def run_ceiling(a, store, device, model_dir: Path) -> Result:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(a.seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), attn_implementation="sdpa").to(device)
    model.train()
    fused = {"fused": True}  # HF Trainer's default optimizer (adamw_torch_fused), on CPU too
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, **fused)
    rows = max(1, a.slots // a.seq_len)
    n = rows * a.seq_len
    toks = torch.from_numpy(np.asarray(store.tokens, np.int64))
    steps = a.warmup_steps + a.steps
    ends = []
    use_amp = a.precision == "bf16"
    _reset_mem(device)
    for s in range(steps):
        start = (s * n) % max(1, len(toks) - n)
        x = toks[start : start + n].view(rows, a.seq_len).to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp):
            loss = model(input_ids=x, labels=x, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        ends.append(time.perf_counter())
    w = a.warmup_steps
    return Result("ceiling", list(np.diff(ends[w - 1 :])), [n] * a.steps, [n] * a.steps, _peak_mem(device))

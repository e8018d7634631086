"""The pieces of one throughput comparison: data sets, methods, the setup they share, a run's timings."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

DATASETS = {  # name -> (file, template)
    "instruction": ("instruction-data.json", "alpaca"),
    "oasst": ("oasst-threads.jsonl", "chatml"),
}
METHODS = (
    "db_token_budget",
    "db_token_budget_plain",
    "db_token_budget_before",
    "db_packed",
    "hf_random",
    "hf_group_by_length",
    "plain_fused",
    "ceiling",
    "ceiling_lossonly",
)
DEFAULT_METHODS = ("db_token_budget", "db_packed", "hf_random", "hf_group_by_length", "ceiling")
# Full-loss mode (--full-loss): the issue-10 comparison.
FULL_LOSS_METHODS = ("db_token_budget", "hf_group_by_length", "plain_fused")
LABELS = {
    "db_token_budget": "densebatch token_budget",
    "db_token_budget_plain": "densebatch token_budget, plain head",
    "db_token_budget_before": "densebatch token_budget, as before",
    "db_packed": "densebatch packed",
    "hf_random": "HF Trainer (random)",
    "hf_group_by_length": "HF Trainer group_by_length",
    "plain_fused": "plain full-row loop, fused AdamW",
    "ceiling": "dense ceiling",
    "ceiling_lossonly": "dense ceiling, loss-only head",
}


# ------------------------------------------------------------------------------------- setup
@dataclass
class Setup:
    name: str
    store: object  # densebatch DocumentStore
    model_dir: Path
    tokens_per_step: int  # target real tokens per optimizer step
    seq_len: int
    steps: int
    warmup: int
    lr: float
    seed: int
    gpt2_dir: Path
    hf_rows: int = 0  # HF per_device_train_batch_size
    budget: int = 0  # token_budget slot budget
    plain_rows: int = 0  # plain loop / ceiling: rows x plain_len real tokens per step
    plain_len: int = 0
    notes: dict = field(default_factory=dict)


def build_hf_model(setup: Setup, attn: str = "sdpa"):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(setup.seed)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(setup.model_dir), attn_implementation=attn)


def token_budget_for(store, target: int, seq_len_cap: int, seed: int) -> tuple[int, float]:
    """Slot budget whose token_budget plan has a mean of ``target`` real tokens per batch (epoch 0)."""
    from densebatch.data.plan.planner import PlanSettings, plan_epoch

    lengths = np.asarray(store.lengths, np.int64)
    budget = max(target, int(lengths.max()))
    best = (budget, 0.0)
    for _ in range(8):
        plan = plan_epoch(
            lengths, PlanSettings(strategy="token_budget", max_tokens_per_batch=budget, seq_len=seq_len_cap), seed, 0
        )
        real, slots = plan.batch_stats()
        mean = float(real.mean())
        best = (budget, float(real.sum() / slots.sum()))
        if abs(mean - target) / target < 0.01:
            break
        budget = max(int(lengths.max()), int(round(budget * target / mean)))
    return best


# ------------------------------------------------------------------------------ measurements
@dataclass
class Run:
    method: str
    seconds: list[float]  # per measured step
    real: list[int]  # real tokens per measured step
    slots: list[int]
    loss_tokens: list[int]
    cpu_seconds: list[float]  # process CPU time (all threads) per measured step: less sensitive to other jobs
    load: float = 0.0  # 1-minute load average when the run started

    @property
    def tokens_per_cpu_s(self) -> float:
        return sum(self.real) / max(1e-9, sum(self.cpu_seconds))

    @property
    def tokens_per_s(self) -> float:
        return sum(self.real) / sum(self.seconds)

    @property
    def fill(self) -> float:
        return sum(self.real) / max(1, sum(self.slots))

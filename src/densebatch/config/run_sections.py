"""Configuration sections of how a run trains: train (health, group schedules), eval, checkpoint, finder, and the whole ``RunConfig``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from densebatch.config.data_sections import BatchingConfig, DataConfig
from densebatch.config.field import _f
from densebatch.config.model_section import ModelConfig


# -------------------------------------------------------------------------------------- train
@dataclass
class GroupScheduleConfig:
    """One layer group's own learning-rate schedule; every field left at its default follows train.*."""

    schedule: Literal["same", "cosine", "linear", "constant"] = _f(
        "same", "This group's schedule after its warm-up; same = train.schedule."
    )
    warmup_steps: int | None = _f(None, "This group's linear warm-up steps; none = train.warmup_steps.", minimum=0)
    min_lr_ratio: float | None = _f(
        None, "This group's final learning rate as a share of its peak; none = train.min_lr_ratio.", minimum=0.0
    )


@dataclass
class HealthConfig:
    """Thresholds of the run's health warnings (train/observe/health.py, docs/observability.md); each cause warns once."""

    enabled: bool = _f(
        True, "Warn (console, metrics.jsonl, summary) when the data wait, memory, throughput, fill rate or clipping look wrong."
    )
    warmup_steps: int = _f(20, "Steps not judged at the start (memory excepted).", minimum=0)
    data_wait_share: float = _f(
        0.2, "Warn when steps wait on data for more than this share of their time (last 50 steps).", minimum=0.0
    )
    memory_headroom: float = _f(
        0.05,
        "Warn when a step's peak memory comes within this share of train.memory_limit_gb (none: the CUDA device's memory, "
        "or on CPU the machine's or container's).",
        minimum=0.0,
    )
    slow_ratio: float = _f(
        0.5,
        "Warn when the median tokens/s of the last 20 steps falls below this share of the median of the 50 steps before them.",
        minimum=0.0,
    )
    fill_ratio: float = _f(
        0.7,
        "Warn when the median fill rate of the last 20 steps falls below this share of the median of the 50 steps before them.",
        minimum=0.0,
    )
    clip_share: float = _f(
        0.5, "Warn when the gradient norm is clipped on more than this share of the last 50 steps.", minimum=0.0
    )
    clip_warmup_steps: int = _f(200, "Steps before the clipping check starts (early gradients are large by nature).", minimum=0)


@dataclass
class OptimizerConfig:
    """AdamW's hyper-parameters; the learning rate and its schedule are train.lr, train.schedule and the groups' own."""

    weight_decay: float = _f(0.1, "AdamW weight decay (not on norms, biases or embeddings unless decay_all).", minimum=0.0)
    decay_all: bool = _f(False, "Apply weight decay to every parameter.")
    beta1: float = _f(0.9, "AdamW beta1, in [0, 1).", minimum=0.0)
    beta2: float = _f(0.95, "AdamW beta2, in [0, 1).", minimum=0.0)
    eps: float = _f(1e-8, "AdamW epsilon.", minimum=0.0)


@dataclass
class BatchScheduleConfig:
    """Batch-size schedule (docs/schedules.md): a ramp at the start, and back-off or growth on an eval-loss plateau."""

    ramp_steps: int = _f(
        0,
        "Batch-size ramp: tokens per step grow linearly from ramp_start x the target to the target over this many "
        "steps (0 = off); with ramp_unit tokens, over as many tokens as this many full steps hold.",
        minimum=0,
    )
    ramp_start: float = _f(0.25, "Batch-size ramp: the first step's size as a fraction of the target, in (0, 1].", minimum=0.0)
    ramp_unit: Literal["steps", "tokens"] = _f("steps", "Batch-size ramp: linear in steps, or in the tokens consumed.")
    backoff_patience: int = _f(
        0,
        "Batch-size back-off: evaluations without a new best eval loss before tokens per step are multiplied by "
        "backoff_factor (0 = off; needs eval.every_steps).",
        minimum=0,
    )
    backoff_factor: float = _f(0.5, "Batch-size back-off: the factor per plateau (above 1: grow instead).", minimum=0.0)
    backoff_floor: float = _f(
        0.125, "Batch-size back-off: the smallest step it reaches, as a fraction of the target, in (0, 1].", minimum=0.0
    )
    backoff_cap: float = _f(
        4.0, "Batch-size growth (factor above 1): the largest step, as a fraction of the target.", minimum=1.0
    )
    backoff_max: int = _f(3, "Batch-size back-off: the most changes in a run.", minimum=1)
    lr_scaling: Literal["none", "sqrt", "linear"] = _f(
        "none",
        "Learning rate under a batch-size ramp or back-off: none (unchanged), sqrt (x fraction^0.5) or linear (x fraction).",
    )


@dataclass
class GuardConfig:
    """Anomaly guard (docs/fault-tolerance.md): non-finite steps and loss spikes, and the rollbacks they trigger."""

    spike_zscore: float = _f(6.0, "Loss spike: robust z-score over the window above this rolls back (0 = off).", minimum=0.0)
    spike_window: int = _f(50, "Steps in the moving window of the spike detector.", minimum=5)
    max_bad_steps: int = _f(3, "Consecutive non-finite steps that trigger a rollback.", minimum=1)
    rollback_lr_factor: float = _f(0.5, "Multiply the learning rate by this after a rollback.", minimum=0.0)


@dataclass
class TrainConfig:
    """How the model is optimised: limits, learning rate and its schedule, accumulation, clipping, precision,
    and the sub-sections optimizer, batch_schedule, guard and health."""

    max_steps: int | None = _f(None, "Stop after this many optimizer steps.", minimum=1)
    max_epochs: float | None = _f(None, "Stop after this many epochs (fractions allowed).", minimum=0.0)
    max_tokens: int | None = _f(None, "Stop after this many real tokens.", minimum=1)
    lr: float | Literal["auto"] = _f(
        3e-4,
        "Peak learning rate; auto = the learning-rate range test's suggestion (densebatch find-lr), run before training.",
        minimum=0.0,
    )
    min_lr_ratio: float = _f(0.1, "Final learning rate as a share of lr (cosine / linear).", minimum=0.0)
    schedule: Literal["cosine", "linear", "constant"] = _f("cosine", "Learning-rate schedule after warm-up.")
    warmup_steps: int = _f(0, "Linear warm-up steps.", minimum=0)
    lr_mult_embeddings: float = _f(1.0, "Learning-rate multiplier of the embedding layers.", minimum=0.0)
    lr_mult_blocks: float = _f(1.0, "Learning-rate multiplier of the transformer blocks.", minimum=0.0)
    lr_mult_head: float = _f(1.0, "Learning-rate multiplier of the final norm and output head.", minimum=0.0)
    layer_lr_decay: float = _f(
        1.0,
        "Layer-wise decay, in (0, 1]: the block at depth d from the top learns at lr x lr_mult_blocks x this^d (1 = off).",
        minimum=0.0,
    )
    optimizer: OptimizerConfig = _f(OptimizerConfig, "AdamW's hyper-parameters.")
    embeddings: GroupScheduleConfig = _f(GroupScheduleConfig, "Learning-rate schedule of the embeddings group.")
    blocks: GroupScheduleConfig = _f(GroupScheduleConfig, "Learning-rate schedule of the transformer blocks.")
    head: GroupScheduleConfig = _f(GroupScheduleConfig, "Learning-rate schedule of the final norm and output head.")
    batch_schedule: BatchScheduleConfig = _f(BatchScheduleConfig, "Batch-size ramp and back-off / growth.")
    grad_accum_batches: int = _f(1, "Batches per optimizer step (ignored when loss_tokens_per_step is set).", minimum=1)
    loss_tokens_per_step: int | None = _f(
        None,
        "Loss tokens per optimizer step: a step takes whole batches, as many as bring it nearest this (at least one), "
        "so the step, and with it how the model learns, does not depend on the batches' layout or size.",
        minimum=1,
    )
    objective: Literal["sft", "dpo", "simpo", "orpo"] = _f(
        "sft",
        "What the loss is: sft (next-token cross-entropy of the documents), or on preference pairs (data.pairs) dpo "
        "(TRL's DPOTrainer sigmoid loss; conservative with label_smoothing), simpo (TRL's CPOTrainer loss_type simpo) "
        "or orpo (TRL's ORPOTrainer). See docs/preference.md.",
    )
    beta: float = _f(0.1, "dpo, simpo, orpo: the beta of the loss (TRL's beta): how far the policy may move.", minimum=0.0)
    reference: Literal["precompute", "live"] = _f(
        "precompute",
        "dpo: the reference model is the starting weights: precompute (its log-probabilities of every pair computed "
        "once before training and stored beside the prepared pairs, keyed by the model's weights) or live (a frozen "
        "copy in memory; under LoRA the base model with the adapters off, no copy).",
    )
    simpo_gamma: float = _f(0.5, "simpo: the target reward margin gamma (TRL's simpo_gamma).", minimum=0.0)
    cpo_alpha: float = _f(
        0.0,
        "simpo: weight of the chosen answers' cross-entropy added to the loss (TRL's cpo_alpha; 0 = SimPO alone, "
        "TRL's CPOConfig defaults to 1.0: CPO-SimPO).",
        minimum=0.0,
    )
    label_smoothing: float = _f(
        0.0,
        "sft: label smoothing of the training loss, in [0, 1): the target distribution is (1 - e) onehot + e / vocab "
        "(as torch's cross_entropy); per token, so exact under any batching. Evaluation reports plain cross-entropy. "
        "dpo, simpo: the share of preferences taken to be flipped, in [0, 0.5) (conservative DPO; TRL's label_smoothing).",
        minimum=0.0,
    )
    source_balance: Literal["batches", "tokens"] = _f(
        "batches",
        "How much each source of a mixture weighs in the gradient on packed and token_budget plans: batches = each "
        "source's loss tokens weighted as random padded batches of batching.rows_per_batch documents, one a step on "
        "one device, weigh them on average (a source of short answers weighs more); tokens = every loss token alike. "
        "random and length_grouped batches, and one source, are never reweighted; nor are the pairs of dpo, simpo "
        "and orpo, which weigh alike. See docs/data.md.",
    )
    grad_clip: float = _f(1.0, "Clip the gradient norm to this (0 = off); adaptive: the ceiling.", minimum=0.0)
    grad_clip_mode: Literal["fixed", "adaptive"] = _f(
        "fixed", "fixed threshold, or adaptive (z-score of running grad-norm statistics)."
    )
    precision: Literal["auto", "fp32", "bf16", "fp16"] = _f(
        "auto",
        "auto (bf16 autocast with TF32 matmuls on a CUDA GPU that has bf16, fp32 on CPU), fp32, bf16 (autocast) or "
        "fp16 (autocast + loss scaling).",
    )
    compile: bool = _f(False, "torch.compile the model.")
    device: Literal["auto", "cpu", "cuda"] = _f("auto", "auto (cuda when present), cpu or cuda.")
    log_every: int = _f(1, "Write metrics every this many steps.", minimum=1)
    progress: bool = _f(True, "Show a progress bar.")
    guard: GuardConfig = _f(GuardConfig, "Non-finite steps and loss spikes: skips and rollbacks.")
    distributed: Literal["auto", "ddp", "fsdp"] = _f(
        "auto",
        "Under torchrun: ddp (replicated model, gradients all-reduced) or fsdp (FSDP2 fully_shard: parameters, "
        "gradients and optimizer state sharded over ranks); auto = ddp when launched by torchrun.",
    )
    context_parallel: int = _f(
        1,
        "Under torchrun: context ranks that share every row (N), each holding seq_len / N of its tokens (a head and a "
        "tail chunk of 2N); attention runs across them by an all-to-all over heads, exact. The world is data ranks x "
        "N (N must divide it); the N ranks of a data rank read the same rows. Needs batching.seq_len divisible by 2N, "
        "heads (and key/value heads, or N by them) divisible by N, model.attn_implementation densebatch, and a "
        "numeric max_tokens_per_batch. See docs/scaling-out.md. 1 = off.",
        minimum=1,
    )
    report_to: list[Literal["tensorboard", "csv", "wandb", "mlflow"]] = _f(
        list,
        "Metric sinks besides metrics.jsonl: tensorboard (event files under output_dir/tensorboard), csv, wandb "
        "(WANDB_PROJECT, WANDB_MODE=offline), mlflow (MLFLOW_TRACKING_URI, default output_dir/mlruns); every scalar, "
        "with the resolved config as the run's parameters.",
    )
    plots: bool = _f(True, "At the end of the run, draw its plots into output_dir/plots (when matplotlib is installed).")
    health: HealthConfig = _f(HealthConfig, "Health warnings: their thresholds.")
    memory_limit_gb: float | None = _f(
        None,
        "Memory a budget of max_tokens_per_batch: auto may use, in GB: on CPU the whole process's peak resident "
        "memory (none = resident now + MemAvailable), on CUDA a cap on the device memory (none = its free memory).",
        minimum=0.0,
    )


@dataclass
class EvalConfig:
    every_steps: int = _f(0, "Evaluate every this many steps (0 = only at the end).", minimum=0)
    max_tokens: int | None = _f(
        1_048_576,
        "Cap on the held-out tokens an evaluation scores: a fixed, seeded selection of whole documents, the same at every "
        "evaluation and on any number of processes (none = the whole split).",
        minimum=1,
    )
    max_batches: int | None = _f(
        None, "Cap on evaluation batches, over all processes together (none = every batch of the selection).", minimum=1
    )
    patience: int = _f(0, "Early stopping: evaluations without improvement before stopping (0 = off).", minimum=0)
    accuracy_samples: int = _f(200, "Embedded default: held-out prompts answered greedily for exact-match accuracy.", minimum=0)
    max_new_tokens: int = _f(64, "Longest generated answer in the accuracy check.", minimum=1)


@dataclass
class CheckpointConfig:
    every_steps: int = _f(0, "Save every this many steps (0 = only at the end and on SIGTERM/SIGINT).", minimum=0)
    keep_last: int = _f(3, "Keep the newest this many checkpoints.", minimum=1)
    mirror_dir: str | None = _f(None, "Second location that receives a verified copy of every checkpoint.")
    resume: Literal["never", "auto"] = _f("never", "auto: continue from the newest verified checkpoint; never: start fresh.")
    async_: bool = _f(
        False,
        "Write checkpoints in the background: each rank stages its share in host memory and training goes on while "
        "it is written; the next save, a rollback and the end of the run wait for it (metrics: blocked_s per save).",
        key="async",
    )


@dataclass
class FinderConfig:
    """The learning-rate range test (densebatch find-lr, train.lr: auto) and the budget finder (find-batch)."""

    lr_start: float = _f(1e-6, "Range test: the first learning rate.", minimum=0.0)
    lr_end: float = _f(1.0, "Range test: the last learning rate (reached only if the loss never diverges).", minimum=0.0)
    lr_steps: int = _f(100, "Range test: optimizer steps from lr_start to lr_end (rates grow exponentially).", minimum=2)
    smoothing: float = _f(0.8, "Range test: weight of the loss's exponential moving average, in [0, 1).", minimum=0.0)
    diverge: float = _f(
        4.0,
        "Range test: stop when the smoothed loss exceeds this times its minimum (or, after falling by a quarter, its start; "
        "or, without such a fall, 1.5 times its start); not judged in the first tenth of the steps.",
        minimum=1.0,
    )
    heldout_batches: int = _f(
        2,
        "Range test: batches whose loss is measured after every step, to read the curve free of batch noise (from the "
        "eval data, else the first training step's, which the test then leaves out); a model near its task gets its "
        "suggestion from this curve; 0 = off.",
        minimum=0,
    )
    trials: int = _f(
        0,
        "Range test, then short trainings at this many rates around its suggestion (a factor 3 apart; up to 2 more "
        "beyond an end while the end has the lowest held-out loss), suggesting the vertex of a parabola through the "
        "best and its neighbours: for a model far from its task and at or below chance on it; a model confidently "
        "wrong (the test's first loss above 1.5 x ln vocabulary) keeps the range test's rate unless trials_always; "
        "costs (trials to trials+2) x trial_steps steps; 0 = off.",
        minimum=0,
    )
    trials_always: bool = _f(
        False,
        "Run the trials also for a model confidently wrong on its task (or of unknown vocabulary), none above the rate "
        "of the range test's lowest loss.",
    )
    trial_steps: int = _f(
        0,
        "Steps of each short trial (0: a quarter of train.max_steps, at least 10), under the run's schedule: its warm-up steps and its layer groups' (each at most half the trial), then its decay.",
        minimum=0,
    )
    memory_reserve: float = _f(
        0.1,
        "Budget finder: share of train.memory_limit_gb it keeps free (fragmentation, evaluation, checkpoint copies), in [0, 0.9].",
        minimum=0.0,
    )
    max_probes: int = _f(10, "Budget finder: most probe steps (each a forward, backward and optimizer step).", minimum=2)
    throughput_share: float = _f(
        0.9, "Budget finder: report the smallest budget reaching this share of the best measured throughput.", minimum=0.0
    )


@dataclass
class RunConfig:
    output_dir: str = _f("runs/default", "Where metrics, checkpoints and the final model go.")
    seed: int = _f(0, "Seed of everything random in the run, in [0, 2**63).", minimum=0)
    data: DataConfig = _f(DataConfig, "Data preparation.")
    batching: BatchingConfig = _f(BatchingConfig, "Batch planning and collation.")
    model: ModelConfig = _f(ModelConfig, "Model.")
    train: TrainConfig = _f(TrainConfig, "Optimisation.")
    eval: EvalConfig = _f(EvalConfig, "Evaluation.")
    checkpoint: CheckpointConfig = _f(CheckpointConfig, "Checkpoints and resume.")
    finder: FinderConfig = _f(FinderConfig, "Learning-rate range test and token-budget finder.")

"""The demo: what `densebatch train` runs with no configuration and no data of the user's own.

``DEMO_OVERRIDES`` are applied on top of the dataclass defaults only when no config file is given
*and* the command line names no data of its own (``data.path``): a user's data never inherits the
demo's tokenizer, row length, step count or learning rate. ``configs/default.yaml`` writes the
same settings out (a test keeps the two equal).
"""

from __future__ import annotations

# The generated instruction dataset (20,000 records) with a BPE of 1,024 ids learned from it, a
# 4-layer GPT of width 128, packed 512-token rows of 4,096 slots per step, 500 steps at a peak
# learning rate of 1e-3: every task answered on held-out prompts in under 3 minutes of training on
# 2 CPU cores (see data/prepare/default_dataset.py for what was tried and why).
DEMO_OVERRIDES: tuple[str, ...] = (
    "--output_dir=runs/default",
    # Each record is seen ~1.3 times: with 6,000 records seen 5+ times the model memorised the
    # training passages' colors instead of learning to find them.
    "--data.default.num_records=20000",
    "--data.tokenizer=bpe:1024",
    "--data.max_seq_len=512",
    "--batching.strategy=packed",
    "--batching.seq_len=512",
    "--batching.max_tokens_per_batch=4096",
    "--model.block_size=512",
    "--train.max_steps=500",
    # The step, not the batch, decides how the model learns: ~48 answers (96 loss tokens) a step, whatever
    # the batching flags lay out (a 4,096-slot packed batch holds ~97, so the demo's steps are one batch
    # each; 1,024-slot batches are accumulated four to a step). Tied to the batch instead, a smaller batch
    # meant 4-6x fewer answers a step, and 500 such steps left most runs short of the answers
    # (docs/benchmarks.md, time to quality).
    "--train.loss_tokens_per_step=96",
    # 3e-3 made early steps spike (loss 1 -> 3.5) and left every task at chance for 500+ steps on
    # some data orders; at 1e-3 every task was answered right by step 300.
    "--train.lr=1e-3",
    "--train.warmup_steps=50",
    # Steps here carry ~95 loss tokens, so their losses vary 3x from batch to batch while the model
    # learns: the spike detector read that as spikes and skipped good batches (14 of 800 measured).
    "--train.guard.spike_zscore=0",
)

# Overrides that bring the user's own data: with any of them, the demo's settings do not apply.
OWN_DATA_KEYS = ("data.path", "data.sources")


def is_demo(config_path: str | None, overrides: list[str]) -> bool:
    """True when the run is the demo: no config file and no override naming the user's own data."""
    if config_path is not None:
        return False
    keys = {o[2:].split("=", 1)[0] for o in overrides if o.startswith("--")}
    return not any(k == own or k.startswith(own + ".") for k in keys for own in OWN_DATA_KEYS)

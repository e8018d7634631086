"""Wiring: the only place that knows data, model and train; one function per CLI command.

``dispatch(args, overrides)`` is called by ``cli.main`` with the parsed arguments and the
``--section.key=value`` overrides. With no config file, the embedded default run is used:
the dataclass defaults plus ``EMBEDDED_DEFAULT`` (written out in ``configs/default.yaml``).
"""

from __future__ import annotations

from densebatch.config import RunConfig, load_config

# What `densebatch train` runs with no config: the generated instruction dataset with a BPE of
# 1,024 ids learned from it, a 4-layer GPT of width 128, packed 512-token rows of 4,096 slots per
# step, 800 steps — tuned to reach >= 0.8 exact-match accuracy on held-out prompts in under
# 5 minutes on 2 CPU cores (see data/default_dataset.py for what was measured).
EMBEDDED_DEFAULT: tuple[str, ...] = (
    "--output_dir=runs/default",
    "--data.tokenizer=bpe:1024",
    "--data.max_seq_len=512",
    "--batching.strategy=packed",
    "--batching.seq_len=512",
    "--batching.max_tokens_per_batch=4096",
    "--model.block_size=512",
    "--train.max_steps=800",
    "--train.lr=3e-3",
    "--train.warmup_steps=30",
    # Steps here carry ~60 loss tokens, so their losses vary 3x from batch to batch while the model
    # learns: the spike detector read that as spikes and skipped good batches (14 of 800 measured).
    "--train.spike_zscore=0",
)


def resolve_config(path: str | None, overrides: list[str]) -> RunConfig:
    """The run configuration: ``path`` (or the embedded default when None) plus overrides."""
    return load_config(path, list(overrides) if path else list(EMBEDDED_DEFAULT) + list(overrides))


def dispatch(args, overrides: list[str]) -> int:
    from densebatch.run import commands

    cmd = args.command
    if cmd == "generate":
        if overrides:
            from densebatch.errors import UserError

            raise UserError("generate takes no --section.key overrides: it uses the checkpoint's configuration")
        return commands.generate(args)
    cfg = resolve_config(args.config, overrides)
    if cmd == "train":
        from densebatch.run.training import train

        return train(cfg, resume=args.resume)
    handlers = {
        "prepare": commands.prepare,
        "inspect": commands.inspect,
        "analyze": commands.analyze,
        "eval": commands.evaluate,
        "config": commands.show_config,
    }
    return handlers[cmd](cfg, args)

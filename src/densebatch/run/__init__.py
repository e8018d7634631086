"""Wiring: the only place that knows data, model and train; one function per CLI command.

``dispatch(args, overrides)`` is called by ``cli.main`` with the parsed arguments and the
``--section.key=value`` overrides. With no config file and no data of the user's own, the demo
runs: the dataclass defaults plus ``run/demo.py``'s ``DEMO_OVERRIDES`` (written out in
``configs/default.yaml``).
"""

from __future__ import annotations

from densebatch.config import RunConfig, load_config
from densebatch.data.tokenizers import resolve_tokenizer_spec
from densebatch.run.demo import DEMO_OVERRIDES, is_demo


def resolve_config(path: str | None, overrides: list[str]) -> RunConfig:
    """The run configuration: ``path`` (or, with neither a file nor data of one's own, the demo's
    settings) plus overrides. Without a file but with ``--data.path``, the dataclass defaults apply."""
    base = list(DEMO_OVERRIDES) if is_demo(path, overrides) else []
    cfg = load_config(path, base + list(overrides))
    # data.tokenizer auto: a Hugging Face model's own tokenizer when its directory has one (resolved
    # here, so the saved config names the tokenizer actually used).
    cfg.data.tokenizer = resolve_tokenizer_spec(cfg.data.tokenizer, cfg.model.path if cfg.model.kind == "hf" else None)
    return cfg


def dispatch(args, overrides: list[str]) -> int:
    from densebatch.run import commands

    cmd = args.command
    if cmd == "generate":
        if overrides:
            from densebatch.errors import UserError

            raise UserError("generate takes no --section.key overrides: it uses the checkpoint's configuration")
        return commands.generate_command(args)
    if cmd == "export":
        if overrides:
            from densebatch.errors import UserError

            raise UserError("export takes no --section.key overrides: it uses the run's configuration")
        return commands.export_command(args)
    if cmd == "plot":
        if overrides:
            from densebatch.errors import UserError

            raise UserError("plot takes no --section.key overrides: it reads the run's metrics.jsonl")
        from densebatch.run.plot import plot_command

        return plot_command(args)
    if cmd == "train":
        from densebatch.run.training import train

        return train(args.config, overrides, resume=args.resume, overwrite=args.overwrite)
    if cmd in ("find-lr", "find-batch"):
        from densebatch.run.find import find_batch_command, find_lr_command

        return (find_lr_command if cmd == "find-lr" else find_batch_command)(args.config, overrides)
    cfg = resolve_config(args.config, overrides)
    if cmd in ("analyze", "eval"):  # they plan batches: an `auto` budget is the one a run found
        from densebatch.run.find import resolved_budget

        cfg = resolved_budget(cfg)
    handlers = {
        "prepare": commands.prepare_command,
        "inspect": commands.inspect_command,
        "analyze": commands.analyze_command,
        "eval": commands.eval_command,
        "config": commands.config_command,
    }
    return handlers[cmd](cfg, args)

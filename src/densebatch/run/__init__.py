"""Wiring: the only place that knows data, model and train; one function per CLI command.

``dispatch(args, overrides)`` is called by ``cli.main`` (which imports this package late, so that
``--help`` stays fast) with the parsed arguments and the ``--section.key=value`` overrides. Every
command that trains or probes a model builds it through ``run/build.py``; ``auto`` values resolve in
``run/auto.py``. With no config file and no data of the user's own, the demo runs: the dataclass
defaults plus ``run/demo.py``'s ``DEMO_OVERRIDES`` (written out in ``configs/default.yaml``).
"""

from __future__ import annotations

from densebatch.errors import UserError
from densebatch.run.configure import resolve_config

NO_OVERRIDES = {
    "generate": "it uses the checkpoint's configuration",
    "export": "it uses the run's configuration",
    "plot": "it reads the run's metrics.jsonl",
}


def dispatch(args, overrides: list[str]) -> int:
    """Each command imports what it needs when it runs: ``prepare`` and ``inspect`` never import torch."""
    cmd = args.command
    if cmd in ("prepare", "inspect"):
        from densebatch.run import data_commands  # late: the data layer only, no torch

        handler = data_commands.prepare_command if cmd == "prepare" else data_commands.inspect_command
        return handler(resolve_config(args.config, overrides), args)
    from densebatch.run import commands  # late (as below): these import torch, which prepare never needs
    from densebatch.run.auto import resolved_budget  # late
    from densebatch.run.find import find_batch_command, find_lr_command  # late
    from densebatch.run.plot import plot_command  # late
    from densebatch.run.training import train  # late

    if cmd in NO_OVERRIDES:
        if overrides:
            raise UserError(f"{cmd} takes no --section.key overrides: {NO_OVERRIDES[cmd]}")
        return {"generate": commands.generate_command, "export": commands.export_command, "plot": plot_command}[cmd](args)
    if cmd == "train":
        return train(args.config, overrides, resume=args.resume, overwrite=args.overwrite)
    if cmd == "find-lr":
        trials = [] if args.trials is None else [f"--finder.trials={args.trials}"]  # the flag for finder.trials
        return find_lr_command(args.config, [*overrides, *trials])
    if cmd == "find-batch":
        return find_batch_command(args.config, overrides)
    if cmd == "eval":  # CONFIG is optional: the run's own configuration decides what it owns
        return commands.eval_command(args, overrides)
    cfg = resolve_config(args.config, overrides, one_strategy=cmd != "analyze")  # analyze plans with every strategy
    if cmd == "analyze":  # it plans batches: an `auto` budget is the one a run found
        cfg = resolved_budget(cfg)
    handlers = {
        "analyze": commands.analyze_command,
        "config": commands.config_command,
    }
    return handlers[cmd](cfg, args)

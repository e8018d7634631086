"""Wiring: the only place that knows data, model and train; one function per CLI command.

``dispatch(args, overrides)`` is called by ``cli.main`` (which imports this package late, so that
``--help`` stays fast) with the parsed arguments and the ``--section.key=value`` overrides. Every
command that trains or probes a model builds it through ``run/build.py``; ``auto`` values resolve in
``run/auto.py``. With no config file and no data of the user's own, the demo runs: the dataclass
defaults plus ``run/demo.py``'s ``DEMO_OVERRIDES`` (written out in ``configs/default.yaml``).
"""

from __future__ import annotations

from densebatch.errors import UserError
from densebatch.run import commands
from densebatch.run.auto import resolved_budget
from densebatch.run.build import resolve_config
from densebatch.run.find import find_batch_command, find_lr_command
from densebatch.run.plot import plot_command
from densebatch.run.training import train

NO_OVERRIDES = {
    "generate": "it uses the checkpoint's configuration",
    "export": "it uses the run's configuration",
    "plot": "it reads the run's metrics.jsonl",
}


def dispatch(args, overrides: list[str]) -> int:
    cmd = args.command
    if cmd in NO_OVERRIDES:
        if overrides:
            raise UserError(f"{cmd} takes no --section.key overrides: {NO_OVERRIDES[cmd]}")
        return {"generate": commands.generate_command, "export": commands.export_command, "plot": plot_command}[cmd](args)
    if cmd == "train":
        return train(args.config, overrides, resume=args.resume, overwrite=args.overwrite)
    if cmd in ("find-lr", "find-batch"):
        return (find_lr_command if cmd == "find-lr" else find_batch_command)(args.config, overrides)
    if cmd == "eval":  # CONFIG is optional: the run's own configuration decides what it owns
        return commands.eval_command(args, overrides)
    cfg = resolve_config(args.config, overrides)
    if cmd == "analyze":  # it plans batches: an `auto` budget is the one a run found
        cfg = resolved_budget(cfg)
    handlers = {
        "prepare": commands.prepare_command,
        "inspect": commands.inspect_command,
        "analyze": commands.analyze_command,
        "config": commands.config_command,
    }
    return handlers[cmd](cfg, args)

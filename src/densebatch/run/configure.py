"""The run configuration a command starts from, without importing torch: ``prepare`` and the other data
commands need only this and the data layer (a cache hit answers in well under a second)."""

from __future__ import annotations

from densebatch.config import RunConfig, load_config, note
from densebatch.data.plan.rules import check_batching, unread_notes
from densebatch.data.prepare.tokenizers import resolve_tokenizer_spec
from densebatch.run.demo import DEMO_OVERRIDES, is_demo


def resolve_config(path: str | None, overrides: list[str], *, one_strategy: bool = True) -> RunConfig:
    """The run configuration: ``path`` (or, with neither a file nor data of one's own, the demo's
    settings) plus overrides, checked against the batching strategy's rules. Without a file but with
    ``--data.path``, the dataclass defaults apply. ``one_strategy``: the command plans with
    ``batching.strategy`` alone, so a key only other strategies read is noted (``analyze`` plans with all)."""
    demo = list(DEMO_OVERRIDES) if is_demo(path, overrides) else []
    cfg = load_config(path, overrides, defaults=demo)  # the demo's settings count as defaults: the user set none of them
    check_batching(cfg.batching)
    if one_strategy:
        base = load_config(None, demo).batching if demo else None
        for line in unread_notes(cfg.batching, sources=len(cfg.data.sources), source_balance=cfg.train.source_balance, base=base):
            note(line)
    # data.tokenizer auto: a Hugging Face model's own tokenizer when its directory has one (resolved
    # here, so the saved config names the tokenizer actually used).
    cfg.data.tokenizer = resolve_tokenizer_spec(cfg.data.tokenizer, cfg.model.path if cfg.model.kind == "hf" else None)
    if cfg.data.pairs == "auto" and cfg.train.objective != "sft":  # a preference objective reads pairs (saved so)
        cfg.data.pairs = True
    return cfg

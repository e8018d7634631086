"""A mixture's sources as the prepare stage reads them: one single-source ``DataConfig`` per source, and
their weights."""

from __future__ import annotations

import dataclasses

from densebatch.config import DataConfig, SourceConfig


def source_configs(cfg: DataConfig) -> list[tuple[str, DataConfig]]:
    """(name, single-source ``DataConfig``) of every source, in store order; ``data.path`` (or the
    embedded default) is one source. A source's unset keys follow ``data.*``."""
    if not cfg.sources:
        return [("default" if cfg.path is None else SourceConfig(path=cfg.path).label, cfg)]
    out = []
    for s in cfg.sources:
        one = dataclasses.replace(
            cfg,
            path=s.path,
            eval_path=s.eval_path,
            sources=[],
            format=s.format or cfg.format,
            template=s.template or cfg.template,
            fields=s.fields or cfg.fields,
            prompt_format=s.prompt_format if s.prompt_format is not None else cfg.prompt_format,
            loss_on=s.loss_on or cfg.loss_on,
        )
        out.append((s.label, one))
    return out


def mixture_weights(cfg: DataConfig) -> tuple[float, ...] | None:
    """The sources' weights, or None for natural shares (no weights set, or a single source)."""
    if len(cfg.sources) < 2 or cfg.sources[0].weight is None:
        return None
    return tuple(float(s.weight) for s in cfg.sources)

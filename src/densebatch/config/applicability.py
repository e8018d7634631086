"""The rule that no configuration key is silently ignored: how a key declares where it takes effect, and the walk that enforces it.

Every key declares a ``Rule`` (the declarations are in ``config/applies.py``): ``ALWAYS`` (it takes effect
under any settings), ``COMMANDS`` (read by the commands that take the same configuration: ``find-lr``,
``find-batch``), ``when(key, values)``, ``above(key)`` (a switch off at 0), or a ``Rule`` with its own
predicate. ``enforce`` walks every key set away from its default: one whose rule says it has no effect under
the run's settings is a ``ConfigError`` naming the key and the key(s) it depends on (``model.path`` with
``model.kind: gpt`` would silently train a randomly initialised reference GPT), or, where ignoring it is
harmless (a switch turned off beside its settings: ``model.lora.alpha`` while ``model.lora.r`` is 0; one
strategy's knob under another, as a file shared by ``analyze`` and several runs holds), a note line,
returned for the caller to print. Every rule but ``ALWAYS`` / ``COMMANDS`` carries ``on`` and ``off``:
settings under which it applies and does not, with which ``tests/test_config_applicability.py`` checks
that each declaration is enforced.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from densebatch.config.field import key_of
from densebatch.config.run_sections import RunConfig
from densebatch.errors import ConfigError


@dataclass(frozen=True)
class Rule:
    """Where a key takes effect. ``applies(cfg, value)``: whether ``value`` changes what a run with ``cfg``
    does (None: always); ``needs``: those settings in words, naming their keys; ``now(cfg)``: the settings
    that rule it out, as they are; ``harmless``: ignored, a note is enough; ``on`` / ``off``: settings
    ({dotted key: value}) under which it applies / does not, for the test; ``fix``: what to do instead; ``inert``:
    values that ask for what happens anyway where it has no effect (0 samples where there is no accuracy check),
    never refused nor noted."""

    applies: Callable[[RunConfig, Any], bool] | None
    needs: str
    now: Callable[..., str] = lambda cfg: ""
    harmless: bool = False
    on: dict = field(default_factory=dict)
    off: dict = field(default_factory=dict)
    fix: str = ""
    inert: tuple = ()  # values that say what happens anyway where the key has no effect (accuracy_samples: 0)


ALWAYS = Rule(None, "any settings")
COMMANDS = Rule(None, "densebatch find-lr / find-batch, and train.lr or batching.max_tokens_per_batch auto")
# A key some batching strategies read and others not: the strategies declare which (data/plan/strategies.py,
# Strategy.reads; config/ names no strategy's rules), and run/configure.py notes one the run's strategy ignores.
STRATEGY = Rule(None, "a batching.strategy that reads it (Strategy.reads, data/plan/strategies.py)")


def get(cfg: Any, key: str) -> Any:
    """The value of a dotted key (``checkpoint.async`` is the field ``async_``)."""
    for part in key.split("."):
        cfg = getattr(cfg, "async_" if part == "async" else part)
    return cfg


def when(key: str, *values: Any, harmless: bool = False, on: dict | None = None, off: dict, fix: str = "") -> Rule:
    """Applies while ``key`` is one of ``values``."""
    return Rule(
        lambda cfg, _: get(cfg, key) in values,
        f"{key} {' or '.join(str(v) for v in values)}",
        lambda cfg: f"{key} is {get(cfg, key)}",
        harmless,
        {key: values[0]} if on is None else on,
        off,
        fix,
    )


def above(key: str, *, on: Any = 1, base: dict | None = None) -> Rule:
    """Applies while ``key``, a switch that is off at 0, is above 0 (harmless when it is off); ``base``:
    settings both examples need."""
    return Rule(
        lambda cfg, _: (get(cfg, key) or 0) > 0,
        f"{key} > 0",
        lambda cfg: f"{key} is {get(cfg, key)} (off)",
        True,
        {**(base or {}), key: on},
        {**(base or {}), key: 0},
    )


# ------------------------------------------------------------------ the walk
def _default_of(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def set_keys(section: Any, prefix: str = "", base: Any = None) -> list[tuple[str, Any]]:
    """(dotted key, value) of every key of ``section`` (a dataclass) set away from its default (or from ``base``'s
    value: a section of the same class whose values count as defaults), the sections inside it walked
    (``data.sources``, a list, is one key; so is a source's ``fields``)."""
    out = []
    for f in dataclasses.fields(section):
        key = f"{prefix}.{key_of(f)}" if prefix else key_of(f)
        value, default = getattr(section, f.name), (_default_of(f) if base is None else getattr(base, f.name))
        if dataclasses.is_dataclass(default) and dataclasses.is_dataclass(value):
            out += set_keys(value, key, None if base is None else default)
        elif value != default:
            out.append((key, value))
    return out


def enforce(cfg: RunConfig, rules: dict[str, Rule], source_rules: dict[str, Rule], base: RunConfig | None = None) -> list[str]:
    """``ConfigError`` for the first key set away from its default where its rule says it has no effect and
    ignoring it is not harmless; otherwise the note lines of those where it is. ``rules``: by dotted key;
    ``source_rules``: by the key inside a ``data.sources`` item, judged as ``applies(cfg, (i, value))``;
    ``base``: a configuration whose values count as defaults (the demo's settings, which the user did not set)."""
    notes = []
    for key, value in set_keys(cfg, base=base):
        rule = rules[key]  # tests/test_config_applicability.py: every key has one
        if rule.applies is None or value in rule.inert or rule.applies(cfg, value):
            continue
        text = f"{key} ({_shown(value)}) has no effect: it applies under {rule.needs}, and {rule.now(cfg)}"
        if not rule.harmless:
            raise ConfigError(f"{text}; {rule.fix or 'remove it'}")
        notes.append(f"{text}: ignored")
    for i, source in enumerate(cfg.data.sources):
        for name, value in set_keys(source):
            rule = source_rules[name]
            if rule.applies is not None and not rule.applies(cfg, (i, value)):
                key = f"data.sources[{i}].{name}"
                raise ConfigError(
                    f"{key} ({_shown(value)}) has no effect: it applies to {rule.needs}, and {rule.now(cfg, i)}; remove it"
                )
    return notes


def _shown(value: Any) -> str:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return "set"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."

"""Loading a run configuration: YAML and ``--section.key=value`` overrides onto the sections, type by type, then the checks."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import math
import os
import sys
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from densebatch.config.applies import check_applicability
from densebatch.config.checks import _check
from densebatch.config.field import key_of
from densebatch.config.moved import refuse_moved, upgrade_saved
from densebatch.config.run_sections import RunConfig
from densebatch.errors import ConfigError


# ------------------------------------------------------------------------------- loading logic
def choices_of(tp: Any) -> tuple | None:
    """The allowed values of a ``Literal[...]`` field (or ``Literal[...] | None``); None otherwise."""
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        for a in typing.get_args(tp):
            if typing.get_origin(a) is Literal:
                return typing.get_args(a)
    return None


def _type_name(tp: Any) -> str:
    args = typing.get_args(tp)
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(map(str, args))
    if typing.get_origin(tp) is list:
        return f"a list (each {_type_name(args[0])})"
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in args)
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp``; ints are accepted where floats are expected."""
    if dataclasses.is_dataclass(tp):  # a section inside a list or an optional one: data.sources[1].fields
        return _build(tp, value, key)
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise ConfigError(f"{key}: expected one of {', '.join(map(str, typing.get_args(tp)))}; got {value!r}")
    if origin is list:
        if isinstance(value, str):  # from the command line: --train.report_to=tensorboard,csv (or [a, b])
            value = _list_from_text(value)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
        return [_coerce(f"{key}[{i}]", v, typing.get_args(tp)[0]) for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for a in args:
            if dataclasses.is_dataclass(a) and isinstance(value, dict):
                return _build(a, value, key)  # its own errors name the key inside it
            if a is type(None):
                continue
            try:
                return _coerce(key, value, a)
            except ConfigError:
                pass
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")


def _list_from_text(text: str) -> list:
    """A list given on the command line: YAML flow syntax (``["<|im_start|>", "x"]``, quotes removed as in a
    file) when it parses as a list, else comma-separated items (``tensorboard,csv``, ``[a, b]``)."""
    text = text.strip()
    if text.startswith("[") and text.endswith("]"):
        try:
            parsed = yaml.safe_load(text)
        except yaml.YAMLError:
            parsed = None
        if isinstance(parsed, list):
            return parsed
    return [v.strip() for v in text.strip("[]").split(",") if v.strip()]


def _build(cls: type, data: Any, prefix: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping of keys, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {key_of(f): f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    for name in unknown:
        refuse_moved(f"{prefix}.{name}" if prefix else name)
    if unknown:
        where = f"in section '{prefix}'" if prefix else "at the top level"
        close = difflib.get_close_matches(str(unknown[0]), list(fields), n=1, cutoff=0.6)
        hint = f"did you mean '{prefix + '.' if prefix else ''}{close[0]}'? " if close else ""
        raise ConfigError(
            f"unknown key '{prefix + '.' if prefix else ''}{unknown[0]}' {where}; {hint}expected one of: {', '.join(fields)}"
        )
    kwargs = {}
    for name, f in fields.items():
        key = f"{prefix}.{name}" if prefix else name
        if name not in data:
            continue
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = _build(tp, data[name], key)
            continue
        value = _coerce(key, data[name], tp)
        _check_number(key, value)
        minimum = f.metadata.get("minimum")
        if minimum is not None and isinstance(value, (int, float)) and value < minimum:  # not "auto"
            raise ConfigError(f"{key}: expected a value >= {minimum}; got {value!r}")
        kwargs[f.name] = value
    return cls(**kwargs)


INT_LIMIT = 2**63  # what numpy and torch hold (int64): a larger integer would overflow deep inside a run


def _check_number(key: str, value: Any) -> None:
    """Every float key is finite (a NaN or infinite rate would crash the optimizer, or train every weight to
    NaN and report success); every integer key fits in 64 bits."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}: expected a finite number; got {value!r}")
    if isinstance(value, int) and not isinstance(value, bool) and not -INT_LIMIT <= value < INT_LIMIT:
        raise ConfigError(f"{key}: expected an integer below 2**63 ({INT_LIMIT}); got {value}")


def parse_override(arg: str) -> tuple[list[str], Any]:
    """``--train.lr=3e-4`` → (["train", "lr"], 0.0003). Values are read as YAML scalars."""
    body = arg[2:] if arg.startswith("--") else arg
    if "=" not in body:
        raise ConfigError(f"override '{arg}': expected --section.key=value")
    key, raw = body.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, (dict, list)):
        value = raw  # a bare string like "[x]" is not a structure here
    return key.split("."), value


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    saved: bool = False,
    *,
    defaults: Sequence[str] = (),
) -> RunConfig:
    """Read ``path`` (YAML; None = defaults), apply overrides, validate. Raises ``ConfigError``. ``saved``:
    a configuration a run wrote (see ``config_from_dict``). ``defaults``: overrides applied first that count
    as defaults where a key set with no effect is judged (the demo's settings: the user did not set them)."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{path}' not found")
        try:
            data = _read_yaml(p.read_text(encoding="utf-8"), str(path)) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    base = _build(RunConfig, with_overrides({}, list(defaults)), "") if defaults else None
    return config_from_dict(with_overrides(data, [*defaults, *overrides]), saved, base=base)


def _read_yaml(text: str, where: str) -> Any:
    """``yaml.safe_load``, but a key repeated in one mapping is a ``ConfigError`` naming it and its line
    (PyYAML keeps the last one silently: ``train: {max_steps: 3}`` then ``train: {lr: 1}`` drops max_steps)."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _refuse_repeated_keys(node, where, "", set())
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _refuse_repeated_keys(node: yaml.Node, where: str, prefix: str, seen_nodes: set[int]) -> None:
    if id(node) in seen_nodes:  # an alias: its node was checked where its anchor is (and may refer to itself)
        return
    seen_nodes.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_repeated_keys(item, where, f"{prefix}[{i}]", seen_nodes)
    elif isinstance(node, yaml.MappingNode):
        lines: dict[str, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # <<: *base: the keys written here override the base's
                continue
            name = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else "?"
            key = f"{prefix}.{name}" if prefix else name
            line = key_node.start_mark.line + 1
            if name in lines:
                raise ConfigError(
                    f"{where}:{line}: duplicate key '{key}' (already set on line {lines[name]}; YAML would keep only "
                    "the last): write each key once"
                )
            lines[name] = line
            _refuse_repeated_keys(value_node, where, key, seen_nodes)


def with_overrides(data: dict, overrides: list[str] | tuple[str, ...] = ()) -> dict:
    """``data`` (a configuration as plain dicts, changed in place) with ``--section.key=value`` overrides applied."""
    for arg in overrides:
        keys, value = parse_override(arg)
        node = data
        for i, k in enumerate(keys):
            if isinstance(node, list):  # --data.sources.1.weight=3: an item of a list of sections
                if not k.isdigit() or int(k) >= len(node):
                    raise ConfigError(f"override '{arg}': '{k}' is not an index of '{keys[i - 1]}' (0 .. {len(node) - 1})")
                k = int(k)
            elif not isinstance(node, dict):
                raise ConfigError(f"override '{arg}': '{keys[i - 1]}' is not a section")
            if i == len(keys) - 1:
                node[k] = value
                break
            nxt = node[k] if isinstance(node, list) else node.get(k)
            if nxt is None:
                nxt = node[k] = {}
            node = nxt
    return data


def config_from_dict(data: dict, saved: bool = False, *, base: RunConfig | None = None) -> RunConfig:
    """Validate a plain dict (a parsed YAML file, or a config stored in a checkpoint). ``saved``: written by
    a run (a checkpoint's, ``output_dir/config.yaml``), whose moved keys are read at their new place. ``base``:
    whose values count as defaults where keys set with no effect are judged (``load_config``'s ``defaults``)."""
    cfg = _build(RunConfig, upgrade_saved(data) if saved else _mlm_targets(data), "")
    _check(cfg)
    if not saved:  # a saved run's keys were judged when it started (and older runs predate the rule)
        for line in check_applicability(cfg, base):
            note(line)
    return cfg


def note(line: str) -> None:
    """A one-line note on stderr (once under torchrun: rank 0's)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"densebatch: note: {line}", file=sys.stderr, flush=True)


def _mlm_targets(data: dict) -> dict:
    """Under ``batching.mode: mlm`` every real token may be masked and predicted, so ``data.loss_on`` (which
    tokens carry a causal loss) is ``all``: unset (on data and each source), it becomes ``all``; set to
    ``response``, ``ConfigError`` (it would drop the records whose response a cut removed, and mask
    nothing differently). A saved run keeps what it was prepared with."""
    batching, d = data.get("batching"), data.get("data")
    if not isinstance(batching, dict) or batching.get("mode") != "mlm" or not isinstance(d, (dict, type(None))):
        return data
    d = dict(d or {})
    sources = d.get("sources") if isinstance(d.get("sources"), list) else []
    for key, value in [("data.loss_on", d.get("loss_on"))] + [
        (f"data.sources[{i}].loss_on", s.get("loss_on")) for i, s in enumerate(sources) if isinstance(s, dict)
    ]:
        if value not in (None, "all"):
            raise ConfigError(
                f"{key}: {value!r} picks the tokens of a causal loss; under batching.mode mlm every token may be masked "
                "and predicted: leave it unset (all)"
            )
    d["loss_on"] = "all"
    return {**data, "data": d}


def to_dict(cfg: Any) -> Any:
    """The configuration as plain data, keyed as in YAML (``key_of``)."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {key_of(f): to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (list, tuple)):
        return type(cfg)(to_dict(v) for v in cfg)
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return copy.deepcopy(cfg)


def save_config(cfg: RunConfig, path: str | Path) -> None:
    """Write the resolved configuration as YAML (re-loadable with ``load_config``)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False), encoding="utf-8")


def config_fingerprint(section: Any) -> str:
    """Stable JSON of a config section, for cache keys."""
    return json.dumps(dataclasses.asdict(section), sort_keys=True)


def describe(cls: type = RunConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, default, help) for every field, for ``densebatch config --help-keys`` and the docs."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{key_of(f)}" if prefix else key_of(f)
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(describe(tp, key))
            continue
        item = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
        if dataclasses.is_dataclass(item):  # a list of sections: the list, then each item's keys
            rows.append((key, "[]", f.metadata.get("help", "")))
            rows.extend(describe(item, f"{key}[i]"))
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.default_factory is not dataclasses.MISSING:  # a list: show its empty default, not null
            default = f.default_factory()
        help_ = f.metadata.get("help", "")
        if (choices := choices_of(tp)) is not None:
            help_ += f" [{' | '.join(map(str, choices))}]"
        rows.append((key, json.dumps(default), help_))
    return rows

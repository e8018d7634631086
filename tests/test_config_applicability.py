"""No key is silently ignored: every configuration key declares where it takes effect, and a key set where it
has none is refused in one line naming it and what it depends on, or noted where ignoring it is harmless."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml

from densebatch.cli import main
from densebatch.config import ConfigError, RunConfig, choices_of, config_from_dict, describe, load_config
from densebatch.config.applicability import ALWAYS, COMMANDS, STRATEGY, Rule
from densebatch.config.applies import APPLIES, CORPUS, SOURCE_APPLIES, check_applicability
from densebatch.config.data_sections import BatchingConfig, SourceConfig
from densebatch.data.plan.rules import STRATEGY_KEYS, unread_notes
from densebatch.data.plan.strategies import STRATEGIES

REPO = Path(__file__).resolve().parents[1]
SOURCE = "data.sources[i]."
NOTE = "densebatch: note: "
HOW = (
    "declare where it takes effect in src/densebatch/config/applies.py: in APPLIES (SOURCE_APPLIES for a key of a "
    'data.sources item), "{key}": ALWAYS if it changes what a run does under any settings, COMMANDS if only '
    'find-lr / find-batch read it, or when("other.key", values..., off={{...}}) / above("switch") / a Rule '
    "naming the settings under which it does (harmless=True where ignoring it needs only a note), with on / off "
    "examples; see config/applicability.py"
)


def keys() -> list[str]:
    return [k for k, _, _ in describe()]


def test_every_key_declares_where_it_takes_effect():
    missing = [k for k in keys() if (k[len(SOURCE) :] not in SOURCE_APPLIES if k.startswith(SOURCE) else k not in APPLIES)]
    assert not missing, "\n".join(f"{k}: no applicability declared; " + HOW.format(key=k.removeprefix(SOURCE)) for k in missing)
    stale = sorted(set(APPLIES) - set(keys())) + sorted(set(SOURCE_APPLIES) - {k[len(SOURCE) :] for k in keys()})
    assert not stale, f"declared for keys that do not exist: {stale}"


def test_every_rule_that_can_rule_a_key_out_says_where_with_examples():
    for key, rule in APPLIES.items():
        if rule in (ALWAYS, COMMANDS, STRATEGY):
            continue
        assert rule.off or rule.on, f"{key}: a Rule needs on / off settings (where it applies and where it does not)"
        assert rule.needs and "." in rule.needs, f"{key}: needs should name the key(s) it depends on: {rule.needs!r}"


# ------------------------------------------------------------------ each declaration, enforced
EXAMPLES: dict[str, Any] = {  # a value away from the default that passes the other checks, where the type's would not
    "data.bytes_dtype": "int64",
    "data.prompt_format": "Q: {question}\nA: ",
    "data.clean.near_threshold": 0.9,
    "data.clean.dedupe": "exact",
    "data.template": "chatml",
    "batching.mlm_probability": 0.3,
    "model.attention": "segmented",
    "model.n_head": 8,
    "model.n_embd": 256,
    "model.dtype": "bfloat16",
    "model.lora.dropout": 0.1,
    "train.batch_schedule.backoff_factor": 0.25,
    "train.batch_schedule.backoff_floor": 0.5,
    "train.batch_schedule.ramp_start": 0.5,
    "train.health.data_wait_share": 0.5,
    "train.optimizer.decay_all": True,
}


def _field_of(key: str) -> tuple[dataclasses.Field, Any]:
    cls, f = RunConfig, None
    hints: dict = {}
    for part in key.split("."):
        hints = typing.get_type_hints(cls)
        f = next(x for x in dataclasses.fields(cls) if x.metadata.get("key", x.name) == part)
        cls = hints[f.name]
    return f, hints[f.name]


def example(key: str) -> Any:
    """A value of ``key`` other than its default that its own checks accept."""
    if key in EXAMPLES:
        return EXAMPLES[key]
    f, tp = _field_of(key)
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    other = [c for c in choices_of(tp) or () if c not in (default, "auto")]
    if other:
        return other[0]
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    if isinstance(default, float):
        return default / 2 if default else 0.5
    if isinstance(default, list):
        return ["x"]
    args = typing.get_args(tp)
    return 3 if int in args else 0.5 if float in args else "x"


def nested(settings: dict[str, Any]) -> dict:
    """{dotted key: value} as a configuration's nested dict."""
    out: dict = {}
    for key, value in settings.items():
        *path, last = key.split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[last] = copy.deepcopy(value)
    return out


def judged(settings: dict[str, Any]) -> tuple[str | None, list[str]]:
    """(the refusal's message or None, the note lines) of a configuration of ``settings``, loaded as a command loads it."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            config_from_dict(nested(settings))
    except ConfigError as e:
        return str(e), []
    lines = err.getvalue().splitlines()
    assert all(line.startswith(NOTE) for line in lines), lines
    return None, [line[len(NOTE) :] for line in lines]


COMPANIONS = ("data.path", "model.path")
RULED = [k for k, r in APPLIES.items() if r not in (ALWAYS, COMMANDS, STRATEGY)]


@pytest.mark.parametrize("key", RULED)
def test_a_key_where_it_has_no_effect_is_refused_or_noted_and_accepted_where_it_has(key):
    rule: Rule = APPLIES[key]
    value = example(key)
    # what rules it in or out (a path only completes the settings: model.kind hf needs a model.path)
    depends = [k for k in {**rule.on, **rule.off} if k not in COMPANIONS and rule.on.get(k) != rule.off.get(k)]
    if value in rule.inert:  # its only other value asks for what happens anyway there
        assert judged({**rule.off, key: value}) == (None, [])
    elif rule.off or not rule.on:
        refused, notes = judged({**rule.off, key: value})
        if rule.harmless:
            assert refused is None, refused
            assert len(notes) == 1 and notes[0].startswith(f"{key} (") and "ignored" in notes[0], notes
            said = notes[0]
        else:
            assert refused is not None and refused.startswith(f"{key} (") and "\n" not in refused, refused
            said = refused
        assert "has no effect" in said and all(d.split(".")[-1] in said for d in depends), (said, depends)
    if rule.on or not rule.off:
        refused, notes = judged({**rule.on, key: value})
        assert refused is None and not any(n.startswith(f"{key} (") for n in notes), (refused, notes)


@pytest.mark.parametrize(
    "key, rule",
    [(k, r) for k, r in APPLIES.items() if r in (ALWAYS, COMMANDS)][::7],  # a sample: these never refuse
)
def test_a_key_that_always_applies_is_never_refused(key, rule):
    refused, notes = judged({key: example(key)})  # another rule may refuse the value alone (batching.mode mlm)
    assert notes == [] and (refused is None or "has no effect" not in refused), refused


def test_a_source_key_is_judged_on_its_own_source():
    corpus = {"path": "corpus", "format": "megatron"}
    for name, value in (("template", "chatml"), ("loss_on", "all"), ("prompt_format", "Q: {q}")):
        refused, _ = judged({"data.sources": [{"path": "a.json"}, {**corpus, name: value}]})
        assert refused and refused.startswith(f"data.sources[1].{name} (") and "format megatron" in refused, refused
    assert judged({"data.sources": [{"path": "a.json", "template": "chatml"}, corpus]}) == (None, [])
    assert judged({"data.sources": [{"path": "a.txt", "format": "text", "template": "raw"}]}) == (None, [])
    refused, _ = judged({"data.sources": [{"path": "a.txt", "format": "text", "template": "alpaca"}]})
    assert refused and "data.sources[0].template" in refused
    assert set(SOURCE_APPLIES) == {f.name for f in dataclasses.fields(SourceConfig)}


def test_a_mixture_reads_data_keys_only_where_a_source_leaves_them_unset():
    both = [{"path": "a.json", "template": "alpaca"}, {"path": "b.jsonl", "template": "chatml"}]
    assert judged({"data.sources": both, "data.fields.messages": "turns"}) == (None, [])  # b's chatml reads it
    own = [{"path": "a.json", "template": "alpaca", "fields": {"instruction": "q"}}, {"path": "b.json", "template": "alpaca"}]
    refused, _ = judged({"data.sources": own[:1], "data.fields.instruction": "question"})
    assert refused and refused.startswith("data.fields.instruction (")  # its one source maps its own fields
    assert judged({"data.sources": own, "data.fields.instruction": "question"}) == (None, [])


# ------------------------------------------------------------------ shipped settings, and the command line
@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_set_no_key_where_it_has_no_effect(path):
    assert check_applicability(load_config(path)) == []


def test_the_demo_sets_no_key_where_it_has_no_effect(capsys):
    from densebatch.run.configure import resolve_config

    check_applicability(resolve_config(None, []))
    assert "note:" not in capsys.readouterr().err


def test_model_path_under_the_reference_gpt_exits_2_in_one_line(tmp_path, monkeypatch, capsys):
    """The issue's check: an empty model directory given without model.kind hf (the default is gpt, which reads
    model.path as a saved reference GPT): refused before any data is prepared, naming both keys."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    assert main(["train", f"--model.path={tmp_path / 'empty'}", "--train.max_steps=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.path" in err[0] and "model.kind" in err[0] and err[0].startswith("densebatch: error:"), err
    assert not (tmp_path / ".densebatch-cache").exists()  # refused before the data was prepared


def test_a_harmless_key_is_one_note_on_stderr_and_the_run_goes_on(capsys):
    cfg = load_config(None, ["--model.kind=hf", "--model.path=m", "--model.lora.alpha=32"])
    assert cfg.model.lora.alpha == 32
    assert capsys.readouterr().err.strip().splitlines() == [
        "densebatch: note: model.lora.alpha (32.0) has no effect: it applies under model.lora.r > 0, and model.lora.r "
        "is 0 (off): ignored"
    ]


# ------------------------------------------------------------------ keys the batching strategies read
def test_the_strategies_declare_the_keys_only_some_of_them_read():
    """config/ names no strategy's rules: the STRATEGY keys are those some strategies read (Strategy.reads)."""
    declared = {k.removeprefix("batching.") for k, r in APPLIES.items() if r is STRATEGY and k.startswith("batching.")}
    assert declared == set(STRATEGY_KEYS)
    for key in STRATEGY_KEYS:
        readers = [s for s in STRATEGIES.values() if key in s.reads]
        assert 0 < len(readers) < len(STRATEGIES), key


@pytest.mark.parametrize("key", STRATEGY_KEYS)
def test_a_key_the_runs_strategy_does_not_read_is_noted(key):
    value = {"rows_per_batch": 3, "max_tokens_per_batch": 1024, "seq_len": 256, "long_docs": "truncate"}.get(key)
    value = {"mega_batch_mult": 7, "bundle_tokens": 0, "drop_last": True}.get(key, value)
    for name, strategy in STRATEGIES.items():
        b = dataclasses.replace(BatchingConfig(strategy=name), **{key: value})
        said = unread_notes(b, sources=1, source_balance="batches")
        if key in strategy.reads:
            assert said == [], (name, said)
        else:
            assert len(said) == 1 and said[0].startswith(f"batching.{key} (") and f"batching.strategy is {name}" in said[0]


def test_a_mixtures_source_weighting_reads_rows_per_batch_and_source_balance():
    packed = BatchingConfig(strategy="packed", rows_per_batch=4)
    assert unread_notes(packed, sources=2, source_balance="batches") == []  # random batches of 4 weigh the sources
    assert unread_notes(packed, sources=1, source_balance="batches")[0].startswith("batching.rows_per_batch (4)")
    assert unread_notes(BatchingConfig(strategy="packed"), sources=2, source_balance="tokens") == []
    said = unread_notes(BatchingConfig(strategy="random"), sources=2, source_balance="tokens")
    assert len(said) == 1 and said[0].startswith("train.source_balance ('tokens') has no effect")


def test_a_command_that_plans_with_one_strategy_notes_another_strategys_key(capsys):
    from densebatch.run.configure import resolve_config

    resolve_config(None, ["--data.path=x.json", "--batching.strategy=random", "--batching.seq_len=512"])
    assert capsys.readouterr().err.strip().splitlines() == [
        "densebatch: note: batching.seq_len (512) has no effect: it applies under batching.strategy packed, and "
        "batching.strategy is random: ignored"
    ]
    resolve_config(None, ["--data.path=x.json", "--batching.strategy=random", "--batching.seq_len=512"], one_strategy=False)
    assert capsys.readouterr().err == ""  # analyze plans with every strategy


def test_a_value_that_asks_for_what_happens_anyway_is_neither_refused_nor_noted():
    assert judged({"data.path": "x.json", "eval.accuracy_samples": 0}) == (None, [])  # no accuracy check either way
    assert judged({**CORPUS, "data.loss_on": "all"}) == (None, [])
    assert judged({"data.path": "x.json", "eval.accuracy_samples": 50})[1]  # a number of samples is noted


def test_a_saved_run_is_not_judged_again(tmp_path):
    """A run's saved configuration (resume, eval, generate) is read as it ran, even one an older version let
    ignore a key."""
    saved = nested({"model.kind": "hf", "model.path": str(tmp_path), "model.n_layer": 2, "train.max_steps": 2})
    assert config_from_dict(saved, saved=True).model.n_layer == 2
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        config_from_dict(yaml.safe_load(yaml.safe_dump(saved)))
    assert "model.n_layer (2) has no effect" in err.getvalue()

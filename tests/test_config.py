"""Run configuration: YAML + overrides map onto dataclasses; mistakes name the key; every shipped config loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from densebatch.config import ConfigError, RunConfig, describe, load_config, save_config

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)


def test_default_yaml_is_the_embedded_default():
    """configs/default.yaml writes out exactly what `densebatch train` runs with no config."""
    from densebatch.run.build import resolve_config

    assert load_config(REPO / "configs" / "default.yaml") == resolve_config(None, [])


def test_overrides_apply_with_types():
    cfg = load_config(
        None,
        [
            "--train.max_steps=20",
            "--batching.strategy=token_budget",
            "--train.lr=3e-4",
            "--data.clean.nfkc=true",
            "--model.kind=hf",
            "--model.path=x/y",
            "--seed=7",
        ],
    )
    assert cfg.train.max_steps == 20 and cfg.batching.strategy == "token_budget"
    assert cfg.train.lr == pytest.approx(3e-4) and cfg.data.clean.nfkc is True
    assert cfg.model.path == "x/y" and cfg.seed == 7


def test_override_beats_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  max_steps: 5\n")
    assert load_config(p, ["--train.max_steps=9"]).train.max_steps == 9


@pytest.mark.parametrize(
    "override, needle",
    [
        ("--train.max_stepz=3", "train.max_stepz"),
        ("--train.max_steps=abc", "train.max_steps: expected an integer"),
        ("--batching.strategy=bogus", "batching.strategy: expected one of"),
        ("--train.lr=-1", "train.lr: expected a value >= 0"),
        ("--train.precision=fp8", "train.precision"),
        ("--nosuch.key=1", "nosuch"),
        ("--train=3", "train: expected a mapping"),
        ("--train.progress=maybe", "train.progress: expected true or false"),
    ],
)
def test_mistakes_name_the_key(override, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.").replace("(", r"\(")):
        load_config(None, [override])


def test_cross_field_rules():
    with pytest.raises(ConfigError, match="model.path"):
        load_config(None, ["--model.kind=hf"])
    with pytest.raises(ConfigError, match="prompt_format"):
        load_config(None, ["--data.template=custom"])


def test_bad_yaml_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["--train.max_steps=11", "--data.path=a.jsonl"])
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg


def test_every_field_is_documented():
    for key, _default, help_ in describe():
        assert help_.strip(), f"{key} has no help text"


def test_configuration_doc_is_current():
    from densebatch.run.commands import config_markdown

    doc = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert doc == config_markdown(), "regenerate: densebatch config --keys --markdown > docs/configuration.md"


@pytest.mark.parametrize(
    "arg, want",
    [
        ('--data.add_special_tokens=["<|im_start|>", "<|im_end|>"]', ["<|im_start|>", "<|im_end|>"]),
        ("--data.add_special_tokens=<|im_start|>,<|im_end|>", ["<|im_start|>", "<|im_end|>"]),
        ("--data.add_special_tokens=[a, b]", ["a", "b"]),
        ("--data.add_special_tokens=[<|x|>]", ["<|x|>"]),  # not YAML: the comma-separated reading
    ],
)
def test_list_overrides_read_like_the_file(arg, want):
    """A list in YAML flow syntax on the command line means what it means in a file (no quotes kept)."""
    assert load_config(None, [arg]).data.add_special_tokens == want
    assert load_config(None, ["--train.report_to=tensorboard,csv"]).train.report_to == ["tensorboard", "csv"]


def test_mlm_takes_every_token_as_a_target():
    """batching.mode mlm: data.loss_on (a causal setting) is all when unset; response is refused in one line
    (on data or a source); a saved run keeps what it was prepared with."""
    from densebatch.config.loading import config_from_dict

    mlm = ["--batching.mode=mlm", "--model.kind=hf", "--model.path=x"]
    assert load_config(None, mlm).data.loss_on == "all"
    assert load_config(None, [*mlm, "--data.loss_on=all"]).data.loss_on == "all"
    assert load_config(None, ["--model.kind=hf", "--model.path=x"]).data.loss_on == "response"  # causal: unchanged
    with pytest.raises(ConfigError, match=r"^data.loss_on: 'response' .* leave it unset"):
        load_config(None, [*mlm, "--data.loss_on=response"])
    two = {"sources": [{"path": "a.jsonl"}, {"path": "b.jsonl", "loss_on": "response"}]}
    with pytest.raises(ConfigError, match=r"^data.sources\[1\].loss_on"):
        config_from_dict({"data": two, "batching": {"mode": "mlm"}, "model": {"kind": "hf", "path": "x"}})
    saved = {"data": {"loss_on": "response"}, "batching": {"mode": "mlm"}, "model": {"kind": "hf", "path": "x"}}
    assert config_from_dict(saved, saved=True).data.loss_on == "response"

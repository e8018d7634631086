"""Bad values that passed validation and then crashed with a traceback (or, worse, trained to NaN): each is
now one line naming the key (``ConfigError``, exit code 2), refused before any work.

Non-finite numbers in any float key, ranges torch enforces (dropout, AdamW's betas), seeds and integers
beyond 64 bits, custom prompt formats with conversions or format specs, a device or attention kernel this
machine cannot train with, the sampling settings of ``densebatch generate``, and YAML files that repeat a key.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from cli_args import TINY

from densebatch.cli import main
from densebatch.config import load_config
from densebatch.errors import ConfigError, UserError
from densebatch.model import generate_batch
from densebatch.testing.models import tiny_gpt

BIG = "99999999999999999999999"


# ----------------------------------------------------------------------------- one key, one value
@pytest.mark.parametrize(
    "override, key",
    [
        ("--train.lr=nan", "train.lr"),
        ("--train.lr=inf", "train.lr"),
        ("--train.lr=-inf", "train.lr"),
        ("--train.lr=.nan", "train.lr"),
        ("--train.min_lr_ratio=nan", "train.min_lr_ratio"),
        ("--train.blocks.min_lr_ratio=inf", "train.blocks.min_lr_ratio"),
        ("--train.lr_mult_head=inf", "train.lr_mult_head"),
        ("--finder.lr_start=nan", "finder.lr_start"),
        ("--finder.lr_end=inf", "finder.lr_end"),
        ("--train.grad_clip=nan", "train.grad_clip"),
        ("--train.max_epochs=inf", "train.max_epochs"),
        ("--train.optimizer.weight_decay=nan", "train.optimizer.weight_decay"),
        ("--model.dropout=2", "model.dropout"),
        ("--model.dropout=1", "model.dropout"),
        ("--train.optimizer.beta1=1.5", "train.optimizer.beta1"),
        ("--train.optimizer.beta2=1", "train.optimizer.beta2"),
        (f"--seed={BIG}", "seed"),
        (f"--seed={2**63}", "seed"),
        ("--seed=-1", "seed"),
        (f"--data.default.seed={BIG}", "data.default.seed"),
        (f"--batching.max_tokens_per_batch={BIG}", "batching.max_tokens_per_batch"),
        (f"--train.max_steps={BIG}", "train.max_steps"),
    ],
)
def test_bad_value_is_a_config_error_naming_the_key(override, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value).startswith(f"{key}:"), str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("override", ["--seed=0", f"--seed={2**63 - 1}", "--train.optimizer.beta2=0.999", "--model.dropout=0.5"])
def test_values_at_the_edges_still_load(override):
    load_config(None, [override])


def test_a_non_finite_source_weight_names_the_source(tmp_path):
    (tmp_path / "c.yaml").write_text("data:\n  sources:\n    - {path: a.jsonl, weight: .nan}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"^data\.sources\[0\]\.weight: .*finite"):
        load_config(tmp_path / "c.yaml")


# ----------------------------------------------------------------------------- custom prompt formats
@pytest.mark.parametrize(
    "fmt, says",
    [
        ("Q: {instruction:d}\nA: ", ":d"),
        ("Q: {instruction!x}\nA: ", "!x"),
        ("Q: {instruction!r}\nA: ", "!r"),
        ("Q: {instruction:{output}}\nA: ", "{output}"),
        ("Q: {instruction:>999999999}\nA: ", ">999999999"),
    ],
)
def test_prompt_format_refuses_conversions_and_format_specs(fmt, says):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--data.template=custom", f"--data.prompt_format={fmt}"])
    msg = str(e.value)
    assert msg.startswith("data.prompt_format:") and says in msg and "{instruction}" in msg, msg
    assert "\n" not in msg


def test_a_source_prompt_format_error_names_the_source_key(tmp_path):
    (tmp_path / "c.yaml").write_text(
        "data:\n  sources:\n    - {path: a.jsonl, template: custom, prompt_format: 'Q: {q!s}'}\n", encoding="utf-8"
    )
    with pytest.raises(ConfigError, match=r"^data\.sources\[0\]\.prompt_format: .*!s"):
        load_config(tmp_path / "c.yaml")


def test_the_template_renders_a_plain_prompt_format_as_before():
    from densebatch.data.prepare.templates import render_text

    cfg = load_config(None, ["--data.template=custom", "--data.prompt_format=Q: {q} {{x}}\nA: "]).data
    assert render_text({"q": "2+2", "output": "4"}, cfg) == "Q: 2+2 {x}\nA: 4"


# ----------------------------------------------------------------------------- the CLI: exit 2, one line
def _train(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "train",
        *TINY,
        "--train.max_steps=2",
        f"--output_dir={tmp_path / 'run'}",
        f"--data.cache_dir={tmp_path / 'c'}",
        *extra,
    ]


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    "extra, key",
    [
        (["--train.lr=nan"], "train.lr"),
        (["--train.lr=inf"], "train.lr"),
        (["--model.dropout=2"], "model.dropout"),
        (["--train.optimizer.beta1=1.5"], "train.optimizer.beta1"),
        ([f"--seed={BIG}"], "seed"),
    ],
)
def test_cli_refuses_bad_values_in_one_line(tmp_path, capsys, extra, key):
    assert main(_train(tmp_path, *extra)) == 2
    assert f"error: {key}:" in _one_line(capsys)
    assert not (tmp_path / "c").exists()  # refused before any data was prepared


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_device_without_cuda_is_one_line(tmp_path, capsys):
    assert main(_train(tmp_path, "--train.device=cuda")) == 2
    err = _one_line(capsys)
    assert "train.device" in err and "CUDA" in err
    assert not (tmp_path / "c").exists()
    from densebatch.errors import ConfigError
    from densebatch.run.build import usable_device  # what densebatch eval's device goes through too

    with pytest.raises(ConfigError, match="train.device: cuda is not available here"):
        usable_device("cuda")


@pytest.mark.parametrize("kernel", ["flex", "varlen"])
def test_attention_that_cannot_train_on_cpu_is_one_line(tmp_path, capsys, kernel):
    assert main(_train(tmp_path, "--train.device=cpu", f"--model.attention={kernel}")) == 2
    err = _one_line(capsys)
    assert "model.attention" in err and kernel in err
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize(
    "extra, key",
    [
        (["--temperature", "nan"], "--temperature"),
        (["--temperature", "inf"], "--temperature"),
        (["--temperature", "-1"], "--temperature"),
        (["--top-k", "-3"], "--top-k"),
        (["--top-k", "0"], "--top-k"),
    ],
)
def test_generate_refuses_bad_sampling_settings(tmp_path, capsys, extra, key):
    args = ["generate", "--checkpoint", str(tmp_path / "none"), "--prompt", "hi", *extra]
    assert main(args) == 2
    assert f"error: {key}:" in _one_line(capsys)


# ----------------------------------------------------------------------------- generate_batch itself
@pytest.fixture(scope="module")
def model():
    return tiny_gpt(64).eval()


@pytest.mark.parametrize(
    "kw, key", [({"temperature": math.nan}, "temperature"), ({"temperature": -0.5}, "temperature"), ({"top_k": 0}, "top_k")]
)
def test_generate_batch_refuses_bad_sampling_settings(model, kw, key):
    with pytest.raises(UserError, match=rf"^generate: {key}"):
        generate_batch(model, [[5, 6, 7]], 4, **{"temperature": 1.0, **kw})


def test_a_tiny_temperature_samples_the_most_likely_token(model):
    greedy = generate_batch(model, [[5, 6, 7]], 6)
    g = torch.Generator().manual_seed(0)
    assert generate_batch(model, [[5, 6, 7]], 6, temperature=1e-300, top_k=3, generator=g) == greedy


# ----------------------------------------------------------------------------- YAML files that repeat a key
@pytest.mark.parametrize(
    "text, key, line",
    [
        ("train:\n  max_steps: 3\nseed: 1\ntrain:\n  lr: 1\n", "train", 4),
        ("train:\n  lr: 0.1\n  max_steps: 3\n  lr: 0.2\n", "train.lr", 4),
        ("train:\n  optimizer: {beta1: 0.9, beta1: 0.8}\n", "train.optimizer.beta1", 2),
        ("data:\n  sources:\n    - path: a.jsonl\n      path: b.jsonl\n", "data.sources[0].path", 4),
    ],
)
def test_a_repeated_yaml_key_is_one_line_naming_key_and_line(tmp_path, text, key, line):
    path = tmp_path / "c.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert f"{path}:{line}:" in msg and f"'{key}'" in msg and "\n" not in msg, msg


def test_repeated_yaml_key_on_the_command_line_exits_2(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("train: {max_steps: 3}\ntrain: {lr: 1}\n", encoding="utf-8")
    assert main(["config", str(tmp_path / "c.yaml")]) == 2
    assert "duplicate key 'train'" in _one_line(capsys)


def test_yaml_merge_keys_and_anchors_still_load(tmp_path):
    (tmp_path / "m.yaml").write_text(
        "data:\n  sources:\n    - &s {path: a.jsonl, template: raw}\n    - {<<: *s, path: b.jsonl}\n", encoding="utf-8"
    )
    cfg = load_config(tmp_path / "m.yaml")
    assert [s.path for s in cfg.data.sources] == ["a.jsonl", "b.jsonl"]
    assert cfg.data.sources[1].template == "raw"

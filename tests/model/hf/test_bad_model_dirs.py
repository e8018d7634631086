"""Saved-model directories with damaged files: one ``ConfigError`` line naming the file and what is wrong, never a
traceback. A run's final model (config.json, densebatch_tokenizer.json) as ``generate`` / ``eval`` / ``export``
read it, and ``model.kind: hf`` directories (config.json, model.safetensors) as the adapter builds them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from densebatch.cli import main
from densebatch.data.prepare.learned_bpe import train_bpe
from densebatch.data.prepare.tokenizers import SAVED_META, load_tokenizer
from densebatch.errors import ConfigError
from densebatch.model import load_model
from densebatch.testing.models import tiny_config, tiny_gpt

TEXTS = ["the cat sat on the mat", "a dog ran in the park", "the end of the text"] * 20


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A final model as a run writes it: the reference GPT and its (byte-level) tokenizer."""
    d = tmp_path_factory.mktemp("saved") / "final"
    tok = load_tokenizer("default")
    tiny_gpt(tok.vocab_size).save(d)
    tok.save(d)
    return d


@pytest.fixture
def final(saved, tmp_path) -> Path:
    """A copy of ``saved`` for one test to damage."""
    return Path(shutil.copytree(saved, tmp_path / "final"))


def edit(file: Path, **changes) -> None:
    """Set ``changes`` in the JSON object ``file`` holds."""
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))


def refused(capsys, *args: str) -> str:
    """The one line the CLI prints for ``args`` (after asserting exit code 2, no traceback)."""
    capsys.readouterr()
    assert main(list(args)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1 and err.startswith("densebatch: error: "), err
    return err.removeprefix("densebatch: error: ").rstrip("\n")


# ------------------------------------------------------------------------- densebatch_tokenizer.json
NOT_TOKENIZER = "is not a tokenizer densebatch saved"


@pytest.mark.parametrize(
    "text, why",
    [
        ("junk", "not valid JSON (Expecting value: line 1 column 1 (char 0))"),
        ("[1]", "expected a JSON object; got a list"),
        ('{"kind": "byte", "added": 5}', "added must be a list of [text, special] pairs (got 5)"),
        ('{"kind": "byte", "added": [["<x>"]]}', "added must be a list of [text, special] pairs (got ['<x>'])"),
        ('{"kind": "byte", "pad_id": "x"}', "pad_id must be an integer or null (got 'x')"),
        ('{"kind": "tiktoken"}', "kind must be 'byte' or 'hf' (got 'tiktoken')"),
    ],
)
def test_a_damaged_byte_tokenizer_meta_is_named(final, text, why):
    (final / SAVED_META).write_text(text)
    with pytest.raises(ConfigError) as e:
        load_tokenizer(final)
    assert str(e.value) == f"{final / SAVED_META} {NOT_TOKENIZER}: {why}"


@pytest.fixture
def bpe_dir(tmp_path) -> Path:
    d = tmp_path / "bpe"
    train_bpe(TEXTS, vocab_size=300).save(d)
    return d


@pytest.mark.parametrize(
    "changes, why",
    [
        ({"added": 5}, 'added must be a list of {"content", "id", "special"} objects (got 5)'),
        (
            {"added": [{"content": "<x>"}]},
            'added must be a list of {"content", "id", "special"} objects (got {\'content\': \'<x>\'})',
        ),
        ({"base_vocab_size": "x"}, "base_vocab_size must be a positive integer (got 'x')"),
        ({"eos_token": 3}, "eos_token must be a string (got 3)"),
        ({"mask_token": ["<m>"]}, "mask_token must be a string or null (got ['<m>'])"),
    ],
)
def test_a_damaged_hf_tokenizer_meta_is_named(bpe_dir, changes, why):
    assert load_tokenizer(bpe_dir).name == "bpe:300"  # as saved, it loads
    edit(bpe_dir / SAVED_META, **changes)
    with pytest.raises(ConfigError) as e:
        load_tokenizer(bpe_dir)
    assert str(e.value) == f"{bpe_dir / SAVED_META} {NOT_TOKENIZER}: {why}"


# --------------------------------------------------------------------------------- GPT config.json
NOT_GPT = "is not a model configuration densebatch saved"


def test_a_config_that_is_not_an_object_is_named(final):
    (final / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError) as e:
        load_model(final)
    assert str(e.value) == f"{final / 'config.json'} is not a model configuration: expected a JSON object; got a list"


@pytest.mark.parametrize(
    "changes, why",
    [
        ({"vocab_size": "x"}, "vocab_size must be a positive integer (got 'x')"),
        ({"n_head": 0}, "n_head must be a positive integer (got 0)"),
        ({"n_layer": 1.5}, "n_layer must be a positive integer (got 1.5)"),
        ({"block_size": True}, "block_size must be a positive integer (got True)"),
        ({"n_embd": 30}, "n_embd (30) must be a multiple of n_head (4)"),
        ({"dropout": 2}, "dropout must be a number in [0, 1) (got 2)"),
        ({"attention": "fast"}, "attention must be one of auto, flex, varlen, segmented, masked (got 'fast')"),
        ({"loss_head": 1}, "loss_head must be one of fused, plain (got 1)"),
        ({"gradient_checkpointing": "no"}, "gradient_checkpointing must be true or false (got 'no')"),
        ({"colour": "red"}, "unknown field 'colour'"),
    ],
)
def test_a_damaged_gpt_config_is_named(final, changes, why):
    edit(final / "config.json", **changes)
    with pytest.raises(ConfigError) as e:
        load_model(final)
    assert str(e.value) == f"{final / 'config.json'} {NOT_GPT}: {why}"


def test_a_gpt_config_without_vocab_size_is_named(final):
    meta = json.loads((final / "config.json").read_text())
    del meta["vocab_size"]
    (final / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError) as e:
        load_model(final)
    assert str(e.value) == f"{final / 'config.json'} {NOT_GPT}: vocab_size is missing"


@pytest.mark.parametrize("command", ["generate", "export"])
@pytest.mark.parametrize("file, text", [(SAVED_META, "junk"), ("config.json", '{"densebatch_kind": "densebatch-gpt"}')])
def test_generate_and_export_print_one_line(capsys, final, tmp_path, command, file, text):
    (final / file).write_text(text)
    if command == "generate":
        line = refused(capsys, "generate", "--checkpoint", str(final), "--prompt", "hi", "--max-new-tokens", "2")
    else:
        line = refused(capsys, "export", str(final), str(tmp_path / "out"))
    assert line.startswith(f"{final / file} is not a ")


# ------------------------------------------------------------------------------ model.kind hf dirs
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_saved(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hf") / "gpt2"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(tiny_config("gpt2")).save_pretrained(d)
    return d


@pytest.fixture
def hf_dir(hf_saved, tmp_path) -> Path:
    return Path(shutil.copytree(hf_saved, tmp_path / "gpt2"))


def hf_refused(path: Path) -> str:
    from densebatch.model.hf.adapter import HFCausalLM

    with pytest.raises(ConfigError) as e:
        HFCausalLM(path)
    return str(e.value)


def test_an_hf_config_that_is_not_an_object_is_named(hf_dir):
    (hf_dir / "config.json").write_text("[1]")
    assert (
        hf_refused(hf_dir)
        == f"model.path: {hf_dir / 'config.json'} is not a model configuration: expected a JSON object; got a list"
    )


@pytest.mark.parametrize(
    "changes, why",
    [
        ({"model_type": ["gpt2"]}, "model_type must be a string (got ['gpt2'])"),
        ({"architectures": 5}, "architectures must be a list of class names (got 5)"),
    ],
)
def test_an_hf_config_with_odd_fields_is_named(hf_dir, changes, why):
    edit(hf_dir / "config.json", **changes)
    assert hf_refused(hf_dir) == f"model.path: {hf_dir / 'config.json'} is not a model configuration: {why}"


def test_an_hf_config_transformers_cannot_read_is_named(hf_dir):
    edit(hf_dir / "config.json", n_layer="two")
    line = hf_refused(hf_dir)
    assert line.startswith(
        f"model.path {hf_dir}: transformers could not read its config.json: StrictDataclassFieldValidationError: "
    )
    assert "\n" not in line and "n_layer" in line


@pytest.mark.parametrize("weights", [True, False])
def test_an_hf_config_transformers_cannot_build_is_named(hf_dir, weights):
    edit(hf_dir / "config.json", n_embd=30, n_head=4)
    if not weights:
        (hf_dir / "model.safetensors").unlink()
    assert hf_refused(hf_dir) == (
        f"model.path {hf_dir}: transformers could not build the model from its config.json: ValueError: "
        "`embed_dim` must be divisible by num_heads (got `embed_dim`: 30 and `num_heads`: 4)."
    )


@pytest.mark.parametrize("damage", ["junk", "truncated"])
def test_unreadable_hf_weights_are_named(hf_dir, damage):
    w = hf_dir / "model.safetensors"
    w.write_bytes(b"junk" if damage == "junk" else w.read_bytes()[:5000])
    line = hf_refused(hf_dir)
    assert line.startswith(
        f"model.path {hf_dir}: transformers could not load its weights: SafetensorError: Error while deserializing header"
    )
    assert "\n" not in line


def test_hf_weights_of_another_shape_are_named(hf_dir):
    edit(hf_dir / "config.json", vocab_size=50)
    assert hf_refused(hf_dir) == (
        f"model.path {hf_dir}: transformers could not load its weights: their shapes do not match its config.json "
        "(transformers' load report above lists each tensor)"
    )


@pytest.mark.parametrize("text", ["[1]", None])
def test_train_on_a_bad_hf_dir_prints_one_line(capsys, hf_dir, tmp_path, text):
    if text is None:
        edit(hf_dir / "config.json", n_embd=30, n_head=4)
    else:
        (hf_dir / "config.json").write_text(text)
    line = refused(
        capsys, "train", f"--output_dir={tmp_path / 'run'}", f"--data.cache_dir={tmp_path / 'cache'}", "--model.kind=hf",
        f"--model.path={hf_dir}", "--data.default.num_records=50", "--train.max_steps=1", "--train.progress=false",
    )  # fmt: skip
    assert str(hf_dir) in line and ("not a model configuration" in line if text else "could not build" in line)

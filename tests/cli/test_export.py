"""densebatch export: the reference GPT as a Hugging Face GPT-2 that from_pretrained loads with the same logits,
and a tokenizer AutoTokenizer loads with the same ids."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cli_args import TINY

from densebatch.cli import main
from densebatch.data.prepare.tokenizers import load_tokenizer
from densebatch.model import load_model

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("export")
    args = ["train", f"--output_dir={tmp / 'out'}", *TINY, "--train.max_steps=3", "--model.n_layer=2"]
    assert main([*args, f"--data.cache_dir={tmp / 'cache'}", "--model.dropout=0.0"]) == 0
    return tmp / "out"


def test_exported_gpt_loads_with_from_pretrained_and_gives_the_same_logits(run, tmp_path):
    out = tmp_path / "hf"
    assert main(["export", str(run), str(out)]) == 0
    ours = load_model(run / "final").eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(theirs).__name__ == "GPT2LMHeadModel"
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, ours.cfg.vocab_size, (3, 40), generator=g)  # (rows, T), one document per row
    positions = torch.arange(40).expand(3, 40)
    with torch.no_grad():
        a = ours(ids, positions)
        b = theirs(input_ids=ids).logits
    assert (a - b).abs().max().item() <= 1e-5 * max(1.0, a.abs().max().item())
    # a trained model, not a fresh one: the export carries the weights
    fresh = transformers.GPT2LMHeadModel(theirs.config)
    assert not torch.allclose(fresh(input_ids=ids).logits, b)


def test_exported_tokenizer_loads_with_auto_tokenizer(run, tmp_path):
    out = tmp_path / "hf"
    assert main(["export", str(run), str(out)]) == 0
    ours = load_tokenizer(run / "final")
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    text = "Below is an instruction that describes a task. Is 4817 even or odd?"
    assert theirs(text)["input_ids"] == ours.encode(text)
    assert theirs.eos_token_id == ours.eos_id


def test_export_refuses_a_non_empty_directory(run, tmp_path, capsys):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    assert main(["export", str(run), str(tmp_path / "x")]) == 2
    assert "not empty" in capsys.readouterr().err

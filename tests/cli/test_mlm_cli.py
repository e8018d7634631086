"""Masked-LM training end to end (issue 26, item 1): a tiny BERT from a config directory trained with
``--batching.mode=mlm`` on packed rows learns (masked-token accuracy well above the most frequent
token's share), its ``final/`` loads with ``AutoModelForMaskedLM`` and gives the same logits, evaluation
is the same under every strategy, and two processes take the steps one process takes with doubled
accumulation (the masked tokens depend on the document, not on the batch or the rank)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from support import subprocess_env, torchrun

from densebatch.cli import main

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow
CONFIG = {
    "seed": 0,
    "data": {"default": {"num_records": 400}, "max_seq_len": 256, "tokenizer": "default", "eval_fraction": 0.1},
    "batching": {"strategy": "packed", "mode": "mlm", "mlm_probability": 0.3, "seq_len": 256, "max_tokens_per_batch": 1024},
    "model": {"kind": "hf"},
    "train": {"max_steps": 45, "lr": 3e-3, "warmup_steps": 2, "progress": False, "plots": False, "device": "cpu",
              "loss_tokens_per_step": None},
    "eval": {"every_steps": 15, "accuracy_samples": 0},
}  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mlm")
    config = transformers.BertConfig(
        vocab_size=259,
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        max_position_embeddings=256,
        pad_token_id=256,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip  (no dropout: ranks draw other dropout masks than one process does)
    torch.manual_seed(0)
    transformers.BertForMaskedLM(config).save_pretrained(tmp / "bert")
    cfg = json.loads(json.dumps(CONFIG))
    cfg["model"]["path"] = str(tmp / "bert")
    cfg["data"]["cache_dir"] = str(tmp / "cache")
    (tmp / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["train", str(tmp / "cfg.yaml"), f"--output_dir={tmp / 'out'}"]) == 0
    return tmp


def test_mlm_prepares_every_record_a_cut_leaves_tokens_to(run):
    """Under mlm every token may be masked: a record whose response the 256-token cut removes is still a
    document (as causal loss_on: response it would be dropped: no target left)."""
    (summary,) = (run / "cache").glob("*/summary.json")
    s = json.loads(summary.read_text())
    assert s["dropped_no_target"] == 0 and s["truncated"] > 0, s
    assert s["records_kept"] == 400 and s["train_loss_tokens"] == s["train_tokens"] - s["train_documents"]


def _evals(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "eval"]


def test_a_bert_learns_masked_tokens_and_from_pretrained_loads_it(run):
    from densebatch.data.store.store import DocumentStore
    from densebatch.model import load_model

    evals = _evals(run / "out")
    assert [r["step"] for r in evals] == [15, 30, 45]
    # chance: always answering the eval split's most frequent token
    (eval_dir,) = (run / "cache").glob("*/eval")
    counts = np.bincount(np.asarray(DocumentStore.open(eval_dir).tokens))
    chance = counts.max() / counts.sum()
    acc = [r["masked_accuracy"] for r in evals]
    assert acc[-1] > 2 * chance and acc[-1] > acc[0], (acc, chance)
    final = run / "out" / "final"
    assert json.loads((final / "config.json").read_text())["architectures"] == ["BertForMaskedLM"]
    theirs = transformers.AutoModelForMaskedLM.from_pretrained(final).eval()
    ours = load_model(final).eval()
    ids = torch.tensor([[72, 101, 108, 108, 111, 32, 257, 111, 114, 108, 100]])
    with torch.no_grad():
        mine = ours(ids, torch.arange(ids.shape[1])[None])
        assert torch.allclose(theirs(input_ids=ids).logits, mine, atol=1e-5)


@pytest.mark.parametrize("strategy", ["token_budget", "length_grouped", "packed"])
def test_mlm_eval_is_the_same_under_every_strategy(run, capsys, strategy):
    args = ["eval", str(run / "cfg.yaml"), "--checkpoint", str(run / "out"), "--json"]
    assert main([*args, "--batching.strategy=random"]) == 0
    ref = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main([*args, f"--batching.strategy={strategy}"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["tokens"] == ref["tokens"] and got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert got["masked_accuracy"] == pytest.approx(ref["masked_accuracy"], abs=1e-9)


def test_two_processes_mask_what_one_process_masks(run):
    """DDP over 2 ranks == 1 process with doubled accumulation, through a batch-size ramp (a step's rows
    split over the ranks): the same loss tokens every step, losses within 1e-5."""
    common = [str(run / "cfg.yaml"), "--train.max_steps=8", "--eval.every_steps=0", "--train.batch_schedule.ramp_steps=4"]
    r = subprocess_run_torchrun(["train", *common, f"--output_dir={run / 'ddp'}"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert main(["train", *common, f"--output_dir={run / 'one'}", "--train.grad_accum_batches=2"]) == 0
    rows = [
        [r for r in map(json.loads, (run / d / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
        for d in ("ddp", "one")
    ]
    assert len(rows[0]) == 8 and [r["loss_tokens"] for r in rows[0]] == [r["loss_tokens"] for r in rows[1]]
    assert all(abs(a["loss"] - b["loss"]) <= 1e-5 * b["loss"] for a, b in zip(*rows))


def subprocess_run_torchrun(args: list[str]):
    import subprocess

    return subprocess.run(torchrun(args, 2), env=subprocess_env(), capture_output=True, text=True, timeout=300)


def test_mode_mlm_is_refused_for_the_reference_gpt_in_one_line(capsys):
    assert main(["train", "--batching.mode=mlm", "--train.max_steps=1"]) == 2
    err = capsys.readouterr().err
    assert "batching.mode: mlm" in err and "batching.mode: causal" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_generate_refuses_an_encoder_in_one_line(run, capsys):
    assert main(["generate", "--checkpoint", str(run / "out"), "--prompt", "hello"]) == 2
    err = capsys.readouterr().err
    assert "generates no continuation" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1

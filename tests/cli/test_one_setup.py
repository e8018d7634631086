"""One setup for every command: the range test probes ``train``'s own model and loss, evaluations inside a
run equal ``densebatch eval``, and a strategy's rules are checked before any work.

- ``find-lr`` with added tokens and label smoothing: its first loss is ``train``'s first logged loss
  (a copy of the setup once left out the added rows' initialisation and the smoothing).
- A run whose documents are longer than its packed rows (``long_docs: split``) evaluates on full-context
  rows: its last eval record equals ``densebatch eval --checkpoint`` on the final weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_args import TINY, tiny

from densebatch.cli import main

pytestmark = pytest.mark.slow  # each test runs the CLI on generated data


def _records(out: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def test_find_lr_starts_from_trains_weights_and_computes_trains_loss(tmp_path, capsys):
    grown = [
        *TINY,
        "--data.add_tokens=[<tool>, <call>]",  # two rows beyond the learned vocabulary: the mean of the others
        "--train.label_smoothing=0.1",
        f"--data.cache_dir={tmp_path / 'cache'}",
    ]
    lr = ["--finder.lr_start=1e-4", "--finder.lr_end=1", "--finder.lr_steps=10"]
    assert main(["find-lr", *grown, *lr, f"--output_dir={tmp_path / 'lr'}"]) == 0
    first = json.loads((tmp_path / "lr" / "lr_finder.json").read_text())["losses"][0]
    assert main(["train", *grown, "--train.lr=1e-4", "--train.max_steps=1", f"--output_dir={tmp_path / 'run'}"]) == 0
    (step1,) = _records(tmp_path / "run", "train")
    assert step1["step"] == 1 and first == pytest.approx(step1["loss"], abs=1e-6)
    # The control: without the smoothing the loss is another one, so the comparison can tell.
    assert main(["train", *grown, "--train.label_smoothing=0", "--train.max_steps=1", f"--output_dir={tmp_path / 'plain'}"]) == 0
    assert abs(_records(tmp_path / "plain", "train")[0]["loss"] - first) > 1e-4  # 100x the tolerance above (~9e-4 measured)
    capsys.readouterr()


def test_the_evaluation_inside_a_run_equals_densebatch_eval_when_rows_split_documents(tmp_path, capsys):
    split = [
        *TINY,
        "--batching.strategy=packed",
        "--batching.seq_len=48",  # shorter than most documents: training splits them, evaluation must not
        "--batching.max_tokens_per_batch=192",
        "--batching.long_docs=split",
        f"--data.cache_dir={tmp_path / 'cache'}",
    ]
    out = tmp_path / "run"
    assert main(["train", *split, "--train.max_steps=3", f"--output_dir={out}"]) == 0
    longest = int(capsys.readouterr().out.split(" max ")[1].split()[0])  # the prepare summary's longest document
    assert longest > 48  # so training rows split documents, and evaluating on them would change the loss
    last = _records(out, "eval")[-1]
    assert last["step"] == 3
    capsys.readouterr()
    assert main(["eval", str(out / "config.yaml"), "--checkpoint", str(out), "--json"]) == 0  # the run's own config
    alone = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert alone["tokens"] == last["tokens"]
    assert alone["loss"] == pytest.approx(last["loss"], abs=1e-5)


@pytest.mark.parametrize(
    "args, key",
    [
        (
            ["--batching.strategy=packed", "--batching.seq_len=256", "--batching.max_tokens_per_batch=128"],
            "batching.max_tokens_per_batch",
        ),
        (["--batching.strategy=random", "--batching.max_tokens_per_batch=auto"], "batching.max_tokens_per_batch"),
        (
            [
                "--batching.strategy=packed",
                "--batching.seq_len=100",
                "--batching.max_tokens_per_batch=100",
                "--batching.pad_to_multiple_of=64",
            ],
            "batching.max_tokens_per_batch",
        ),
    ],
)
def test_settings_a_strategy_cannot_run_are_one_line_before_any_work(tmp_path, capsys, args, key):
    for command in (["analyze", "--lengths", str(_lengths(tmp_path))], ["train"], ["find-batch"]):
        code = main([*command, *TINY, *args, f"--output_dir={tmp_path / 'out'}", f"--data.cache_dir={tmp_path / 'cache'}"])
        assert code == 2
        err = capsys.readouterr().err
        assert key in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "cache").exists()  # refused before preparing anything


def _lengths(tmp_path: Path) -> Path:
    p = tmp_path / "lengths.txt"
    p.write_text("\n".join(str(n) for n in range(20, 400, 7)) + "\n")
    return p


def test_truncation_that_would_cut_most_targets_is_refused_before_training(tmp_path, capsys):
    out = tmp_path / "run"
    cut = ["--batching.strategy=packed", "--batching.long_docs=truncate", "--batching.max_tokens_per_batch=256"]
    args = [*TINY, *cut, f"--output_dir={out}", f"--data.cache_dir={tmp_path / 'cache'}"]
    assert main(["train", *args, "--batching.seq_len=16"]) == 2  # prompts are longer: every answer would be cut
    err = capsys.readouterr().err.strip()
    assert "batching.long_docs: truncate would cut" in err and "use long_docs: split" in err and len(err.splitlines()) == 1
    assert not (out / "metrics.jsonl").exists()
    assert main(["train", *args, "--batching.seq_len=128", "--train.max_steps=1"]) == 0  # a few long ones: said, then trained
    assert "batching.long_docs: truncate cuts" in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["bert", "t5"])
def test_a_model_that_is_not_a_causal_lm_is_refused_before_any_data_is_prepared(kind, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    d = tmp_path / kind
    if kind == "bert":  # AutoModelForCausalLM would load it as BertLMHeadModel, which reads the future
        cfg = transformers.BertConfig(
            vocab_size=300, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
        )
        transformers.BertForMaskedLM(cfg).save_pretrained(d)
    else:
        cfg = transformers.T5Config(vocab_size=300, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
        transformers.T5ForConditionalGeneration(cfg).save_pretrained(d)
    capsys.readouterr()  # transformers' own save progress
    cache = tmp_path / "cache"
    args = [
        *tiny(gpt=False),
        "--model.kind=hf",
        f"--model.path={d}",
        f"--output_dir={tmp_path / 'out'}",
        f"--data.cache_dir={cache}",
    ]
    for command in ("train", "find-lr"):
        assert main([command, *args]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert ("BertForMaskedLM" if kind == "bert" else "encoder-decoder") in err and "causal LM" in err
    assert not cache.exists()  # refused before the data was prepared

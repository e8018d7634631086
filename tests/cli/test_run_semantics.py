"""What a run means, end to end: resume continues the saved run, a used output_dir is refused, eval is
strategy-invariant even with rows shorter than the documents, models too short for the data are refused
up front, and eval says which weights it scored."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_args import TINY as BASE_TINY

from densebatch.cli import main
from densebatch.config import load_config
from densebatch.data.load.collate import collator_from_config
from densebatch.data.load.loader import StepLoader
from densebatch.data.plan.planner import PlanSettings
from densebatch.data.prepare.pipeline import prepare
from densebatch.model import load_model
from densebatch.train.evaluate import evaluate

REPO = Path(__file__).resolve().parents[2]
TINY = [*BASE_TINY, "--data.eval_fraction=0.2"]


def _train_lines(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"train"' in x]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A config file and a 4-step packed run made from it with command-line overrides."""
    tmp = tmp_path_factory.mktemp("run")
    cfg = tmp / "run.yaml"
    cfg.write_text(f"output_dir: {tmp / 'out'}\ndata:\n  cache_dir: {tmp / 'cache'}\nbatching:\n  strategy: token_budget\n")
    args = ["train", str(cfg), *TINY, "--train.max_steps=4", "--batching.strategy=packed", "--checkpoint.every_steps=2"]
    assert main(args) == 0
    return tmp, cfg


@pytest.mark.slow
def test_resume_continues_the_saved_run(run, capsys, tmp_path):
    tmp, cfg = run
    out = tmp_path / "out"
    shutil.copytree(tmp / "out", out)
    conf = cfg.read_text().replace(str(tmp / "out"), str(out))
    (tmp_path / "run.yaml").write_text(conf)
    cfg = tmp_path / "run.yaml"
    capsys.readouterr()
    # The README's pair: the file alone (token_budget, no step limit) with --resume, plus a longer limit.
    assert main(["train", str(cfg), *TINY, "--resume", "--train.max_steps=6"]) == 0
    text = capsys.readouterr().out
    assert "changed: train.max_steps: 4 → 6" in text
    assert "ignored: batching.strategy: 'token_budget' (the saved run has 'packed')" in text
    steps = _train_lines(out)
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    saved = load_config(out / "config.yaml")
    assert (saved.batching.strategy, saved.train.max_steps) == ("packed", 6)
    assert "step 6/6 |" in text and "step 5/6 |" in text  # progress counts against the new limit, never "55/50"
    # A change of what the run computes, named on the command line, is refused with the list.
    assert main(["train", str(cfg), *TINY, "--resume", "--train.lr=1e-2", "--seed=3"]) == 2
    err = capsys.readouterr().err
    assert "train.lr (saved 0.0003, asked 0.01)" in err and "seed (saved 0, asked 3)" in err and "Traceback" not in err


def test_a_used_output_dir_is_refused_without_resume_or_overwrite(run, capsys, tmp_path):
    tmp, cfg = run
    capsys.readouterr()
    assert main(["train", str(cfg), *TINY, "--train.max_steps=1"]) == 2
    err = capsys.readouterr().err
    assert "already holds a run (metrics.jsonl, checkpoints, final)" in err and "--resume" in err and "--overwrite" in err
    out = tmp_path / "o"
    shutil.copytree(tmp / "out", out)
    assert main(["train", str(cfg), *TINY, f"--output_dir={out}", "--train.max_steps=1", "--overwrite"]) == 0
    assert [r["step"] for r in _train_lines(out)] == [1]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000001"]  # the old ones are gone


@pytest.mark.parametrize("strategy", ["random", "token_budget", "packed"])
def test_eval_is_strategy_invariant_with_rows_shorter_than_documents(run, capsys, strategy):
    tmp, cfg = run
    capsys.readouterr()
    args = ["eval", str(cfg), "--checkpoint", str(tmp / "out"), "--json", *TINY]
    assert main([*args, "--batching.strategy=random"]) == 0
    ref = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main([*args, f"--batching.strategy={strategy}", "--batching.seq_len=96", "--batching.long_docs=split"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["tokens"] == ref["tokens"] and got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert got["weights"].startswith("final model") and "(step 4)" in got["weights"]


def test_cut_rows_would_change_the_eval_loss(run):
    """Negative control for the test above: scoring packed rows of 96 tokens as planned for training
    (documents cut, later pieces without their question) gives another loss: 4 steps teach the tiny
    model little context, so the gap is small (3.9e-4 relative), but 40x the 1e-5 the test above allows."""
    tmp, cfg = run
    c = load_config(cfg, [*TINY, "--batching.seq_len=96", "--batching.max_tokens_per_batch=960"])
    prepared = prepare(c.data)
    assert int(np.max(prepared.eval.lengths)) > 96
    model = load_model(tmp / "out" / "final")
    losses = {}
    for strategy in ("random", "packed"):
        settings = PlanSettings.from_config(c.batching, strategy=strategy)
        loader = StepLoader(
            prepared.eval, settings=settings, collator=collator_from_config(c.batching, prepared.eval.meta), seed=0, prefetch=0
        )
        losses[strategy] = evaluate(model, loader.iter_epoch(0), device=torch.device("cpu")).loss
    assert abs(losses["packed"] - losses["random"]) > 1e-4 * losses["random"]


@pytest.mark.slow
def test_eval_of_a_run_dir_scores_the_newest_weights(run, capsys, tmp_path):
    tmp, cfg = run
    out = tmp_path / "out"
    shutil.copytree(tmp / "out", out)
    (out / "final" / "densebatch_state.json").write_text(json.dumps({"step": 2}))  # as if a resume went further
    capsys.readouterr()
    assert main(["eval", str(cfg), "--checkpoint", str(out), "--json", *TINY]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["weights"].startswith(f"checkpoint {out / 'checkpoints' / 'step-000004'}") and "newer than" in res["weights"]


def test_a_model_whose_context_is_shorter_than_the_rows_is_refused_up_front(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    d = tmp_path / "hf"
    transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=64, vocab_size=300).save_pretrained(d)
    capsys.readouterr()
    args = ["train", f"--output_dir={tmp_path / 'out'}", "--model.kind=hf", f"--model.path={d}", *TINY[4:], "--train.max_steps=1"]
    args += [f"--data.cache_dir={tmp_path / 'cache'}", "--data.tokenizer=default"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "batching.seq_len: rows of up to 256 tokens exceed the model's context" in err and "64 positions" in err
    assert "Traceback" not in err and not (tmp_path / "out" / "metrics.jsonl").exists()


def test_a_finished_run_leaves_no_prefetch_thread(tmp_path):
    """The loader's prefetch thread stops with the run: left to interpreter shutdown it was killed inside
    a torch op, which aborted a torchrun worker after a successful run (SIGABRT, exit -6)."""
    import threading

    args = ["train", *TINY, f"--output_dir={tmp_path / 'o'}", f"--data.cache_dir={tmp_path / 'c'}", "--train.max_steps=2"]
    assert main([*args, "--batching.prefetch=2"]) == 0
    assert not [t.name for t in threading.enumerate() if t.name == "densebatch-prefetch" and t.is_alive()]


def test_a_step_in_loss_tokens_says_how_many_batches_it_takes(tmp_path, capsys):
    """train.loss_tokens_per_step decides the step, the batching flags the batch: the run says what that makes."""
    args = [*BASE_TINY, "--train.max_steps=1", "--eval.every_steps=0", "--data.eval_fraction=0"]
    assert main(["train", f"--output_dir={tmp_path / 'a'}", *args, "--train.loss_tokens_per_step=200"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("train.loss_tokens_per_step"))
    assert "train.loss_tokens_per_step 200: " in line and " batches a step on average (" in line
    per_step = float(line.split(": ")[1].split()[0])
    assert per_step > 1.0  # a batch of 1,024 slots holds fewer than 200 loss tokens here
    assert main(["train", f"--output_dir={tmp_path / 'b'}", *args]) == 0  # one batch a step: nothing to say
    assert "batches a step" not in capsys.readouterr().out

"""The finders from the command line: find-lr / find-batch outputs, ``auto`` values resolved into the run's
configuration (the run then equals one given those numbers, and a resume reuses them), the process's
peak memory against ``train.memory_limit_gb`` on a GPT-2-vocabulary model, and torchrun ranks with
different memory agreeing on one budget."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cli_args import TINY
from support import BIN, free_port, subprocess_env, torchrun_node

from densebatch.cli import main

pytestmark = pytest.mark.slow  # every test here runs the CLI on generated data (prepare, BPE, model)
# The LR test's range on the tiny model: from rates that move nothing to divergence in 20 steps.
LR = ["--finder.lr_start=1e-4", "--finder.lr_end=10", "--finder.lr_steps=20", "--finder.smoothing=0.6"]


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]


def _saved(out: Path) -> dict:
    return yaml.safe_load((out / "config.yaml").read_text())


def test_find_lr_writes_the_plot_and_the_json(tmp_path, capsys):
    out = tmp_path / "lr"
    assert main(["find-lr", *TINY, *LR, f"--output_dir={out}", f"--data.cache_dir={tmp_path / 'cache'}"]) == 0
    text = capsys.readouterr().out
    assert "suggested learning rate:" in text and "(most of the fall:" in text and "batch size:" in text
    doc = json.loads((out / "lr_finder.json").read_text())
    assert doc["lrs"][0] <= doc["suggested_lr"] <= doc["lrs"][-1]
    assert len(doc["lrs"]) == len(doc["losses"]) <= 20 and doc["lrs"][0] == pytest.approx(1e-4)
    assert (out / "lr_finder.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / "metrics.jsonl").exists()  # a finder is not a run


@pytest.fixture(scope="module")
def auto_run(tmp_path_factory):
    """A run with ``train.lr: auto`` and ``max_tokens_per_batch: auto`` (dropout on: RNGs matter)."""
    tmp = tmp_path_factory.mktemp("auto")
    common = [*TINY, "--batching.strategy=token_budget", "--model.dropout=0.1", f"--data.cache_dir={tmp / 'cache'}"]
    auto = [*common, *LR, "--train.lr=auto", "--batching.max_tokens_per_batch=auto", "--train.memory_limit_gb=16"]
    return tmp, common, auto


def test_auto_values_are_resolved_into_the_config_and_the_run_is_the_one_they_give(auto_run, capsys):
    tmp, common, auto = auto_run
    a, b = tmp / "a", tmp / "b"
    assert main(["train", *auto, "--finder.max_probes=3", "--train.max_steps=3", f"--output_dir={a}"]) == 0
    text = capsys.readouterr().out
    assert "train.lr: auto →" in text and "batching.max_tokens_per_batch: auto →" in text and "chosen:" in text
    saved = _saved(a)
    lr, budget = saved["train"]["lr"], saved["batching"]["max_tokens_per_batch"]
    assert isinstance(lr, float) and isinstance(budget, int) and budget >= 256
    assert json.loads((a / "lr_finder.json").read_text())["suggested_lr"] == lr
    # The finders left nothing behind: the same run with the numbers given computes the same losses.
    assert main(["train", *common, f"--train.lr={lr!r}", f"--batching.max_tokens_per_batch={budget}", "--train.max_steps=3", f"--output_dir={b}"]) == 0  # fmt: skip
    assert _losses(a) == _losses(b) and len(_losses(a)) == 3


def test_a_resume_reuses_the_resolved_values(auto_run, capsys):
    tmp, _, auto = auto_run
    a = tmp / "a"
    if not (a / "config.yaml").exists():  # under pytest-xdist the run above may be on another worker
        assert main(["train", *auto, "--finder.max_probes=3", "--train.max_steps=3", f"--output_dir={a}"]) == 0
    before = _saved(a)
    capsys.readouterr()
    assert main(["train", *auto, "--resume", "--train.max_steps=5", f"--output_dir={a}"]) == 0
    text = capsys.readouterr().out
    assert "range test" not in text and "finding the token budget" not in text
    after = _saved(a)
    assert after["train"]["lr"] == before["train"]["lr"]
    assert after["batching"]["max_tokens_per_batch"] == before["batching"]["max_tokens_per_batch"]
    assert len(_losses(a)) == 5
    # Commands that only plan take the budget the run found; with no run to ask, auto is refused.
    assert main(["analyze", *auto, "--json", f"--output_dir={a}"]) == 0
    assert main(["analyze", *auto, "--json", f"--output_dir={tmp / 'none'}"]) == 2
    assert "run one of them first, or give a number" in capsys.readouterr().err


def test_find_batch_reports_its_probes(tmp_path, capsys):
    out = tmp_path / "fb"
    args = ["find-batch", *TINY, "--batching.strategy=token_budget", "--train.memory_limit_gb=16", "--finder.max_probes=3"]
    assert main([*args, f"--output_dir={out}", f"--data.cache_dir={tmp_path / 'cache'}"]) == 0
    text = capsys.readouterr().out
    doc = json.loads((out / "batch_finder.json").read_text())
    assert len(doc["probes"]) == 3 and all(p["fits"] for p in doc["probes"])
    assert doc["budget"] == doc["probes"][-1]["budget"] > doc["probes"][0]["budget"]
    assert f"batching.max_tokens_per_batch={doc['budget']}" in text and "real tok/s" in text
    assert main(["find-batch", *TINY, f"--output_dir={out}", "--batching.strategy=random"]) == 2  # nothing to size


# ------------------------------------------------------------------------------ subprocesses
PEAK = "import resource, sys; from densebatch.cli import main; rc = main(sys.argv[1:]); " \
       "print('PEAK_RSS_GB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9); sys.exit(rc)"  # fmt: skip


def test_the_budget_keeps_the_process_under_its_memory_limit_on_a_gpt2_vocabulary_model(tmp_path):
    """``train --batching.max_tokens_per_batch=auto --train.memory_limit_gb=L`` on a Hugging Face GPT-2
    with its 50,257-id vocabulary: the whole process (probes, training, evaluation, checkpoint and
    final model) peaks under L and uses at least 60% of it."""
    transformers = pytest.importorskip("transformers")
    transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=512, vocab_size=50257).save_pretrained(tmp_path / "gpt2")
    limit = 1.0
    args = ["train", "--data.default.num_records=1000", "--data.max_seq_len=512", "--model.kind=hf", f"--model.path={tmp_path / 'gpt2'}",
            "--batching.strategy=token_budget", "--batching.max_tokens_per_batch=auto", f"--train.memory_limit_gb={limit}",
            # One document per row: bundled rows give a Hugging Face model a dense (rows, 1, T, T) document mask
            # whose T^2 memory the finder's extrapolation from smaller probes does not foresee (its 6,080-slot
            # probe peaked at 1.02 GB > 1.0); open in issue 22 (attention in O(T) for Hugging Face models).
            "--batching.bundle_tokens=0",
            "--train.max_steps=2", "--train.progress=false", "--eval.max_batches=2", "--eval.accuracy_samples=0",
            f"--output_dir={tmp_path / 'out'}", f"--data.cache_dir={tmp_path / 'cache'}"]  # fmt: skip
    r = subprocess.run([sys.executable, "-c", PEAK, *args], env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    # Probes reset the kernel's high-water mark (getrusage too): the true peak includes every probe's.
    probes = [float(x) for x in re.findall(r"probe \d+ slots: peak ([\d.]+) GB", r.stdout)]
    peak = max([float(r.stdout.rsplit("PEAK_RSS_GB", 1)[1]), *probes])
    assert len(probes) >= 3 and 0.6 * limit <= peak < limit, r.stdout[-3000:]
    assert isinstance(_saved(tmp_path / "out")["batching"]["max_tokens_per_batch"], int)


def _node(port: int, args: list[str]) -> subprocess.Popen:
    """One torchrun node of two (one process), rendezvous on localhost."""
    cmd = torchrun_node(port, "densebatch-finders", args)
    return subprocess.Popen(cmd, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_ranks_with_different_memory_settle_on_one_budget_and_one_rate(tmp_path):
    """Two torchrun nodes (one process each, so each gets its own --train.memory_limit_gb): one rank has
    less memory. Both finish (no hang), the budget is the one that fits the smaller memory, and the range
    test under DDP takes the same steps and losses as one process with twice the accumulation."""
    cache = f"--data.cache_dir={tmp_path / 'cache'}"
    common = [*TINY, "--model.n_layer=2", "--model.n_embd=256", "--model.n_head=4", "--batching.strategy=token_budget", cache,
              "--train.device=cpu", "--finder.max_probes=5", "--finder.memory_reserve=0"]  # fmt: skip
    solo = tmp_path / "solo"  # one process with plenty: the peaks of the budgets it can reach
    r = subprocess.run([str(BIN / "densebatch"), "find-batch", *common, "--train.memory_limit_gb=16", f"--output_dir={solo}"],
                       env=subprocess_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    probes = json.loads((solo / "batch_finder.json").read_text())["probes"]
    assert len(probes) == 5
    small = (probes[1]["peak_gb"][0] + probes[2]["peak_gb"][0]) / 2 + 0.03  # room for the process group
    port, out = free_port(), tmp_path / "two"
    args = [
        "train",
        *common,
        *LR,
        "--train.lr=auto",
        "--batching.max_tokens_per_batch=auto",
        "--train.max_steps=2",
        f"--output_dir={out}",
    ]
    nodes = [_node(port, [*args, f"--train.memory_limit_gb={limit}"]) for limit in (16, small)]
    results = [n.communicate(timeout=600) for n in nodes]
    assert all(n.returncode == 0 for n in nodes), results[0][1][-2000:] + results[1][1][-2000:]
    budget = _saved(out)["batching"]["max_tokens_per_batch"]
    assert probes[0]["budget"] <= budget < probes[-1]["budget"]  # rank 1's memory decided, not rank 0's
    lr_doc = json.loads((out / "lr_finder.json").read_text())
    one = tmp_path / "one"
    args = [
        "find-lr",
        *common,
        *LR,
        f"--batching.max_tokens_per_batch={budget}",
        "--train.grad_accum_batches=2",
        f"--output_dir={one}",
    ]
    r = subprocess.run([str(BIN / "densebatch"), *args], env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    ref = json.loads((one / "lr_finder.json").read_text())
    # The suggestion is read off the lag-free (forwards-then-backwards) smoothed curve, so the points near
    # the minimum carry some weight from the losses past it, where the rates blow the model up and
    # differences of 1e-7 from summation order grow (CI: 3.74e-3 vs 3.45e-3 with the falling part equal).
    # The sweep's grid step is the resolution of a range test: the two suggestions are within one of it.
    seen = f"one process: {ref['stop']}, {ref['suggested_lr']}; two ranks: {lr_doc['stop']}, {lr_doc['suggested_lr']}"
    assert len(ref["losses"]) == len(lr_doc["losses"]), seen
    step = (ref["lrs"][-1] / ref["lrs"][0]) ** (1 / (len(ref["lrs"]) - 1))
    assert 1 / step <= ref["suggested_lr"] / lr_doc["suggested_lr"] <= step, seen
    assert _saved(out)["train"]["lr"] == pytest.approx(lr_doc["suggested_lr"], rel=1e-6)  # every rank trains on it
    # Equal up to summation order while the loss falls; past its minimum the rates blow the model up and
    # differences of 1e-7 grow (seen once in a full-suite run), so only the falling part is compared.
    lowest = min(range(len(ref["smoothed_losses"])), key=lambda k: ref["smoothed_losses"][k])
    assert lowest >= 5
    assert all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(lr_doc["losses"][:lowest], ref["losses"][:lowest]))

"""``train.context_parallel`` through the real CLI: refusals before any work, torchrun runs equal to one process,
and a checkpoint of a 2 × 2 mesh resumed on 4 × 1.

The equivalence of split rows, model by model and under DDP / FSDP2, is tested on forked ranks
(tests/model/test_context_attention.py, tests/train/parallel/); here the whole command runs: launch, mesh,
loaders dealt over the data ranks, sharded steps and evaluation, checkpoints and the elastic resume.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from cli_args import TINY
from support import subprocess_env, torchrun

from densebatch.cli import main

# Packed rows of 256 over 2 context ranks: 4 chunks of 64; generated Alpaca records, shorter than a chunk or
# crossing one. 2 batches a step on each of 2 data ranks (4 on one process).
CONFIG = {
    "seed": 0,
    "data": {"default": {"num_records": 200}, "max_seq_len": 256, "chunk_records": 64},
    "batching": {"strategy": "packed", "max_tokens_per_batch": 512, "seq_len": 256},
    "model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 256},
    "train": {"max_steps": 4, "lr": 3e-3, "warmup_steps": 1, "progress": False, "device": "cpu", "plots": False},
    "eval": {"accuracy_samples": 0, "max_batches": 1},
    "checkpoint": {"every_steps": 2, "keep_last": 4},
}


def _config(tmp: Path) -> Path:
    cfg = json.loads(json.dumps(CONFIG))
    cfg["data"]["cache_dir"] = str(tmp / "cache")
    path = tmp / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _launch(args: list[str], nproc: int):
    import subprocess

    r = subprocess.run(torchrun(args, nproc), env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _records(out: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def _close(a: list[dict], b: list[dict], key: str = "loss", rel: float = 1e-5) -> bool:
    return len(a) == len(b) and all(abs(x[key] - y[key]) <= rel * abs(y[key]) for x, y in zip(a, b))


def _one_process(args: list[str]) -> int:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers (subprocess_env)
    try:
        return main(args)
    finally:
        torch.set_num_threads(threads)


# ------------------------------------------------------------------------ refused before any work
REFUSALS = [
    ("train", ["--train.context_parallel=2"], "2 context ranks do not divide the 1 process"),
    (
        "train",
        ["--train.context_parallel=2", "--batching.seq_len=254", "--data.max_seq_len=254"],
        "do not split into 4 equal chunks",
    ),
    ("train", ["--train.context_parallel=4", "--model.n_head=2"], "2 attention heads do not split over 4 context ranks"),
    (
        "train",
        ["--train.context_parallel=2", "--batching.max_tokens_per_batch=auto"],
        "max_tokens_per_batch auto probes whole rows",
    ),
    ("find-batch", ["--train.context_parallel=2"], "find-batch probes whole rows on one rank"),
]


@pytest.mark.parametrize(("command", "extra", "says"), REFUSALS, ids=["world", "row", "heads", "budget", "find-batch"])
def test_what_context_parallelism_cannot_run_is_one_line_before_any_work(command, extra, says, tmp_path, capsys):
    code = main([command, *TINY, f"--output_dir={tmp_path / 'run'}", f"--data.cache_dir={tmp_path / 'cache'}", *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and says in err, err
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()  # no documents prepared, no run


def test_transformers_own_kernels_cannot_run_split(tmp_path, capsys):
    pytest.importorskip("transformers")
    from densebatch.testing.models import write_config_dir

    path = write_config_dir(tmp_path, "llama")
    args = ["train", *TINY, f"--output_dir={tmp_path / 'run'}", f"--data.cache_dir={tmp_path / 'cache'}"]
    code = main(
        [*args, "--model.kind=hf", f"--model.path={path}", "--model.attn_implementation=sdpa", "--train.context_parallel=2"]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and "model.attn_implementation sdpa (transformers' own kernel) cannot attend across" in err, err
    assert not (tmp_path / "cache").exists()


# ------------------------------------------------------------------------------- torchrun runs
@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """One process (4 batches a step), and under torchrun: 1 data rank × 2 context ranks (4 batches a step) and
    2 × 2 under FSDP2 (2 batches a step on each data rank), both checkpointing every 2 steps."""
    tmp = tmp_path_factory.mktemp("cp")
    cfg = str(_config(tmp))
    assert _one_process(["train", cfg, f"--output_dir={tmp / 'one'}", "--train.grad_accum_batches=4"]) == 0
    r = _launch(["train", cfg, f"--output_dir={tmp / 'cp2'}", "--train.grad_accum_batches=4", "--train.context_parallel=2"], 2)
    assert "2 processes = 1 data rank x 2 context ranks; each rank holds 1/2 of every row (chunks i and 3-i of 4)" in r.stdout
    args = ["train", cfg, f"--output_dir={tmp / 'fsdp2x2'}", "--train.grad_accum_batches=2", "--train.context_parallel=2"]
    _launch([*args, "--train.distributed=fsdp"], 4)
    return tmp


@pytest.mark.slow
def test_rows_split_over_two_ranks_train_like_one_process(runs):
    one, split = _records(runs / "one", "train"), _records(runs / "cp2", "train")
    assert len(split) == 4 and _close(split, one), ([r["loss"] for r in split], [r["loss"] for r in one])
    for key in ("loss_tokens", "real_tokens"):  # the context ranks' counts add up to the rows'
        assert [r[key] for r in split] == [r[key] for r in one], key
    assert _close(_records(runs / "cp2", "eval"), _records(runs / "one", "eval"))
    last = _records(runs / "cp2", "run")[-1]
    assert all("2 context ranks (all-to-all over heads)" in k["kernel"] for k in last["attention"]), last["attention"]


@pytest.mark.slow
def test_two_by_two_under_fsdp_trains_like_the_two_data_ranks_alone_and_resumes_on_four_by_one(runs):
    """2 data × 2 context ranks under FSDP2 equal one process with the 2 data ranks' batches (which DDP over 2
    ranks equals: tests/cli/test_distributed.py); its checkpoint of step 2 continues on 4 data ranks × 1."""
    mesh, one = _records(runs / "fsdp2x2", "train"), _records(runs / "one", "train")
    assert _close(mesh, one), ([r["loss"] for r in mesh], [r["loss"] for r in one])
    out = runs / "resumed"
    shutil.copytree(runs / "fsdp2x2", out)
    shutil.rmtree(out / "checkpoints" / "step-000004")
    shutil.rmtree(out / "final")
    r = _launch(["train", str(runs / "cfg.yaml"), f"--output_dir={out}", "--resume", "--train.context_parallel=1"], 4)
    assert "train.context_parallel: 2 → 1" in r.stdout and "2 → 4 data ranks" in r.stdout, r.stdout[-2000:]
    resumed = _records(out, "train")
    assert resumed[:2] == mesh[:2] and _close(resumed, mesh), ([r["loss"] for r in resumed], [r["loss"] for r in mesh])

"""Per-rank peak memory of building, saving, resuming and finishing a run on 1, 2 and 3 processes (CPU, gloo).

``.venv/bin/python -m benchmarks.scale.state_memory [--work DIR] [--only gpt100m gpt40m hf100m saves]``

- ``gpt100m``: the reference GPT at 113M parameters (16 layers, width 768), 2 steps (6 batches of 512
  tokens each on 2 processes: 1, 2 and 3 split them evenly) with a checkpoint
  after each, then ``final/``; on 1 process, and under FSDP on 2 and 3. The 2-process run is then
  resumed from its step-1 checkpoint on 1, 2 and 3 processes (the ``resume`` column).
- ``gpt40m``: the same at 42M parameters (6 layers) on 2 processes: the whole run's peak of rank 0
  against rank 1's (rank 0 gathered the whole state to save it before checkpoints were sharded).
- ``hf100m``: a Llama of 134M parameters (12 layers, width 768, vocabulary 32,000) from a safetensors
  directory, built on 1 process and under FSDP on 2: the sum over ranks of the build's peak.
- ``saves``: the seconds training waits per checkpoint (``blocked_s`` of the metrics), synchronous
  against ``checkpoint.async: true``, gpt100m under FSDP on 2 processes.

Each process runs ``benchmarks/scale/memory_driver.py`` (one intra-op thread), which resets the peak
resident memory (VmHWM) at the start of each phase. ``before build`` is what a process holds before the
model exists (interpreter, torch, the prepared data): the ``build`` peak less it is the model's own cost.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
MODELS = {
    "gpt100m": {"n_layer": 16, "n_head": 12, "n_embd": 768, "block_size": 256},
    "gpt40m": {"n_layer": 6, "n_head": 12, "n_embd": 768, "block_size": 256},
}


def config(work: Path, model: dict) -> Path:
    cfg = {
        "seed": 0,
        "data": {"default": {"num_records": 200}, "max_seq_len": 256, "cache_dir": str(work / "cache")},
        "batching": {"strategy": "packed", "max_tokens_per_batch": 512, "seq_len": 256},
        "model": model,
        "train": {
            "max_steps": 2,
            "grad_accum_batches": 3,  # 6 batches a step over 2 ranks: 1, 2 and 3 processes split them evenly
            "lr": 1e-4,
            "warmup_steps": 0,
            "progress": False,
            "plots": False,
            "device": "cpu",
            "distributed": "fsdp",
        },
        "eval": {"accuracy_samples": 0, "max_batches": 1},
        "checkpoint": {"every_steps": 1, "keep_last": 3},
    }
    path = work / f"cfg-{len(list(work.glob('cfg-*')))}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run(work: Path, name: str, nproc: int, args: list[str]) -> list[dict]:
    """Per-rank peaks (MiB) of ``densebatch ARGS`` on ``nproc`` processes."""
    mem = work / "memory" / name
    shutil.rmtree(mem, ignore_errors=True)
    driver = [sys.executable, "-m", "benchmarks.scale.memory_driver"]
    cmd = driver if nproc == 1 else [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}", "--no-python", *driver]
    env = dict(os.environ, DENSEBATCH_MEMORY=str(mem), OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{REPO}")
    r = subprocess.run([*cmd, *args], env=env, capture_output=True, text=True, cwd=REPO)
    if r.returncode != 0:
        sys.exit(f"{name}: failed\n{r.stderr[-3000:]}")
    return [json.loads((mem / f"rank{i}.json").read_text()) for i in range(nproc)]


def _cell(r: dict, phase: str) -> str:
    """The phase's peak, and the most one call of it added over the resident memory it began with (``+N``)."""
    if phase not in r:
        return "—"
    own = f" (+{r[phase + '_own']:,.0f})" if phase + "_own" in r else ""
    return f"{r[phase]:,.0f}{own}"


def table(title: str, rows: list[tuple[str, list[dict]]], phases: tuple[str, ...]) -> None:
    print(f"\n{title}\n")
    print("| run | rank | before build | " + " | ".join(phases) + " |")
    print("|---|---|---|" + "---|" * len(phases))
    for name, ranks in rows:
        for i, r in enumerate(ranks):
            cells = [_cell(r, p) for p in phases]
            print(f"| {name} | {i} | {r.get('before_build', 0):,.0f} | " + " | ".join(cells) + " |")
        if len(ranks) > 1 and "build" in phases:
            own = sum(r["build"] - r["before_build"] for r in ranks)
            print(
                f"| {name} | sum | {sum(r['before_build'] for r in ranks):,.0f} | {sum(r['build'] for r in ranks):,.0f} (model's own: {own:,.0f}) |"
                + " |" * (len(phases) - 1)
            )


def gpt100m(work: Path) -> None:
    cfg = config(work, MODELS["gpt100m"])
    rows = []
    for n in (1, 2, 3):
        out = work / f"gpt100m-{n}"
        shutil.rmtree(out, ignore_errors=True)
        rows.append(
            (
                f"train, {n} process{'es' if n > 1 else ''}",
                run(work, f"gpt100m-{n}", n, ["train", str(cfg), f"--output_dir={out}"]),
            )
        )
    table("gpt100m (113M parameters), MiB", rows, ("build", "save", "final", "run"))
    resumed = []
    for n in (1, 2, 3):
        out = work / f"gpt100m-resume-{n}"
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(work / "gpt100m-2", out)
        shutil.rmtree(out / "checkpoints" / "step-000002")
        shutil.rmtree(out / "final")
        args = ["train", str(cfg), f"--output_dir={out}", "--resume"]
        resumed.append((f"resume 2 → {n}", run(work, f"gpt100m-resume-{n}", n, args)))
    table("gpt100m: a 2-process checkpoint resumed, MiB", resumed, ("build", "resume", "save", "run"))


def gpt40m(work: Path) -> None:
    cfg = config(work, MODELS["gpt40m"])
    out = work / "gpt40m-2"
    shutil.rmtree(out, ignore_errors=True)
    ranks = run(work, "gpt40m-2", 2, ["train", str(cfg), f"--output_dir={out}"])
    table("gpt40m (42M parameters), 2 processes, MiB", [("train", ranks)], ("build", "save", "final", "run"))
    print(f"\nrank 0's whole-run peak / rank 1's: {ranks[0]['run'] / ranks[1]['run']:.3f}")


def hf100m(work: Path) -> None:
    import torch
    import transformers

    base = work / "llama134m"
    if not (base / "model.safetensors").is_file():
        torch.manual_seed(0)
        config_ = transformers.LlamaConfig(
            vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
            num_key_value_heads=12, max_position_embeddings=256, tie_word_embeddings=False,
        )  # fmt: skip
        transformers.AutoModelForCausalLM.from_config(config_).save_pretrained(base)
    cfg = config(work, {"kind": "hf", "path": str(base)})
    rows = []
    for n in (1, 2):
        out = work / f"hf-{n}"
        shutil.rmtree(out, ignore_errors=True)
        args = [
            "train",
            str(cfg),
            f"--output_dir={out}",
            "--data.tokenizer=default",
            "--train.max_steps=1",
            "--checkpoint.every_steps=0",
        ]
        rows.append((f"train, {n} process{'es' if n > 1 else ''}", run(work, f"hf-{n}", n, args)))
    table("hf100m (Llama, 134M parameters, safetensors), MiB", rows, ("build", "save", "final", "run"))
    one, two = rows[0][1][0], rows[1][1]
    print(f"\nsum over 2 ranks of the build peak / one process's: {sum(r['build'] for r in two) / one['build']:.2f} "
          f"(the model's own cost: {sum(r['build'] - r['before_build'] for r in two) / (one['build'] - one['before_build']):.2f})")  # fmt: skip


def saves(work: Path) -> None:
    """Seconds training is blocked per checkpoint, synchronous against ``checkpoint.async`` (gpt100m, 2 processes)."""
    import statistics

    cfg = config(work, MODELS["gpt100m"])
    print("\nseconds training was blocked per save (gpt100m, FSDP on 2 processes, a checkpoint every step, 5 steps)\n")
    print("| checkpoint.async | blocked_s per save (median, max) | the write's own seconds (median) |")
    print("|---|---|---|")
    for background in (False, True):
        out = work / f"saves-{background}"
        shutil.rmtree(out, ignore_errors=True)
        args = ["train", str(cfg), f"--output_dir={out}", "--train.max_steps=5", f"--checkpoint.async={str(background).lower()}"]
        run(work, f"saves-{background}", 2, args)
        recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        recs = [r for r in recs if r["kind"] == "checkpoint"]
        blocked = [r["blocked_s"] for r in recs]
        writes = [r.get("write_s") or r.get("previous_write_s") for r in recs]
        writes = [w for w in writes if w is not None]
        print(
            f"| {str(background).lower()} | {statistics.median(blocked):.2f} s, {max(blocked):.2f} s | {statistics.median(writes):.2f} s |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=None, help="working directory (default: a temporary one)")
    names = ["gpt100m", "gpt40m", "hf100m", "saves"]
    ap.add_argument("--only", nargs="*", default=names, choices=names)
    a = ap.parse_args()
    work = a.work or Path(tempfile.mkdtemp(prefix="state-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    for name in a.only:
        globals()[name](work)


if __name__ == "__main__":
    main()

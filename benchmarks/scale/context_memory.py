"""Each rank's memory of a training step at a long row, with the row split over N = 1, 2 and 4 context ranks (CPU, fp32).

``.venv/bin/python -m benchmarks.scale.context_memory [--seq-len 16384] [--degrees 1 2 4] [--work DIR]``

One packed row of ``--seq-len`` tokens a step (documents of 1,500-7,000 tokens of generated text, byte-level
tokenizer: documents cross the chunks of every degree, and most are longer than a rank's share), the
reference GPT (4 layers, width 128, 4 heads), 2 steps, fp32, one intra-op thread a process. ``densebatch
train`` runs on 1 process, then under torchrun on N processes with ``--train.context_parallel=N`` (one data
rank: every run trains the same rows). Each process is ``benchmarks/scale/memory_driver.py``, which records
the resident memory just before the first step (``before_step``) and the peak of the steps (``VmHWM``, reset
at each step's start): the step's own peak is ``step - before_step``, what the forward and backward passes
held above what the process held before its first forward (activations, what each layer keeps for its
backward, the exchanges' buffers, and the heap glibc keeps of freed copies: ``--mmap-threshold 131072`` leaves
that out); the true peak is the whole process's (``run``). The medians of the steps' seconds come from rank 0's
metrics (the N processes share the machine's cores: not a speed measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
from pathlib import Path

import yaml

from benchmarks.scale.state_memory import run

WORDS = "the of and to in is was for on that with as by at from his her they which this be are not or".split()


def corpus(path: Path, docs: int = 60, lengths: tuple[tuple[int, int], ...] = ((1500, 7000),), seed: int = 0) -> None:
    """``docs`` records of plain text, record i of ``lengths[i % len(lengths)]`` bytes (the byte-level tokenizer:
    as many tokens, and an end-of-text)."""
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as f:
        for i in range(docs):
            n, words = rng.randint(*lengths[i % len(lengths)]), []
            while sum(map(len, words)) + len(words) < n:
                words.append(rng.choice(WORDS))
            f.write(json.dumps({"text": " ".join(words)[:n]}) + "\n")


def config(work: Path, seq_len: int, *, steps: int = 2, lr: float = 1e-4, warmup: int = 0, model: dict | None = None) -> Path:
    """The runs' configuration: packed rows of ``seq_len`` tokens, one a batch, of ``work/long.jsonl``; ``model``:
    the reference GPT's keys (default 4 layers x 128, 4 heads)."""
    model = model or {"n_layer": 4, "n_head": 4, "n_embd": 128}
    cfg = {
        "seed": 0,
        "data": {
            "path": str(work / "long.jsonl"), "template": "raw", "tokenizer": "default", "max_seq_len": seq_len,
            "eval_fraction": 0.0, "cache_dir": str(work / "cache"),
        },
        "batching": {"strategy": "packed", "seq_len": seq_len, "max_tokens_per_batch": seq_len},
        "model": {**model, "block_size": seq_len},
        "train": {"max_steps": steps, "lr": lr, "warmup_steps": warmup, "progress": False, "plots": False, "device": "cpu"},
        "eval": {"accuracy_samples": 0},
        "checkpoint": {"every_steps": 0},
    }  # fmt: skip
    path = work / f"cfg-{seq_len}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--degrees", type=int, nargs="*", default=[1, 2, 4])
    ap.add_argument("--work", type=Path, default=None, help="working directory (default: a temporary one)")
    ap.add_argument(
        "--mmap-threshold", type=int, default=None,
        help="MALLOC_MMAP_THRESHOLD_ for the runs (bytes): glibc then maps every block above it on its own and returns "
        "it when freed, so the peaks count live memory without the heap that freed copies leave behind",
    )  # fmt: skip
    a = ap.parse_args()
    if a.mmap_threshold is not None:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(a.mmap_threshold)  # the runs inherit it
    work = a.work or Path(tempfile.mkdtemp(prefix="context-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    corpus(work / "long.jsonl")
    cfg = config(work, a.seq_len)
    rows = []
    for n in a.degrees:
        out = work / f"cp{n}"
        shutil.rmtree(out, ignore_errors=True)
        args = ["train", str(cfg), f"--output_dir={out}", f"--train.context_parallel={n}"]
        ranks = run(work, f"cp{n}", n, args)
        recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        seconds = statistics.median(r["step_s"] for r in recs if r["kind"] == "train")
        losses = [round(r["loss"], 6) for r in recs if r["kind"] == "train"]
        rows.append((n, ranks, seconds, losses))
    base = max(r["step"] - r["before_step"] for r in rows[0][1])
    malloc = f", MALLOC_MMAP_THRESHOLD_={a.mmap_threshold}" if a.mmap_threshold is not None else ", glibc's default malloc"
    print(f"\none row of {a.seq_len:,} tokens a step, reference GPT 4 x 128, fp32{malloc}; MiB\n")
    print(
        "| context ranks | rank | before the first step | step's own peak | × 1 rank | true peak (process) | step s (median) | losses |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for n, ranks, seconds, losses in rows:
        for i, r in enumerate(ranks):
            own = r["step"] - r["before_step"]
            tail = f" {seconds:.1f} | {losses} |" if i == 0 else " | |"
            print(f"| {n} | {i} | {r['before_step']:,.0f} | {own:,.0f} | {own / base:.2f} | {r['run']:,.0f} |{tail}")


if __name__ == "__main__":
    main()

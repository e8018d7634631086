"""The checks of context parallelism at 8,192-token rows: split rows train like whole rows, step by step (CPU, gloo).

``.venv/bin/python -m benchmarks.scale.context_check [--steps 10] [--seq-len 8192] [--work DIR]``

Packed rows of ``--seq-len`` tokens of generated text (byte-level tokenizer; every other document of 4,500
to 7,500 tokens, longer than half a row, the others of 200 to 3,000, packed beside them; documents cross the
chunks of both degrees), the reference GPT (2 layers, width 64, 4 heads), fp32, one row a batch, one intra-op thread
a process. Four ``densebatch train`` runs of the same configuration:

1. one process, 2 batches a step (the reference: the rows whole);
2. ``torchrun --nproc_per_node=2 ... --train.context_parallel=2`` (1 data rank × 2 context ranks), 2 batches a step;
3. ``torchrun --nproc_per_node=2 ... --train.distributed=ddp`` (2 data ranks), 1 batch a step on each;
4. ``torchrun --nproc_per_node=4 ... --train.context_parallel=2 --train.distributed=fsdp`` (2 data ranks × 2
   context ranks), 1 batch a step on each data rank.

Prints each run's losses and the largest relative difference of 2 against 1 and of 4 against 3 (and 3 against 1).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.scale.context_memory import config, corpus

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def train(work: Path, name: str, nproc: int, args: list[str]) -> list[float]:
    out = work / name
    cmd = [str(BIN / "densebatch")] if nproc == 1 else [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}", "--no-python", str(BIN / "densebatch")]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"))
    r = subprocess.run([*cmd, *args, f"--output_dir={out}", "--overwrite"], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{name}: failed\n{r.stderr[-3000:]}")
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if r["kind"] == "train"]


def worst(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--work", type=Path, default=None, help="working directory (default: a temporary one)")
    a = ap.parse_args()
    work = a.work or Path(tempfile.mkdtemp(prefix="context-check-"))
    work.mkdir(parents=True, exist_ok=True)
    corpus(work / "long.jsonl", docs=60, lengths=((4500, 7500), (200, 3000)))
    cfg = str(config(work, a.seq_len, steps=a.steps, lr=1e-3, warmup=2, model={"n_layer": 2, "n_head": 4, "n_embd": 64}))
    runs = {
        "one process": train(work, "one", 1, ["train", cfg, "--train.grad_accum_batches=2"]),
        "1 x 2 (context_parallel=2)": train(
            work, "cp2", 2, ["train", cfg, "--train.grad_accum_batches=2", "--train.context_parallel=2"]
        ),
        "2 x 1 DDP": train(work, "ddp2", 2, ["train", cfg, "--train.distributed=ddp"]),
        "2 x 2 FSDP2": train(work, "fsdp2x2", 4, ["train", cfg, "--train.context_parallel=2", "--train.distributed=fsdp"]),
    }
    for name, losses in runs.items():
        print(f"{name:28s} " + " ".join(f"{x:.7f}" for x in losses))
    names = list(runs)
    print(f"\nlargest relative difference, context_parallel=2 against one process: {worst(runs[names[1]], runs[names[0]]):.2e}")
    print(
        f"largest relative difference, 2 x 2 FSDP2 against DDP over the 2 data ranks: {worst(runs[names[3]], runs[names[2]]):.2e}"
    )
    print(f"largest relative difference, DDP over 2 data ranks against one process: {worst(runs[names[2]], runs[names[0]]):.2e}")


if __name__ == "__main__":
    main()

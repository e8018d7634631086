"""DPO learns on the embedded default task: from an SFT checkpoint, the right answer preferred over a wrong one.

    .venv/bin/python -m benchmarks.quality.dpo_learnability [--sft-steps 300] [--dpo-steps 120] [--work DIR]

1. SFT: the demo (``densebatch train`` with no configuration: the generated instruction tasks, bpe:1024, a
   4-layer GPT of width 128, packed rows), ``--sft-steps`` steps.
2. DPO from its ``final/`` (``model.path``, its tokenizer ``data.tokenizer``): the same records as pairs
   (``train.objective: dpo``: each record's answer chosen over a wrong answer of its task,
   ``default_dataset.as_pair``), the reference being the SFT weights (live: a run of a few steps scores no more
   than it trains on), one packed batch of 4,096 slots a step, learning rate 1e-4, beta 0.1, evaluated every 10
   steps on ~30,000 tokens of held-out pairs.

Reported: the held-out ``rewards/accuracies`` and ``rewards/margins`` of each evaluation, and the exact-match
accuracy of the greedy answers before (SFT) and after DPO. Target: held-out reward accuracy >= 0.9.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import REPO

QUIET = ["--train.progress=false", "--train.plots=false", "--eval.accuracy_samples=200"]


def train(args: list[str]) -> None:
    subprocess.run([sys.executable, "-m", "densebatch.cli", "train", *args], check=True, cwd=REPO, env=dict(os.environ))


def evals(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r.get("kind") == "eval"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sft-steps", type=int, default=300)
    ap.add_argument("--dpo-steps", type=int, default=120)
    ap.add_argument("--work", default=None)
    a = ap.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="dpo-learn-"))
    cache = f"--data.cache_dir={work / 'cache'}"
    sft, dpo = work / "sft", work / "dpo"
    if not (sft / "final").is_dir():
        train([f"--output_dir={sft}", f"--train.max_steps={a.sft_steps}", cache, *QUIET])
    final = sft / "final"
    train(
        [
            f"--output_dir={dpo}", "--overwrite", "--train.objective=dpo", f"--model.path={final}", f"--data.tokenizer={final}",
            f"--train.max_steps={a.dpo_steps}", "--train.lr=1e-4", "--train.warmup_steps=10", "--train.beta=0.1",
            "--train.loss_tokens_per_step=null", "--train.reference=live", "--eval.every_steps=10", "--eval.max_tokens=30000",
            cache, *QUIET,
        ]
    )  # fmt: skip
    before = evals(sft)[-1].get("accuracy")
    print(f"SFT ({a.sft_steps} steps): held-out exact-match accuracy {before}")
    for r in evals(dpo):
        print(
            f"DPO step {r['step']:>4}: held-out rewards/accuracies {r['rewards/accuracies']:.3f}  rewards/margins "
            f"{r['rewards/margins']:.3f}  ({r['pairs']} pairs)"
            + (f"  exact-match {r['accuracy']:.3f}" if "accuracy" in r else "")
        )


if __name__ == "__main__":
    main()

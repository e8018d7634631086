"""Long packed rows through a Hugging Face model: do memory and time grow with the documents or with the row?

    .venv/bin/python -m benchmarks.model.hf_long_rows [--impls densebatch,sdpa] [--rows 1024,16384] [--steps 3]

A 2-layer Llama-architecture model built from a config (hidden 64, 4 heads, 2 key/value heads,
vocabulary 2,048, random weights) is trained by ``densebatch train --model.kind=hf`` on Shakespeare
cut into ~1,000-token documents (``data.tokenizer: bpe:2048``, ``data.text_split: chunks``), packed
16,384 tokens a batch: once as rows of 1,024 tokens (16 rows), once as one row of 16,384. The same
documents, the same tokens a step; only the row length differs. Reported per run (one process each,
run one after the other): the median step time after the first step (``step_s`` of metrics.jsonl),
and the process's peak resident memory (``mem_peak_rss_gb``). ``densebatch`` is the default
attention (documents one by one through transformers' attention interface); ``sdpa`` is the older
path, a (rows, 1, T, T) document mask handed to transformers' SDPA.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import REPO, require_shared_data


def model_dir(root: Path) -> Path:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=2048, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16384, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    out = root / "llama-2l"
    config.save_pretrained(out)
    return out


def run(impl: str, row: int, steps: int, model: Path, shared: Path, threads: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="long-rows-") as tmp:
        cmd = [
            sys.executable, "-m", "densebatch.cli", "train", f"--output_dir={tmp}/run",
            "--model.kind=hf", f"--model.path={model}", f"--model.attn_implementation={impl}",
            f"--data.path={shared / 'tinyshakespeare.txt'}", "--data.format=text", "--data.tokenizer=bpe:2048",
            "--data.text_split=chunks", "--data.chunk_tokens=1000", "--data.max_seq_len=1024",
            "--batching.strategy=packed", f"--batching.seq_len={row}", "--batching.max_tokens_per_batch=16384",
            f"--train.max_steps={steps}", "--train.loss_tokens_per_step=null", "--train.progress=false",
            "--train.plots=false", "--eval.every_steps=0", "--eval.accuracy_samples=0", "--checkpoint.every_steps=0",
        ]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(REPO / "src"))
        r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"{impl} rows of {row} failed:\n{r.stderr[-3000:]}")
        lines = [json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [x for x in lines if x["kind"] == "train"]
    return {
        "impl": impl,
        "row": row,
        "step_s": statistics.median(x["step_s"] for x in train[1:]),
        "peak_gb": max(x["mem_peak_rss_gb"] for x in train),
        "slots": statistics.median(x["slot_tokens"] for x in train),
        "real": statistics.median(x["real_tokens"] for x in train),
        "loss": train[-1]["loss"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impls", default="densebatch,sdpa")
    ap.add_argument("--rows", default="1024,16384")
    ap.add_argument("--steps", type=int, default=3, help="steps a run (the first, warm-up, is not timed)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--data-dir", default=None)
    a = ap.parse_args()
    shared = require_shared_data(a.data_dir)
    with tempfile.TemporaryDirectory() as root:
        model = model_dir(Path(root))
        results = [
            run(impl, int(row), a.steps, model, shared, a.threads) for impl in a.impls.split(",") for row in a.rows.split(",")
        ]
    print("| attn_implementation | row length | slots a step | real tokens a step | step time (s) | peak RSS (GB) |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['impl']} | {r['row']:,} | {r['slots']:,.0f} | {r['real']:,.0f} | {r['step_s']:.3f} | {r['peak_gb']:.2f} |")
    for impl in a.impls.split(","):
        mine = {r["row"]: r for r in results if r["impl"] == impl}
        if len(mine) == 2:
            short, long = (mine[k] for k in sorted(mine))
            print(
                f"{impl}: rows of {long['row']:,} vs {short['row']:,}: step time x{long['step_s'] / short['step_s']:.2f}, "
                f"peak memory {long['peak_gb'] - short['peak_gb']:+.2f} GB"
            )


if __name__ == "__main__":
    main()

"""Preparation throughput against the tokenizer's own limit: ``densebatch prepare`` of an instruction file
vs ``encode_batch`` of the same rendered texts, back to back, on the same cores.

    .venv/bin/python -m benchmarks.scale.prepare_throughput --records 200000 [--repeats 3] [--num-proc 0]

The file: the shared Alpaca-style instruction data cycled to ``--records`` records, each made unique (a
numbered instruction), so nothing is deduplicated. The limit: the texts ``prepare`` tokenises (each
record's segments, rendered by the same template code) through the same GPT-2 BPE's ``encode_batch``
in batches of 4,096 texts, with the library's own threads on every core: reading, rendering and storing
are not in it (``encode_batch_fast``, which prepare calls, is timed too). Each repeat times all three,
reversing the order every other repeat; medians are printed with their ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import require_shared_data
from densebatch.config import DataConfig
from densebatch.data.prepare.pipeline import prepare
from densebatch.data.prepare.templates import render
from densebatch.data.prepare.tokenizers import load_data_tokenizer


def write_file(shared: Path, n: int, path: Path, dataset: str = "instruction") -> None:
    """``n`` records cycled from a shared set, each made unique (a number in its first text): the Alpaca
    instruction data, or (``oasst``) the chat threads, prepared with the chatml template."""
    if dataset == "oasst":
        lines = (shared / "oasst-threads.jsonl").read_text(encoding="utf-8").splitlines()
        base = [json.loads(x) for x in lines if x.strip()]
    else:
        base = json.loads((shared / "instruction-data.json").read_text(encoding="utf-8"))
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            r = json.loads(json.dumps(base[i % len(base)]))
            if dataset == "oasst":
                r["messages"][0]["content"] = f"{r['messages'][0]['content']} (#{i})"
            else:
                r["instruction"] = f"{r['instruction']} (#{i})"
            f.write(json.dumps(r) + "\n")


def raw_seconds(cfg: DataConfig, path: Path, fast: bool = False) -> tuple[float, int]:
    """Seconds of the ``tokenizers`` library's ``encode_batch`` (``fast``: ``encode_batch_fast``, the same ids
    without character offsets) over every segment text prepare tokenises (rendered first, not timed)."""
    tok = load_data_tokenizer(cfg)._tok  # the library's Tokenizer itself: no wrapper of ours in the limit
    encode = tok.encode_batch_fast if fast else tok.encode_batch
    texts = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            texts += [t for t, _ in render(json.loads(line), cfg)]
    t0 = time.perf_counter()
    n = 0
    for lo in range(0, len(texts), 4096):
        n += sum(len(e.ids) for e in encode(texts[lo : lo + 4096], add_special_tokens=False))
    return time.perf_counter() - t0, n


def fast_seconds(cfg: DataConfig, path: Path) -> tuple[float, int]:
    return raw_seconds(cfg, path, fast=True)


def prepare_seconds(cfg: DataConfig) -> tuple[float, int]:
    t0 = time.perf_counter()
    p = prepare(cfg)
    return time.perf_counter() - t0, p.summary.train_tokens + p.summary.eval_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-proc", type=int, default=0, help="data.num_proc (0: the cores available)")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--dataset", choices=("instruction", "oasst"), default="instruction")
    args = ap.parse_args()
    shared = require_shared_data(args.data_dir)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "instructions.jsonl"
        write_file(shared, args.records, path, args.dataset)
        times: dict[str, list[float]] = {"raw": [], "fast": [], "prepare": []}
        for rep in range(args.repeats):
            cfg = DataConfig(
                path=str(path), tokenizer=str(shared / "gpt2"), cache_dir=str(Path(d) / f"cache-{rep}"),
                max_seq_len=4096, num_proc=args.num_proc, template="chatml" if args.dataset == "oasst" else "alpaca",
            )  # fmt: skip
            order = [("raw", raw_seconds), ("fast", fast_seconds), ("prepare", lambda c, _p: prepare_seconds(c))]
            for name, fn in order if rep % 2 == 0 else order[::-1]:
                seconds, tokens = fn(cfg, path)
                times[name].append(seconds)
                print(f"repeat {rep}: {name:8s} {seconds:7.2f} s  {tokens:,} tokens", flush=True)
        r, f, o = (statistics.median(times[k]) for k in ("raw", "fast", "prepare"))
        print(
            f"{args.records:,} records: prepare {o:.2f} s ({args.records / o:,.0f} records/s); the library's encode_batch "
            f"{r:.2f} s: prepare at {r / o:.2f} of it; encode_batch_fast {f:.2f} s: at {f / o:.2f} of it"
        )


if __name__ == "__main__":
    main()

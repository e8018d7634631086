"""Step time of HF Trainer + dense_batches(source_column=...) with the source weights inside the fused head, beside the code before.

    python -m benchmarks.throughput.hf_trainer_sources [--before-rev 5304cd9] [--steps 8] [--repeats 3]

Before: the weights multiplied the fused head's per-token losses outside it (``(losses * w).sum()``), so the
head's backward, given a gradient that differs from token to token, projected the head again to weigh its
weight gradient. After: the weights go into ``head_token_losses(token_weights=...)``, whose forward already
weighs its gradient sums; the backward scales them. Both give the same loss and gradients
(tests/integrations/test_hf_loss.py).

One model (a 2-layer Llama shape with GPT-2's vocabulary of 50,257, random weights saved once, untied head) and
one two-source data set (the instruction and oasst documents of ../shared/data as GPT-2 ids, a ``source`` column
naming each, loss on every token). Each variant runs ``--steps`` optimizer steps after one warm-up step, in a
process of its own (one thread, fp32, AdamW, packed rows of ``--seq-len``, ``--tokens`` token slots a step), the
variants interleaved (A B C, A B C, ...); step times come from a callback (step begin to step end), as wall
time and as the process's CPU time (one thread: the CPU time is the step's work, and moves less than the wall
time when other processes share the cores):

- ``before``: densebatch's source tree at ``--before-rev`` (``git archive``), weights outside the head;
- ``after``: this checkout's source tree, weights inside the head;
- ``unweighted``: this checkout without ``source_column`` (the head's cost with no weights at all).

The first step's logged loss of each run is printed beside its times: before and after must agree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

from benchmarks.throughput.hf_setup import save_llama, step_clock

VARIANTS = ("before", "after", "unweighted")
REPO = Path(__file__).resolve().parents[2]


def _setup(work: Path, shared: Path, docs: int) -> None:
    """The model (random weights, saved) and the two-source data set (GPT-2 ids, as JSON) every variant reads."""

    from benchmarks.common import texts
    from densebatch.testing.book import gpt2_tokenizer

    tok = gpt2_tokenizer(shared / "gpt2")
    rows = []
    for source in ("instruction", "oasst"):
        for enc in tok.encode_batch(texts(source, shared)[:docs]):
            rows.append({"input_ids": (enc.ids + [50256])[:1024], "source": source})
    rows = [r for pair in zip(rows[:docs], rows[docs:]) for r in pair]  # the sources interleaved
    (work / "rows.json").write_text(json.dumps(rows))
    save_llama(work / "model")


def _child(variant: str, work: Path, steps: int, tokens: int, seq_len: int) -> dict:
    """1 + ``steps`` optimizer steps of Trainer + dense_batches; the timed steps' seconds and the first logged loss."""
    import torch

    torch.set_num_threads(1)
    import datasets
    import transformers

    import densebatch

    rows = json.loads((work / "rows.json").read_text())
    ds = datasets.Dataset.from_dict({k: [r[k] for r in rows] for k in ("input_ids", "source")})
    model = transformers.AutoModelForCausalLM.from_pretrained(work / "model", attn_implementation=densebatch.register_attention())
    times: list[float] = []
    cpu: list[float] = []

    args = transformers.TrainingArguments(
        output_dir=str(work / f"out-{variant}"), max_steps=steps + 1, learning_rate=1e-4, weight_decay=0.0, seed=5,
        report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, logging_steps=1, max_grad_norm=1.0,
        dataloader_num_workers=0,
    )  # fmt: skip
    trainer = transformers.Trainer(model=model, args=args, train_dataset=ds, callbacks=[step_clock(times, cpu)])
    sources = {} if variant == "unweighted" else {"source_column": "source"}
    densebatch.dense_batches(trainer, strategy="packed", seq_len=seq_len, max_tokens_per_batch=tokens, pad_id=50256, **sources)
    trainer.train()
    first = next(h["loss"] for h in trainer.state.log_history if "loss" in h)
    return {
        "times": times[1:],
        "cpu": cpu[1:],
        "first_loss": first,
        "loss_path": trainer.densebatch_loss,
        "densebatch": densebatch.__file__,
    }


def _before_tree(rev: str, into: Path) -> Path:
    """densebatch's ``src/`` at git revision ``rev``, extracted under ``into``."""
    blob = subprocess.run(["git", "-C", str(REPO), "archive", rev, "src"], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(blob)) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def _run(variant: str, work: Path, src: Path, a) -> dict:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": str(src),
    }
    cmd = [sys.executable, "-m", "benchmarks.throughput.hf_trainer_sources", "--child", variant, "--work", str(work)]
    cmd += ["--steps", str(a.steps), "--tokens", str(a.tokens), "--seq-len", str(a.seq_len)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600, cwd=REPO)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _report(runs: dict[str, list[dict]], a) -> str:
    ok = {v: rs for v, rs in runs.items() if rs and all("times" in r for r in rs)}
    med = {v: statistics.median(t for r in rs for t in r["times"]) for v, rs in ok.items()}
    total = {v: statistics.median(sum(r["times"]) for r in rs) for v, rs in ok.items()}
    cpu = {v: statistics.median(c for r in rs for c in r["cpu"]) for v, rs in ok.items()}
    lines = [
        f"{a.tokens} token slots a step (packed rows of {a.seq_len}), {a.steps} timed steps, {a.repeats} interleaved runs each",
        "",
        f"| variant | median step, wall (s) | {a.steps} steps, median run (s) | x before | median step, CPU (s) | x before "
        "| first-step loss | loss path |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for v, rs in runs.items():
        if v not in ok:
            lines.append(f"| {v} | failed: {next((r['error'] for r in rs if 'error' in r), '?')} | | | | | | |")
            continue
        ratio = f"{total[v] / total['before']:.3f}" if "before" in total else "-"
        cratio = f"{cpu[v] / cpu['before']:.3f}" if "before" in cpu else "-"
        lines.append(
            f"| {v} | {med[v]:.3f} | {total[v]:.2f} | {ratio} | {cpu[v]:.3f} | {cratio} | {rs[0]['first_loss']:.6f} "
            f"| {rs[0]['loss_path']} |"
        )
    lines += [
        "",
        "per run, in run order (s): "
        + "; ".join(f"{v} " + ", ".join(f"{sum(r['times']):.2f}" for r in rs) for v, rs in ok.items()),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before-rev", default="5304cd9", help="the git revision whose src/ is 'before'")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokens", type=int, default=2048, help="token slots a step (max_tokens_per_batch)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--docs", type=int, default=300, help="documents taken from each set")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--work", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(_child(a.child, Path(a.work), a.steps, a.tokens, a.seq_len)))
        return
    from benchmarks.common import require_shared_data

    shared = require_shared_data(a.data_dir)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        _setup(work, shared, a.docs)
        srcs = {"before": _before_tree(a.before_rev, work / "before"), "after": REPO / "src", "unweighted": REPO / "src"}
        runs: dict[str, list[dict]] = {v: [] for v in a.variants}
        for _ in range(a.repeats):  # interleaved: A B C, A B C, ...
            for v in a.variants:
                runs[v].append(_run(v, work, srcs[v], a))
        print(_report(runs, a), flush=True)


if __name__ == "__main__":
    main()

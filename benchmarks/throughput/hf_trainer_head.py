"""Step time and peak resident memory of densebatch's loop against HF Trainer / TRL, with and without densebatch's loss head.

    python -m benchmarks.throughput.hf_trainer_head [--data instruction oasst] [--steps 8] [--repeats 2]

One model (a 2-layer Llama shape with GPT-2's vocabulary of 50,257, random weights saved once, untied head),
one tokenized data set (the documents of ../shared/data, loss on every token), the same tokens per step.
Each method runs ``--steps`` optimizer steps (after one warm-up step) in a subprocess of its own, one thread,
so that its peak resident memory (``ru_maxrss``) is its own; the runs are interleaved (A B C .. A B C ..) and
each method's median step time and its median total over the timed steps are reported with their ratios to
``densebatch train`` (the command) and to densebatch's loop run in-process.

- ``densebatch_train``: the ``densebatch train`` command itself (``model.kind: hf`` on the saved model, the ids as a
  JSONL file, packed rows, fp32, the same optimizer settings), a process of its own; its step times from its
  metrics.jsonl (``step_s``: the batch fetched, forward, backward, clip, AdamW, the record written), its peak from
  ``ru_maxrss`` of that process (start-up, preparing the ids and the end evaluation included);
- ``densebatch``: densebatch's own step in-process: ``HFCausalLM.token_losses`` (fused head) on
  ``densebatch.dataloader(format="batch")`` packed batches, summed over the step's loss tokens, AdamW;
- ``trainer``: ``transformers.Trainer`` + ``densebatch.dense_batches`` (densebatch's loss path);
- ``trainer_hf``: the same with ``dense_batches(loss="hf")`` (the model's logits and transformers' loss);
- ``sft``: TRL ``SFTTrainer`` + ``dense_batches``;
- ``trl_packing``: TRL's own packing (``packing=True``, BFD, padding-free rows of ``seq_len``);
- ``trl_padded``: TRL padded batches of as many documents as make the tokens per step on average.

All use AdamW (lr 1e-4, no weight decay), gradient clipping at 1.0, fp32, densebatch attention (sdpa for
the padded rows). Trainer step times come from a callback (step begin to step end), densebatch's from its loop.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.throughput.hf_setup import save_llama, step_clock

METHODS = ("densebatch_train", "densebatch", "trainer", "trainer_hf", "sft", "trl_packing", "trl_padded")


def _setup(work: Path, data: str, shared: Path, docs: int) -> None:
    """The model (random weights, saved) and the data set (GPT-2 token ids, as JSON) every method reads."""
    import transformers

    from benchmarks.common import texts
    from densebatch.testing.book import gpt2_tokenizer

    eot = "<|endoftext|>"
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=gpt2_tokenizer(shared / "gpt2"), eos_token=eot, pad_token=eot)
    ids = [(t + [tok.eos_token_id])[:1024] for t in tok(texts(data, shared)[:docs])["input_ids"]]
    (work / "ids.json").write_text(json.dumps(ids))
    (work / "ids.jsonl").write_text("".join(json.dumps({"input_ids": t}) + "\n" for t in ids))
    tok.save_pretrained(work / "tok")
    save_llama(work / "model")


def _cli(work: Path, steps: int, tokens: int, seq_len: int) -> dict:
    """``densebatch train`` (the real command, a process of its own) for 1 + ``steps`` steps on the saved model and ids.

    Its step times are the ``step_s`` of its metrics.jsonl train records (a step: fetching its batch from the
    loader, forward and backward with the fused head, clipping, AdamW, writing its record); its peak resident
    memory is its ``ru_maxrss`` (RUSAGE_CHILDREN: this wrapper process starts no other child); its wall time
    includes start-up (imports, preparing the ids into densebatch's store, planning), the end evaluation
    (one batch) and the final checkpoint.
    """
    out = Path(tempfile.mkdtemp(dir=work, prefix="cli-"))
    args = [
        "train", f"--output_dir={out / 'run'}", f"--data.cache_dir={out / 'cache'}", f"--data.path={work / 'ids.jsonl'}",
        f"--data.tokenizer={work / 'tok'}", "--data.loss_on=all", f"--data.eval_path={work / 'ids.jsonl'}",
        f"--data.max_seq_len={seq_len}", "--model.kind=hf", f"--model.path={work / 'model'}", "--batching.strategy=packed",
        f"--batching.seq_len={seq_len}", f"--batching.max_tokens_per_batch={tokens}", f"--train.max_steps={steps + 1}",
        "--train.lr=1e-4", "--train.schedule=constant", "--train.warmup_steps=0", "--train.optimizer.weight_decay=0",
        "--train.optimizer.beta2=0.999", "--train.grad_clip=1.0", "--train.precision=fp32", "--train.device=cpu",
        "--train.progress=false", "--train.plots=false", "--train.guard.spike_zscore=0", "--eval.max_batches=1",
        "--eval.accuracy_samples=0", "--seed=5",
    ]  # fmt: skip
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "densebatch", *args], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"densebatch train failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    recs = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_s"] for r in recs if r.get("kind") == "train"]
    if len(times) != steps + 1:
        raise SystemExit(f"densebatch train logged {len(times)} steps, expected {steps + 1}")
    return {"times": times[1:], "maxrss_kb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, "wall_s": wall}


def _child(method: str, work: Path, steps: int, tokens: int, seq_len: int) -> dict:
    """Run ``method`` for 1 + ``steps`` optimizer steps; its step times and its peak resident memory."""
    if method == "densebatch_train":
        return _cli(work, steps, tokens, seq_len)
    import torch

    torch.set_num_threads(1)
    import datasets
    import transformers

    import densebatch

    ids = json.loads((work / "ids.json").read_text())
    ds = datasets.Dataset.from_dict({"input_ids": ids})
    attn = densebatch.register_attention()
    packed = dict(strategy="packed", seq_len=seq_len, max_tokens_per_batch=tokens, pad_id=50256)
    times: list[float] = []
    if method == "densebatch":
        from densebatch.model.hf.adapter import HFCausalLM

        model = HFCausalLM(work / "model").train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.0)
        loader = densebatch.dataloader(ds, **packed, seed=5, format="batch")
        for _, batch in zip(range(steps + 1), loader):
            t0 = time.perf_counter()
            (model.token_losses(batch).sum() / max(batch.num_loss_tokens, 1)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
        return {"times": times[1:], "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}

    common = dict(
        output_dir=str(work / f"out-{method}"), max_steps=steps + 1, learning_rate=1e-4, weight_decay=0.0, seed=5,
        report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, logging_steps=1000, max_grad_norm=1.0,
        dataloader_num_workers=0,
    )  # fmt: skip
    tok = transformers.AutoTokenizer.from_pretrained(work / "tok")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        work / "model", attn_implementation="sdpa" if method == "trl_padded" else attn
    )
    if method in ("trainer", "trainer_hf"):
        trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(**common), train_dataset=ds)
        densebatch.dense_batches(trainer, **packed, loss="hf" if method == "trainer_hf" else "densebatch")
    else:
        import trl

        mean_len = sum(map(len, ids)) / len(ids)
        rows = {"sft": 1, "trl_packing": max(1, tokens // seq_len), "trl_padded": max(1, round(tokens / mean_len))}[method]
        args = trl.SFTConfig(
            **common, packing=method == "trl_packing", max_length=seq_len if method == "trl_packing" else 1024,
            per_device_train_batch_size=rows, dataset_kwargs={"skip_prepare_dataset": method == "sft"},
            bf16=False,  # SFTConfig's defaults are bf16 autocast and gradient checkpointing: every method here runs
            gradient_checkpointing=False,  # in fp32 and keeps its activations
        )  # fmt: skip
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)
        if method == "sft":
            densebatch.dense_batches(trainer, **packed)
    trainer.add_callback(step_clock(times))
    trainer.train()
    line = getattr(trainer, "densebatch_loss", "-")
    return {"times": times[1:], "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "loss_path": line}


def _run(method: str, work: Path, a) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "benchmarks.throughput.hf_trainer_head", "--child", method, "--work", str(work)]
    cmd += ["--steps", str(a.steps), "--tokens", str(a.tokens), "--seq-len", str(a.seq_len)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1:] or ["?"]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _report(data: str, runs: dict[str, list[dict]], a) -> str:
    """A markdown table: median step time, the median run's total over its ``steps`` timed steps, peak RSS, and
    their ratios to ``densebatch train`` (the command) and to densebatch's loop run in-process."""
    ok = {m: rs for m, rs in runs.items() if rs and all("times" in r for r in rs)}
    med = {m: statistics.median(t for r in rs for t in r["times"]) for m, rs in ok.items()}
    total = {m: statistics.median(sum(r["times"]) for r in rs) for m, rs in ok.items()}
    rss = {m: statistics.median(r["maxrss_kb"] for r in rs) / 1024 for m, rs in ok.items()}

    def ratio(x: dict, m: str, base: str) -> str:
        return f"{x[m] / x[base]:.2f}" if base in x else "-"

    lines = [
        f"{data}: {a.tokens} token slots a step (packed rows of {a.seq_len}), {a.steps} timed steps, {a.repeats} interleaved runs each",
        "",
        f"| method | median step (s) | {a.steps} steps (s) | x densebatch train | peak RSS (MiB) | x densebatch train "
        "| x loop: time | x loop: RSS | loss path |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m, rs in runs.items():
        if m not in ok:
            lines.append(f"| {m} | failed: {next((r['error'] for r in rs if 'error' in r), '?')} | | | | | | | |")
            continue
        lines.append(
            f"| {m} | {med[m]:.3f} | {total[m]:.2f} | {ratio(total, m, 'densebatch_train')} | {rss[m]:.0f} "
            f"| {ratio(rss, m, 'densebatch_train')} | {ratio(total, m, 'densebatch')} | {ratio(rss, m, 'densebatch')} "
            f"| {rs[0].get('loss_path', '-')} |"
        )
    lines += ["", f"{a.steps}-step totals per run, in run order (s): " + "; ".join(
        f"{m} " + ", ".join(f"{sum(r['times']):.1f}" for r in rs) for m, rs in ok.items()
    )]  # fmt: skip
    if "densebatch_train" in ok:
        walls = ", ".join(f"{r['wall_s']:.1f}" for r in ok["densebatch_train"])
        lines += ["", f"densebatch train wall time per run, start-up, end evaluation and checkpoint included (s): {walls}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", nargs="+", default=["instruction", "oasst"], help="shared sets: instruction, oasst")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2048, help="token slots a step (densebatch's max_tokens_per_batch)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--docs", type=int, default=600, help="documents taken from the set")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    p.add_argument("--work", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(_child(a.child, Path(a.work), a.steps, a.tokens, a.seq_len)))
        return
    from benchmarks.common import require_shared_data

    shared = require_shared_data(a.data_dir)
    for data in a.data:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            _setup(work, data, shared, a.docs)
            runs: dict[str, list[dict]] = {m: [] for m in a.methods}
            for _ in range(a.repeats):  # interleaved: A B C .. A B C ..
                for m in a.methods:
                    runs[m].append(_run(m, work, a))
            print(_report(data, runs, a), flush=True)
            print(flush=True)


if __name__ == "__main__":
    main()

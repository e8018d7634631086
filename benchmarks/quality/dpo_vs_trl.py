"""DPO: densebatch (pairs packed, each prompt laid once) against TRL's DPOTrainer (padded, and padding-free), side by side.

    .venv/bin/python -m benchmarks.quality.dpo_vs_trl [--sets oasst,instruction] [--repeats 3] [--out dpo.jsonl]

The same pairs (the same token ids: GPT-2's BPE, ids renumbered into a compact vocabulary shared by every
arm), the same model and starting weights (a 4-layer Llama of width 256, saved once, loaded by every arm),
fp32 on the CPU, one epoch, the same optimizer (AdamW, weight decay 0, betas 0.9 / 0.999, learning rate
decaying linearly to 0, clip 1.0) and the same pairs a step on average (TRL: 8 pairs a batch; densebatch:
a token budget of 8 average pairs as laid, rounded to whole packed rows). The reference is live in every
arm (TRL's default: the reference runs each step). TRL's configs default to bf16 autocast and gradient
checkpointing: both are set off, as densebatch runs.

Sets:
- ``oasst``: ../shared/data/oasst-threads.jsonl, threads that share their conversation and differ in the
  final assistant reply: each ranked reply (``path_ranks``' last, 0 best) chosen over each one ranked below
  it; a quarter of the trees held out, whole. Pairs whose prompt and longer answer pass 384 tokens are left out.
- ``instruction``: ../shared/data/instruction-data.json, not tuned on: each record's answer chosen over the
  answer of another record (drawn from the seed), a sixth held out.

Arms run one at a time, each in its own process (its peak resident memory is its own), interleaved: every
repeat runs every arm, in a rotated order, so the machine's load falls on all alike; the load average is
recorded beside each run. Reported per set and arm (medians over the repeats): pairs/s and pair tokens/s
(each pair's prompt and two answers counted once, whatever the layout), peak memory, and on the held-out
pairs (scored by one function for every arm: densebatch's per-pair sums, the reference being the starting
weights) reward accuracy and margin at the end, and the training time to reach TRL-padded's final held-out
accuracy (evaluations at each quarter of the epoch; their time is not training time).

TRL 1.16's DPOTrainer warns that ``padding_free=True`` is "temporarily unavailable" and falls back to padding:
its arm runs what TRL runs when asked for it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from benchmarks.common import REPO, require_shared_data

ARMS = ("densebatch", "trl-padded", "trl-padding-free")
PAIRS_PER_STEP = 8
LR = 5e-4
BETA = 0.1
MAX_SIDE = 384  # prompt + the longer answer, in GPT-2 tokens


# ------------------------------------------------------------------------------------------- pairs
def oasst_pairs(shared: Path) -> tuple[list, list]:
    """(train, held-out) text pairs (prompt, chosen, rejected) from the chat threads; trees held out whole."""
    recs = [
        json.loads(line) for line in (shared / "oasst-threads.jsonl").read_text(encoding="utf-8").splitlines() if line.strip()
    ]
    groups: dict = defaultdict(list)
    for r in recs:
        if r["path_ranks"][-1] is not None:  # an unranked final reply prefers nothing
            groups[(r["tree_id"], json.dumps(r["messages"][:-1]))].append(r)
    train, held = [], []
    trees = sorted({t for t, _ in groups})
    out_trees = set(random.Random(0).sample(trees, len(trees) // 4))
    for (tree, _), g in sorted(groups.items()):
        g = sorted(g, key=lambda r: r["path_ranks"][-1])
        prompt = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in g[0]["messages"][:-1]) + "Assistant:"
        for i, better in enumerate(g):
            for worse in g[i + 1 :]:  # every reply over each reply ranked below it
                pair = (prompt, " " + better["messages"][-1]["content"], " " + worse["messages"][-1]["content"])
                (held if tree in out_trees else train).append(pair)
    return train, held


def instruction_pairs(shared: Path) -> tuple[list, list]:
    recs = json.loads((shared / "instruction-data.json").read_text(encoding="utf-8"))
    rng = random.Random(0)
    pairs = []
    for i, r in enumerate(recs):
        other = recs[(i + rng.randrange(1, len(recs))) % len(recs)]
        prompt = f"Instruction: {r['instruction']}\n" + (f"Input: {r['input']}\n" if r["input"] else "") + "Response:"
        if other["output"] != r["output"]:
            pairs.append((prompt, " " + r["output"], " " + other["output"]))
    cut = len(pairs) - len(pairs) // 6
    return pairs[:cut], pairs[cut:]


def tokenized(shared: Path, name: str) -> dict:
    """The set's pairs as GPT-2 ids (each answer ending with <|endoftext|>) renumbered into a compact vocabulary."""
    from densebatch.testing.book import gpt2_tokenizer

    tok = gpt2_tokenizer(shared / "gpt2")
    train, held = (oasst_pairs if name == "oasst" else instruction_pairs)(shared)

    def ids(pairs):
        out = []
        for p, c, r in pairs:
            p, c, r = (tok.encode(x).ids for x in (p, c, r))
            c, r = c + [50256], r + [50256]
            if len(p) + max(len(c), len(r)) <= MAX_SIDE and c != r:
                out.append([p, c, r])
        return out

    train, held = ids(train), ids(held)
    used = sorted({t for pairs in (train, held) for pair in pairs for part in pair for t in part} | {50256})
    new = {t: i for i, t in enumerate(used)}
    remap = lambda pairs: [[[new[t] for t in part] for part in pair] for pair in pairs]  # noqa: E731
    return {"train": remap(train), "held": remap(held), "vocab": len(used), "eos": new[50256]}


def save_model(data: dict, path: Path) -> None:
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=data["vocab"], hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=data["eos"],
        eos_token_id=data["eos"], pad_token_id=data["eos"],
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)


# ------------------------------------------------------------------------------------------ scoring
class HeldOut:
    """Held-out reward accuracy and margin of any model's weights, one function for every arm: densebatch's
    per-pair sums over the held-out pairs (packed, prompt once), the reference being the starting weights."""

    def __init__(self, data: dict, model_dir: Path):
        import numpy as np
        import torch

        from densebatch.data.load.pair_collate import PairCollator
        from densebatch.data.store.pair_layout import pair_document
        from densebatch.data.store.store import DocumentStore
        from densebatch.model.hf.adapter import HFCausalLM
        from densebatch.train.objectives.pair_logps import pair_logps

        docs = [pair_document(np.array(p), np.array(c), np.array(r), chosen_loss=np.ones(len(c)), rejected_loss=np.ones(len(r))) for p, c, r in data["held"]]  # fmt: skip
        store = DocumentStore.from_documents(docs, meta={"eos_id": data["eos"], "pad_id": data["eos"], "pairs": True})
        n = [int(x) for x in store.lengths]
        collator = PairCollator(data["eos"])
        self.batches = [collator(store, [[(d, 0, n[d])] for d in range(k, min(len(n), k + 8))]) for k in range(0, len(n), 8)]
        self.model = HFCausalLM(model_dir).eval()
        self.pair_logps, self.torch = pair_logps, torch
        self.reference = self.sums(self.model.hf.state_dict())

    def sums(self, state: dict):
        self.model.hf.load_state_dict(state)
        with self.torch.no_grad():
            return self.torch.cat([self.pair_logps(self.model.token_losses(b), b).sums for b in self.batches])

    def __call__(self, state: dict) -> dict:
        ratio = BETA * (self.sums(state) - self.reference)
        margin = ratio[:, 0] - ratio[:, 1]
        return {"accuracy": float((margin > 0).float().mean()), "margin": float(margin.mean())}


# --------------------------------------------------------------------------------------------- arms
def run_densebatch(data: dict, model_dir: Path, score: HeldOut, marks: list[int]) -> dict:
    import numpy as np

    from densebatch.config import OptimizerConfig, TrainConfig
    from densebatch.data.load.loader import StepLoader
    from densebatch.data.load.pair_collate import PairCollator
    from densebatch.data.plan.planner import PlanSettings
    from densebatch.data.plan.steps import StepSettings
    from densebatch.data.store.pair_layout import pair_document
    from densebatch.data.store.store import DocumentStore
    from densebatch.model.hf.adapter import HFCausalLM
    from densebatch.train.loop import Trainer
    from densebatch.train.objectives.losses import OBJECTIVES
    from densebatch.train.objectives.reference import LiveReference
    from densebatch.train.objectives.steps import PreferenceSteps
    from densebatch.train.parts import StepParts

    docs = [pair_document(np.array(p), np.array(c), np.array(r), chosen_loss=np.ones(len(c)), rejected_loss=np.ones(len(r))) for p, c, r in data["train"]]  # fmt: skip
    store = DocumentStore.from_documents(docs, meta={"eos_id": data["eos"], "pad_id": data["eos"], "pairs": True})
    lengths = np.asarray(store.lengths)
    seq_len = -(-int(lengths.max()) // 64) * 64
    budget = max(1, round(PAIRS_PER_STEP * lengths.mean() / seq_len)) * seq_len
    settings = PlanSettings(strategy="packed", seq_len=seq_len, max_tokens_per_batch=budget)
    loader = StepLoader(store, settings=settings, collator=PairCollator(data["eos"]), seed=0, steps=StepSettings(1), prefetch=2)
    model = HFCausalLM(model_dir)
    cfg = TrainConfig(
        lr=LR, schedule="linear", min_lr_ratio=0.0, warmup_steps=0, grad_clip=1.0, max_epochs=1.0, progress=False,
        device="cpu", precision="fp32", optimizer=OptimizerConfig(weight_decay=0.0, beta2=0.999), objective="dpo", beta=BETA,
    )  # fmt: skip
    steps = PreferenceSteps(OBJECTIVES["dpo"](beta=BETA), LiveReference(model))
    trainer = Trainer(model, loader, cfg, output_dir=tempfile.mkdtemp(), parts=StepParts(objective=steps))
    total = loader.steps_per_epoch()
    evals, seconds, pairs = [], 0.0, 0
    model.train()
    trainer.state.total_steps = total
    trainer.data.max_epochs = 1.0
    for step in iter(trainer.data):
        t = time.perf_counter()
        result = trainer.train_step(step)
        seconds += time.perf_counter() - t
        pairs += result.record["pairs"]
        if trainer.state.step in marks_of(total, marks):
            evals.append({"seconds": seconds, "step": trainer.state.step, **score(model.hf.state_dict())})
    return {"seconds": seconds, "pairs": pairs, "steps": trainer.state.step, "evals": evals, "budget": budget, "seq_len": seq_len}


def run_trl(data: dict, model_dir: Path, score: HeldOut, marks: list[int], padding_free: bool) -> dict:
    import datasets
    import transformers
    import trl

    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=_dummy_tokenizer(), eos_token="<e>", pad_token="<e>")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    model.config.pad_token_id = data["eos"]
    args = trl.DPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=PAIRS_PER_STEP, learning_rate=LR, num_train_epochs=1,
        lr_scheduler_type="linear", warmup_steps=0, max_grad_norm=1.0, weight_decay=0.0, adam_beta2=0.999, beta=BETA,
        bf16=False, gradient_checkpointing=False, padding_free=padding_free, max_length=None, report_to=[],
        save_strategy="no", logging_steps=10_000, use_cpu=True, seed=0, disable_tqdm=True,
    )  # fmt: skip
    dummy = datasets.Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}])
    trainer = trl.DPOTrainer(model=model, args=args, train_dataset=dummy, processing_class=tok)
    trainer.train_dataset = datasets.Dataset.from_dict(
        {
            "prompt_ids": [p for p, _, _ in data["train"]],
            "chosen_ids": [c for _, c, _ in data["train"]],
            "rejected_ids": [r for _, _, r in data["train"]],
        }  # fmt: skip
    )
    trainer.data_collator.pad_token_id = data["eos"]
    total = -(-len(data["train"]) // PAIRS_PER_STEP)
    clock = {"seconds": 0.0, "since": None, "evals": []}

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            clock["since"] = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            clock["seconds"] += time.perf_counter() - clock["since"]
            if state.global_step in marks_of(total, marks):
                clock["evals"].append(
                    {"seconds": clock["seconds"], "step": state.global_step, **score(trainer.model.state_dict())}
                )

    trainer.add_callback(Timer())
    trainer.train()
    return {"seconds": clock["seconds"], "pairs": len(data["train"]), "steps": total, "evals": clock["evals"]}


def _dummy_tokenizer():
    from tokenizers import Tokenizer, models

    return Tokenizer(models.WordLevel({"<e>": 0, "a": 1, "b": 2, "c": 3}, unk_token="<e>"))


def marks_of(total: int, marks: list[int]) -> set[int]:
    """The steps after which an arm is scored: each quarter of the epoch (``marks``: the quarters)."""
    return {max(1, round(total * q / 4)) for q in marks}


def arm_main(args) -> None:
    import torch

    torch.manual_seed(0)
    data = json.loads(Path(args.data).read_text())
    score = HeldOut(data, Path(args.model))
    load = os.getloadavg()[0]
    if args.arm == "densebatch":
        out = run_densebatch(data, Path(args.model), score, [1, 2, 3, 4])
    else:
        out = run_trl(data, Path(args.model), score, [1, 2, 3, 4], padding_free=args.arm == "trl-padding-free")
    tokens = sum(len(p) + len(c) + len(r) for p, c, r in data["train"])
    out |= {
        "arm": args.arm, "set": args.set, "repeat": args.repeat, "pairs_per_s": out["pairs"] / out["seconds"],
        "pair_tokens_per_s": tokens / out["seconds"], "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
        "load": [load, os.getloadavg()[0]], "final": out["evals"][-1] if out["evals"] else None,
    }  # fmt: skip
    with open(args.out, "a", encoding="utf-8") as f:
        f.write(json.dumps(out) + "\n")


# ------------------------------------------------------------------------------------------- report
def report(rows: list[dict]) -> str:
    med = statistics.median
    lines = []
    for s in sorted({r["set"] for r in rows}):
        by = defaultdict(list)
        for r in rows:
            if r["set"] == s:
                by[r["arm"]].append(r)
        base = by.get("trl-padded")
        target = med([r["final"]["accuracy"] for r in base]) if base else None
        base_pps = med([r["pairs_per_s"] for r in base]) if base else None
        lines.append(f"set {s}: {by[next(iter(by))][0]['pairs']} training pairs, one epoch; medians of {len(base or [])} runs")
        lines.append(
            f"  {'arm':<18} {'pairs/s':>8} {'x TRL':>6} {'pair tok/s':>10} {'peak GB':>8} {'acc':>6} {'margin':>7} {'s to TRL acc':>12}"
        )
        for arm in ARMS:
            rs = by.get(arm)
            if not rs:
                continue
            pps = med([r["pairs_per_s"] for r in rs])
            reach = []
            for r in rs:
                hit = next((e["seconds"] for e in r["evals"] if target is not None and e["accuracy"] >= target), None)
                reach.append(hit)
            got = [x for x in reach if x is not None]
            lines.append(
                f"  {arm:<18} {pps:8.2f} {pps / base_pps if base_pps else float('nan'):6.2f} "
                f"{med([r['pair_tokens_per_s'] for r in rs]):10.0f} {med([r['peak_rss_gb'] for r in rs]):8.2f} "
                f"{med([r['final']['accuracy'] for r in rs]):6.3f} {med([r['final']['margin'] for r in rs]):7.3f} "
                f"{(f'{med(got):.0f}' if len(got) == len(reach) else f'{len(got)}/{len(reach)} reach'):>12}"
            )
        loads = [x for r in rows if r["set"] == s for x in r["load"]]
        lines.append(f"  load average (1 min) during the runs: {min(loads):.1f} to {max(loads):.1f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sets", default="oasst,instruction")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--out", default=str(REPO / "benchmarks" / ".cache" / "dpo_vs_trl.jsonl"))
    ap.add_argument("--report", action="store_true", help="only print the report of --out")
    ap.add_argument("--limit", type=int, default=0, help="at most this many training and held-out pairs a set (a quick look)")
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument("--set", help=argparse.SUPPRESS)
    ap.add_argument("--repeat", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.arm:
        return arm_main(args)
    if not args.report:
        shared = require_shared_data()
        work = Path(tempfile.mkdtemp(prefix="dpo-bench-"))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        arms = args.arms.split(",")
        for name in args.sets.split(","):
            data = tokenized(shared, name)
            if args.limit:
                data["train"], data["held"] = data["train"][: args.limit], data["held"][: args.limit]
            (work / f"{name}.json").write_text(json.dumps(data))
            save_model(data, work / f"{name}-model")
            print(
                f"{name}: {len(data['train'])} training pairs, {len(data['held'])} held out, vocabulary {data['vocab']}",
                flush=True,
            )
        for repeat in range(args.repeats):
            for name in args.sets.split(","):
                order = arms[repeat % len(arms) :] + arms[: repeat % len(arms)]  # rotated: no arm always first
                for arm in order:
                    cmd = [sys.executable, "-m", "benchmarks.quality.dpo_vs_trl", "--arm", arm, "--set", name,
                           "--repeat", str(repeat), "--data", str(work / f"{name}.json"), "--model", str(work / f"{name}-model"), "--out", args.out]  # fmt: skip
                    subprocess.run(cmd, check=True, cwd=REPO, env=dict(os.environ, TQDM_DISABLE="1"))
                    print(f"done: repeat {repeat} {name} {arm}", flush=True)
    rows = [json.loads(x) for x in Path(args.out).read_text().splitlines() if x.strip()]
    print(report(rows))


if __name__ == "__main__":
    main()

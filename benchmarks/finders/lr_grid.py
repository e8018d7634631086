"""Validate the learning-rate finder against grids of whole training runs, from one command.

Each grid point is a ``densebatch train`` run from the same initial weights at one peak rate, scored
by its final held-out loss (the mean over ``--seeds``); the range test's suggestion (``densebatch
find-lr`` on the same settings, one per seed) passes when its runs' mean is within 10% of the best
grid rate's, or within ``--atol`` nats of it where every loss is near 0 (the exit status says which).
Every run is a subprocess of the installed CLI, so what is measured is what a user runs; a run whose
``metrics.jsonl`` already ends with its final eval is read, not run again (the grid can be stopped
and continued), and so is a finder run made by the same finder code (``train/finders/``; one made by
other code is moved aside).

Setups (``--setup``):

- ``default``: the embedded default (the demo's data, model and batches), shortened to ``--steps``.
- ``finetune``: a model pre-trained on three of the embedded tasks (key, color, upper: the demo's
  settings, ``--pretrain-steps``, loss on the answers), exported to a Hugging Face GPT-2
  (``densebatch export``), then fine-tuned on the fourth task, parity, which it has never answered:
  new records, loss on the answers, ``--steps`` steps. The model already reads the prompt format and
  the passages; only the new mapping is learned. ``finetune-color`` and ``finetune-upper``: the same
  with color, upper, or key as the new task (``finetune-upper`` was first run after the short-trial
  rule was fixed; ``finetune-key`` after bracketing and the parabola were added to it).
  ``finetune-two``: two new tasks at once (color and parity) for a model tuned on the other two, on
  records of other seeds (first run after the trials' ceiling was added). ``finetune-upper-key``: the
  same with upper and key new, and ``finetune-upper2`` upper alone on records of other seeds (both first
  run after the ceiling was kept to models confidently wrong); ``finetune-upper3`` upper alone on records of
  third seeds (first run after the trials kept the run's warm-up in steps).
- ``shakespeare``: a GPT-2 pre-trained on tinyshakespeare (../shared), at chance on the embedded
  records' answers, fine-tuned on them.
- ``sft``: a language model of the embedded records (all four tasks, every token carries loss,
  ``--pretrain-steps``), exported, then instruction-tuned on new records of the same tasks (loss
  on the answers): a model already near its task, where range tests are known to suggest rates far
  too high. ``sft-heldout`` and ``sft-heldout2``: the same on other generated records, to check a
  rule chosen on ``sft`` (``sft-heldout2`` was first run after the held-out rule was fixed).

With several ``--seeds`` (data order and dropout; the pre-trained weights are the same) each rate
is scored by its mean, and each seed's range test suggests its own rate, whose runs make the
"suggested" row. The check's noise follows: the rate best on the other seeds scored on each, a
bootstrap over seeds, and each seed's gap to the grid's best (mean ± standard error, and the seeds a
10% verdict would take).

    .venv/bin/python -m benchmarks.finders.lr_grid --setup default --work /tmp/lrgrid --rates 3e-4,1e-3,3e-3,1e-2 --seeds 0,1
    .venv/bin/python -m benchmarks.finders.lr_grid --setup sft --work /tmp/lrgrid --rates 1e-4,3e-4,1e-3,3e-3 --seeds 0,1,2
    .venv/bin/python -m benchmarks.finders.lr_grid --setup finetune --work /tmp/lrgrid --rates 1e-3,3e-3,1e-2 --seeds 0,1,2

docs/finders.md has every grid's command and table.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from densebatch.data.prepare.default_dataset import generate_records
from densebatch.train.observe.monitor import read_metrics

FINETUNE_TASK = "parity"
SUGGESTED = "suggested"
BATCHES = (
    "--data.tokenizer=bpe:1024",
    "--data.max_seq_len=512",
    "--batching.strategy=packed",
    "--batching.seq_len=512",
    "--batching.max_tokens_per_batch=4096",
    "--train.guard.spike_zscore=0",
    "--train.plots=false",
)


def densebatch(args: list[str], log: Path) -> float:
    """Run the CLI with ``args``, its output into ``log``; the wall seconds, or exit on failure."""
    exe = Path(sys.executable).with_name("densebatch")
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.call([str(exe), *args], stdout=f, stderr=subprocess.STDOUT)
    if rc != 0:
        sys.exit(f"densebatch {' '.join(args[:1])} failed (exit {rc}): see {log}")
    return time.perf_counter() - t0


def final_eval(run_dir: Path, steps: int) -> float | None:
    """The held-out loss of the eval at step ``steps``, None when the run has not got there."""
    evals = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("kind") == "eval" and r.get("step") == steps]
    return float(evals[-1]["loss"]) if evals else None


FINGERPRINT = "finder-code.sha256"


@functools.cache
def finder_code() -> str:
    """A hash of the finder's source (``train/finders/``): a finder run is reused only by the same code."""
    import hashlib

    import densebatch.train.finders as finders

    digest = hashlib.sha256()
    for path in sorted(Path(finders.__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def stale(finder: Path) -> bool:
    """The finder run in ``finder`` was made by other finder code than this checkout's (or before runs
    were fingerprinted): a grid re-run after a rule change must not read the old rule's suggestion."""
    mark = finder / FINGERPRINT
    return not mark.exists() or mark.read_text().strip() != finder_code()


def loss_text(loss: float) -> str:
    """Three decimals, or three significant digits below 0.01 (a grid whose runs all end near 0)."""
    return f"{loss:.3f}" if loss >= 0.01 else f"{loss:.3g}"


# a new setup's new task(s) (the others are the pre-training's), the pre-training records' seed, the new
# records' seed, and how many records are drawn for the new ones (fewer for two tasks: as many of each)
NEW_TASKS = {
    "finetune": ((FINETUNE_TASK,), 1234, 4321, 12000),
    "finetune-color": (("color",), 1234, 4321, 12000),
    "finetune-upper": (("upper",), 1234, 4321, 12000),
    "finetune-key": (("key",), 1234, 4321, 12000),
    "finetune-upper2": (("upper",), 86420, 24680, 12000),
    "finetune-upper3": (("upper",), 31415, 27182, 12000),
    "finetune-two": (("color", "parity"), 97531, 13579, 8000),
    "finetune-upper-key": (("upper", "key"), 86420, 24680, 8000),
}


def write_jsonl(records: list[dict], path: Path) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def finetune_records(setup: str) -> tuple[list[dict], list[dict], list[dict], str]:
    """(pre-training records, fine-tuning records, held-out fine-tuning records, pre-training loss_on)."""
    if setup in NEW_TASKS:  # new task(s) for a model instruction-tuned on the others
        tasks, pre_seed, new_seed, drawn = NEW_TASKS[setup]
        pre = [r for r in generate_records(20000, seed=pre_seed) if r["task"] not in tasks]
        new = [r for r in generate_records(drawn, seed=new_seed) if r["task"] in tasks]
        return pre, new[500:], new[:500], "response"
    # sft: a language model of the rendered records (every token carries loss), then instruction-tuned
    # on new records of the same tasks (loss on the answers); sft-heldout: the same on other records
    # (and, as run in docs/finders.md, a shorter pre-training), which the near-task rule was not chosen on
    pre_seed, ft_seed = {"sft": (1234, 4321), "sft-heldout": (777, 8765), "sft-heldout2": (2468, 1357)}[setup]
    new = generate_records(6000, seed=ft_seed)
    return generate_records(20000, seed=pre_seed), new[500:], new[:500], "all"


SHAKESPEARE = Path(__file__).resolve().parents[3] / "shared" / "data" / "tinyshakespeare.txt"


def prepare_shakespeare(work: Path, pretrain_steps: int) -> list[str]:
    """A Hugging Face GPT-2 (2 layers, width 64) pre-trained on tinyshakespeare with a bpe:1024 learned from
    it (every token carries loss, packed 512-token rows, 3e-3): at chance on the embedded instruction
    data's answers, which it is then fine-tuned on with that tokenizer. The fine-tuning overrides."""
    if not SHAKESPEARE.is_file():
        sys.exit(f"--setup shakespeare needs {SHAKESPEARE} (the shared data beside the checkout)")
    init, pre_run = work / "gpt2-init", work / "pretrain"
    if not (init / "config.json").exists():
        from transformers import GPT2Config

        GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=512, vocab_size=1024).save_pretrained(init)
    if final_eval(pre_run, pretrain_steps) is None:
        args = ["train", f"--data.path={SHAKESPEARE}", "--data.format=text", "--data.template=raw", "--data.loss_on=all",
                *BATCHES, "--model.kind=hf", f"--model.path={init}", f"--train.max_steps={pretrain_steps}",
                "--train.lr=3e-3", "--train.warmup_steps=20", f"--output_dir={pre_run}", "--overwrite"]  # fmt: skip
        secs = densebatch(args, work / "pretrain.log")
        print(f"pre-trained {pretrain_steps} steps in {secs:.0f} s: eval loss {final_eval(pre_run, pretrain_steps):.4f}")
    final = pre_run / "final"
    return [*BATCHES[1:], f"--data.tokenizer={final}", "--model.kind=hf", f"--model.path={final}"]


def prepare_finetune(work: Path, setup: str, pretrain_steps: int) -> list[str]:
    """Data files, the pre-trained model exported to HF; the fine-tuning overrides (without rate)."""
    if setup == "shakespeare":
        return prepare_shakespeare(work, pretrain_steps)
    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    pre, train, held_out, loss_on = finetune_records(setup)
    if not (data / "ft_eval.jsonl").exists():
        write_jsonl(pre, data / "pretrain.jsonl")
        write_jsonl(held_out, data / "ft_eval.jsonl")
        write_jsonl(train, data / "ft_train.jsonl")
    pre_run, model = work / "pretrain", work / "pretrained-hf"
    if final_eval(pre_run, pretrain_steps) is None:
        args = [
            "train",
            f"--data.path={data / 'pretrain.jsonl'}",
            f"--data.loss_on={loss_on}",
            *BATCHES,
            "--model.block_size=512",
        ]
        args += [f"--train.max_steps={pretrain_steps}", "--train.lr=1e-3", "--train.warmup_steps=50"]
        secs = densebatch([*args, f"--output_dir={pre_run}", "--overwrite"], work / "pretrain.log")
        print(f"pre-trained {pretrain_steps} steps in {secs:.0f} s: eval loss {final_eval(pre_run, pretrain_steps):.4f}")
    if not (model / "config.json").exists():
        densebatch(["export", str(pre_run), str(model)], work / "export.log")
    return [
        f"--data.path={data / 'ft_train.jsonl'}",
        f"--data.eval_path={data / 'ft_eval.jsonl'}",
        *BATCHES,
        "--model.kind=hf",
        f"--model.path={model}",
        f"--data.tokenizer={model}",
    ]


def seed_interval(scores: dict, rates: list[float], draws: int = 2000) -> tuple[float, float]:
    """The 5th and 95th percentiles of the suggestion's mean over the best grid rate's mean when the seeds
    are drawn again with replacement (each seed keeps its grid runs and its own suggestion's run together),
    the grid's best chosen anew in each draw, as the check chooses it: how far the ratio moves with the seeds."""
    import numpy as np

    runs = np.array([scores[r] for r in rates])  # (rates, seeds)
    own = np.array(scores[SUGGESTED])
    idx = np.random.default_rng(0).integers(0, own.size, size=(draws, own.size))
    ratios = own[idx].mean(axis=1) / runs[:, idx].mean(axis=2).min(axis=0)
    return float(np.percentile(ratios, 5)), float(np.percentile(ratios, 95))


def paired_gap(scores: dict, best_lr: float, share: float = 0.10) -> tuple[float, float, int]:
    """Each seed's run at its own suggestion minus the best grid rate's run on the same seed: the mean,
    its standard error, and about how many seeds a two-sided 5% test with 80% power needs to tell a gap
    of ``share`` of the best's mean from none (where a grid's runs jump or not, far more than it has)."""
    gaps = [own - best for own, best in zip(scores[SUGGESTED], scores[best_lr])]
    spread = statistics.stdev(gaps)
    need = math.ceil(((1.959964 + 0.841621) * spread / max(share * statistics.fmean(scores[best_lr]), 1e-12)) ** 2)
    return statistics.fmean(gaps), spread / math.sqrt(len(gaps)), need


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    setups = ("default", *NEW_TASKS, "shakespeare", "sft", "sft-heldout", "sft-heldout2")
    ap.add_argument("--setup", choices=setups, required=True)
    ap.add_argument("--work", required=True, help="directory for data, runs and logs (reused when present)")
    ap.add_argument("--rates", default="1e-4,3e-4,1e-3,3e-3,1e-2", help="comma list of peak learning rates")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default: 150 default, 100 finetune)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: 50 default, 10 finetune)")
    ap.add_argument("--pretrain-steps", type=int, default=500)
    ap.add_argument("--seeds", default="0", help="comma list: each rate runs on each seed; the score is the mean")
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for every run")
    ap.add_argument("--grid-only", action="store_true", help="run the grid's rates only (no range test)")
    ap.add_argument(
        "--atol",
        type=float,
        default=0.001,
        help="a suggestion within this many nats of the best also passes: where every loss is near 0 a ratio compares rounding",
    )
    ap.add_argument("--finder", default="", help="extra find-lr overrides, e.g. '--finder.trials=3' (a suggestion of its own)")
    args = ap.parse_args(argv)
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    work = Path(args.work) / args.setup
    work.mkdir(parents=True, exist_ok=True)
    steps = args.steps or (150 if args.setup == "default" else 100)
    warmup = args.warmup if args.warmup is not None else (50 if args.setup == "default" else 10)
    common = prepare_finetune(work, args.setup, args.pretrain_steps) if args.setup != "default" else []
    common += [f"--train.max_steps={steps}", f"--train.warmup_steps={warmup}", "--eval.accuracy_samples=0"]
    seeds = [int(s) for s in args.seeds.split(",")]

    rates = [float(r) for r in args.rates.split(",")]
    scores: dict[float | str, list[float]] = {}  # a rate, or SUGGESTED: each seed's run at its own suggestion
    suggested: dict[int, float] = {}
    extra = args.finder.split()
    tag = "".join(c if c.isalnum() or c in "=.-" else "_" for c in "-".join(x.lstrip("-") for x in extra))
    for seed in seeds:
        finder = work / (f"finder-seed{seed}" + (f"-{tag}" if tag else ""))
        if not args.grid_only and (finder / "lr_finder.json").exists() and stale(finder):
            gone = finder.with_name(f"{finder.name}.stale-{int(time.time())}")
            finder.rename(gone)  # the finder's code changed since: its suggestion is not this code's
            print(f"seed {seed}: {finder.name} was found by other finder code: moved to {gone.name}, run again")
        if not args.grid_only and not (finder / "lr_finder.json").exists():
            cmd = ["find-lr", *common, *extra, f"--seed={seed}", f"--output_dir={finder}"]
            secs = densebatch(cmd, finder.with_suffix(".log"))
            (finder / FINGERPRINT).write_text(finder_code() + "\n")
            print(f"seed {seed}: range test in {secs:.0f} s")
        if not args.grid_only:
            doc = json.loads((finder / "lr_finder.json").read_text())
            suggested[seed] = float(doc["suggested_lr"])
            others = ", ".join(f"{k} {v:.3g}" for k, v in doc.get("candidates", {}).items())
            print(f"seed {seed}: suggested {suggested[seed]:.4g} ({doc.get('rule')}); {others}")
        for lr in rates if args.grid_only else [*rates, SUGGESTED]:
            rate = suggested[seed] if lr == SUGGESTED else lr
            run = work / f"seed{seed}" / f"lr-{rate:.4g}"
            loss = final_eval(run, steps)
            if loss is None:
                run.parent.mkdir(parents=True, exist_ok=True)
                cmd = ["train", *common, f"--seed={seed}", f"--train.lr={rate!r}", f"--output_dir={run}", "--overwrite"]
                secs = densebatch(cmd, run.parent / f"{run.name}.log")
                loss = final_eval(run, steps)
                print(f"seed {seed}: lr {rate:.4g}: eval loss {loss:.4f} ({secs:.0f} s)")
            scores.setdefault(lr, []).append(loss)

    mean = {k: statistics.fmean(v) for k, v in scores.items()}
    best_lr = min(rates, key=mean.__getitem__)
    if args.grid_only:
        print(" | ".join(f"{k:.3g}: {loss_text(mean[k])} ({' / '.join(map(loss_text, scores[k]))})" for k in rates))
        return 0
    ratio = mean[SUGGESTED] / mean[best_lr]
    passed = ratio <= 1.10 or mean[SUGGESTED] - mean[best_lr] <= args.atol
    print(
        f"\n{args.setup}: {steps} steps, warm-up {warmup}, seeds {args.seeds}; suggested "
        + ", ".join(f"{v:.3g}" for v in suggested.values())
    )
    each_col = " (each seed)" if len(seeds) > 1 else ""
    print(f"| peak learning rate | final eval loss{each_col} | against the grid's best |\n|---|---|---|")
    for k in sorted(scores, key=lambda k: suggested[seeds[0]] if k == SUGGESTED else k):
        label = "suggested (" + ", ".join(f"{v:.3g}" for v in suggested.values()) + ")" if k == SUGGESTED else f"{k:.3g}"
        each = f" ({' / '.join(map(loss_text, scores[k]))})" if len(seeds) > 1 else ""
        r = mean[k] / mean[best_lr]
        vs = "the best" if k == best_lr else (f"{r - 1:+.0%}" if r < 2 else f"{r:.1f}x")
        print(f"| {label} | {loss_text(mean[k])}{each} | {vs} |")
    print(
        f"the suggestion's runs end at {ratio:.2f}x the grid's best ({best_lr:.3g}), {mean[SUGGESTED] - mean[best_lr]:+.4f} nats: "
        + ("passes" if passed else "fails")
        + f" (within 10%, or within {args.atol:g} nats)"
    )
    if len(seeds) > 1:  # the check's own noise: the grid rate best on the other seeds, scored on each seed
        picked = [
            scores[min(rates, key=lambda r, i=i: statistics.fmean(v for j, v in enumerate(scores[r]) if j != i))][i]
            for i in range(len(seeds))
        ]
        floor = statistics.fmean(picked) / mean[best_lr]
        print(
            f"the grid rate that is best on the other seeds, run on each seed: {floor:.2f}x the grid's best (the check's noise)"
        )
        lo, hi = seed_interval(scores, rates)
        print(f"the ratio over seeds drawn again (bootstrap, the grid's best chosen anew each draw): 90% in {lo:.2f}-{hi:.2f}")
        gap, err, need = paired_gap(scores, best_lr)
        print(
            f"seed by seed, the suggestion's run minus the grid's best's: {gap:+.4f} ± {err:.4f} nats (standard error); "
            f"telling a 10% gap from none (two-sided 5%, power 80%) takes about {need} seeds"
        )
    result = {"setup": args.setup, "steps": steps, "warmup": warmup, "seeds": seeds, "suggested": suggested, "finder": extra}
    result["scores"] = {str(k): v for k, v in scores.items()}
    result["cross_seed"] = floor if len(seeds) > 1 else None
    result["seed_interval"] = [lo, hi] if len(seeds) > 1 else None
    result["paired_gap"] = [gap, err, need] if len(seeds) > 1 else None
    result["passed"] = passed
    (work / (f"result-{tag}.json" if tag else "result.json")).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())

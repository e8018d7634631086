"""Time to quality: how soon each batching plan reaches a good model, not how full its batches are.

    .venv/bin/python -m benchmarks.quality.time_to_quality [--set default|mixture] [--setups a,b,...]
        [--seeds 0 1 2] [--steps N] [--every K] [--out results.jsonl]

Each setup trains with the installed command line (``python -m densebatch.cli train``), one run at a
time, seed by seed with the setups interleaved (so that the machine's drift falls on all of them alike),
evaluating every K steps, and reads its ``metrics.jsonl``. Reported per setup (median over the
seeds, then each seed): real tokens and fill per step, and the **training time** (the sum of the
steps' own wall time, evaluations excluded), steps and real tokens until the first evaluation that
reaches the target, with the final quality.

- ``--set default``: the embedded default (the demo's data, tokenizer, model, learning rate and step of
  ~96 loss tokens, ``train.loss_tokens_per_step``; four tasks with one-word answers; one task's prompts all short). Target:
  exact-match accuracy >= 0.99 on 200 held-out prompts. Setups ending in ``/1`` take one batch a step
  instead (``loss_tokens_per_step: null``), as the demo did before.
- ``--set mixture``: the shared instruction data, chat threads and Shakespeare as three sources
  (``bpe:2048``, a 2-layer GPT of width 128, learning rate 1e-3), evaluated per source. Targets: the
  eval loss that random padded batches reach at the end (median over the seeds); then, per source,
  every source's loss at or below random's at steps ``--per-source-at`` (median over its seeds), a run
  reaching it when all its sources are there at once. ``packed-2816`` / ``token_budget-2816`` hold as
  many real tokens a step as random's 8 padded rows (~2,450), so they compare at equal real tokens per
  step; ``packed-2048`` holds 18% fewer. ``packed-*`` setups run the default ``train.source_balance:
  batches`` (each source's loss tokens weighted as random batches weigh them), ``*-tokens`` weigh every
  loss token alike; ``*-w`` setups up-sample the sources instead (``RANDOM_LIKE_WEIGHTS``). ``*-para``
  setups are a second mixture (Shakespeare split at blank lines), compared with ``--peer random-8-para``.
  ``NAME@N`` runs setup NAME for N steps. "× peer's" is a setup's median time over the peer's median;
  each seed's line also gives it over the same seed's peer run.

Peers: random padded batches (``random``, 8 rows) and Hugging Face ``group_by_length``, which is
``length_grouped`` at HF's settings (one document a row, ``bundle_tokens: 0``; mega-batches of 50
batches, sorted; tests/data/plan/test_plan.py checks that it has Hugging Face's shape). ``*-sorted``
setups are the plans before bundling (``batching.bundle_tokens=0``), kept to show what bundling changed. A run that never reaches the
target shows ``-``. Results append to ``--out`` as JSON lines, so an interrupted sweep keeps its runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.common import REPO, require_shared_data

ONE_BATCH_A_STEP = "--train.loss_tokens_per_step=null"  # the step is whatever one batch holds
DEFAULT_SETUPS: dict[str, list[str]] = {
    # The demo's steps hold ~96 loss tokens (train.loss_tokens_per_step) whatever the batching: these
    # compare plans at equal loss tokens per step, a step being as many batches as it takes.
    "random-8": ["--batching.strategy=random"],
    "hf-group_by_length-8": ["--batching.strategy=length_grouped", "--batching.bundle_tokens=0"],
    "length_grouped-8": ["--batching.strategy=length_grouped"],
    "token_budget-1024": ["--batching.strategy=token_budget", "--batching.max_tokens_per_batch=1024"],
    "packed-1024": ["--batching.max_tokens_per_batch=1024"],
    "packed-4096-sorted": ["--batching.bundle_tokens=0"],
    "demo": [],
    # One batch a step (the demo before train.loss_tokens_per_step): steps 4-6x smaller than the demo's.
    "random-8/1": ["--batching.strategy=random", ONE_BATCH_A_STEP],
    "hf-group_by_length-8/1": ["--batching.strategy=length_grouped", "--batching.bundle_tokens=0", ONE_BATCH_A_STEP],
    "length_grouped-8/1": ["--batching.strategy=length_grouped", ONE_BATCH_A_STEP],
    "token_budget-1024/1": ["--batching.strategy=token_budget", "--batching.max_tokens_per_batch=1024", ONE_BATCH_A_STEP],
    "packed-1024/1": ["--batching.max_tokens_per_batch=1024", ONE_BATCH_A_STEP],
    "packed-1024-sorted/1": ["--batching.max_tokens_per_batch=1024", "--batching.bundle_tokens=0", ONE_BATCH_A_STEP],
    "packed-2048/1": ["--batching.max_tokens_per_batch=2048", ONE_BATCH_A_STEP],
}
# Random 8-row batches hold ~2,500 real tokens of the mixture; the dense setups at 2,816 slots a batch
# hold as many, so one batch a step is equal real tokens per step.
MIXTURE_SETUPS: dict[str, list[str]] = {
    "random-8": ["--batching.strategy=random"],
    "hf-group_by_length-8": ["--batching.strategy=length_grouped", "--batching.bundle_tokens=0"],
    "length_grouped-8": ["--batching.strategy=length_grouped"],
    "token_budget-2816": ["--batching.strategy=token_budget", "--batching.max_tokens_per_batch=2816"],
    "packed-2816": ["--batching.max_tokens_per_batch=2816", "--batching.seq_len=1408", "--model.block_size=1408"],
    "packed-2048": ["--batching.max_tokens_per_batch=2048"],
    "packed-2048-sorted": ["--batching.max_tokens_per_batch=2048", "--batching.bundle_tokens=0"],
}


# Random padded batches, one a step with the loss averaged over the batch's own loss tokens, weigh a
# token by 1 / its batch's loss tokens: batches of short documents weigh more. On the mixture that gives
# the instructions (3.6% of the loss tokens, the shortest documents) 1.53x their share of the gradient,
# chat 0.96x, Shakespeare 0.99x (measured over epoch 0's plan); dense steps weigh every loss token alike.
# ``*-w`` setups up-sample the instructions to the share random's batches give them (weights are shares
# of an epoch's tokens: natural 0.109 / 0.307 / 0.584).
RANDOM_LIKE_WEIGHTS = {"instructions": 0.109 * 1.53, "chat": 0.307 * 0.96, "shakespeare": 0.584 * 0.99}
MIXTURE_SETUPS["packed-2816-w"] = MIXTURE_SETUPS["packed-2816"] + ["weights", "--train.source_balance=tokens"]
# ``packed-2816`` runs the default ``train.source_balance: batches`` (each source's loss tokens weighted as
# random batches of 8 documents weigh them); ``-tokens`` weighs every loss token alike (the default before).
MIXTURE_SETUPS["packed-2816-tokens"] = MIXTURE_SETUPS["packed-2816"] + ["--train.source_balance=tokens"]
# A second mixture, not the one the setting was checked on: Shakespeare split at blank lines (7,000
# speeches of ~46 tokens instead of 646 chunks of 512), so two sources of short documents and one of
# long threads. Random 8-row batches then hold ~634 real tokens; one packed row of 640, ~635.
PARA = ["--data.text_split=blank_lines"]
MIXTURE_SETUPS["random-8-para"] = PARA + ["--batching.strategy=random"]
MIXTURE_SETUPS["packed-para"] = PARA + ["--batching.max_tokens_per_batch=640", "--batching.seq_len=640"]
MIXTURE_SETUPS["packed-para-tokens"] = MIXTURE_SETUPS["packed-para"] + ["--train.source_balance=tokens"]
# Up-sampling the short instructions makes packed rows of 1,408 hold ~2,560 real tokens, 6% more than
# random's ~2,420; rows of 1,344 hold ~2,320, 4% fewer (the nearest equal tokens per step from below).
MIXTURE_SETUPS["packed-2688-w"] = [
    "--batching.max_tokens_per_batch=2688", "--batching.seq_len=1344", "--model.block_size=1344", "weights",
    "--train.source_balance=tokens",
]  # fmt: skip


def mixture_sources(shared: Path, weights: dict[str, float] | None = None) -> str:
    sources = [
        {"path": str(shared / "instruction-data.json"), "name": "instructions"},
        {"path": str(shared / "oasst-threads.jsonl"), "name": "chat", "template": "chatml"},
        {"path": str(shared / "tinyshakespeare.txt"), "name": "shakespeare", "format": "text"},
    ]
    for s in sources if weights else ():
        s["weight"] = weights[s["name"]]
    return f"--data.sources={json.dumps(sources)}"


def mixture_args(shared: Path) -> list[str]:
    return [
        mixture_sources(shared),
        "--data.tokenizer=bpe:2048",
        "--data.max_seq_len=1024",
        "--data.text_split=chunks",
        "--data.chunk_tokens=512",
        "--batching.strategy=packed",
        "--batching.seq_len=1024",
        "--model.n_layer=2",
        "--model.n_embd=128",
        "--model.n_head=4",
        "--model.block_size=1024",
        "--train.lr=1e-3",
        "--train.warmup_steps=30",
    ]


def run_one(name: str, args: list[str], steps: int, seed: int, every: int, threads: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="ttq-") as tmp:
        cmd = [sys.executable, "-m", "densebatch.cli", "train", f"--output_dir={tmp}/run", f"--seed={seed}"]
        cmd += [f"--train.max_steps={steps}", f"--eval.every_steps={every}", "--train.progress=false", "--train.plots=false"]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(REPO / "src"))
        t0 = time.perf_counter()
        r = subprocess.run([*cmd, *args], cwd=REPO, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if r.returncode != 0:
            raise SystemExit(f"{name} seed {seed} failed:\n{r.stderr[-3000:]}")
        lines = [json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [x for x in lines if x["kind"] == "train"]
    evals = [x for x in lines if x["kind"] == "eval"]
    cum_s, cum_tok, by_step = 0.0, 0, {}
    for x in train:
        cum_s += x["step_s"]
        cum_tok += x["real_tokens"]
        by_step[x["step"]] = (cum_s, cum_tok)
    points = [
        {
            "step": e["step"],
            "train_s": by_step[e["step"]][0],
            "tokens": by_step[e["step"]][1],
            "loss": e["loss"],
            "accuracy": e.get("accuracy"),
            "by_source": e.get("loss_by_source"),
        }
        for e in evals
        if e["step"] in by_step
    ]
    real = sum(x["real_tokens"] for x in train)
    slots = sum(x["slot_tokens"] for x in train)
    return {
        "setup": name,
        "seed": seed,
        "args": args,
        "steps": len(train),
        "real_per_step": real / len(train),
        "fill": real / slots,
        "wall_s": wall,
        "points": points,
    }


def reached(run: dict, target, key: str) -> dict | None:
    """The first evaluation at the target: accuracy at or above it, or a loss at or below it; a target
    given per source ({source: loss}) is reached when every source's eval loss is at or below its own."""
    for p in run["points"]:
        if isinstance(target, dict):
            got = p.get("by_source") or {}
            if got and all(s in got and got[s] <= t for s, t in target.items()):
                return p
            continue
        v = p[key]
        if v is not None and (v >= target if key == "accuracy" else v <= target):
            return p
    return None


def _median_time(runs: list[dict], target, key: str) -> float:
    """Median train seconds to the target over ``runs``; a run that never reaches it counts as infinitely slow."""
    times = sorted((h["train_s"] if (h := reached(r, target, key)) else float("inf")) for r in runs)
    if not times:
        return float("inf")
    n = len(times)
    return times[n // 2] if n % 2 else (times[n // 2 - 1] + times[n // 2]) / 2


def _describe(target, key: str) -> str:
    if isinstance(target, dict):
        return "every source's eval loss <= its own: " + ", ".join(f"{s} {t:.4f}" for s, t in target.items())
    return f"{key} {'>=' if key == 'accuracy' else '<='} {target:.4g}"


def table(runs: list[dict], key: str, target, peer: str = "random-8") -> str:
    out = [
        f"target: {_describe(target, key)} (training time = the steps' own time, evaluations excluded)",
        "",
        "| setup | real tok/step | fill | train s to target | × peer's | steps to target | real tokens to target | final accuracy | final eval loss | seeds reaching |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    peer_s = _median_time([r for r in runs if r["setup"] == peer], target, key)
    for name in dict.fromkeys(r["setup"] for r in runs):
        mine = [r for r in runs if r["setup"] == name]
        hits = [reached(r, target, key) for r in mine]
        got = [h for h in hits if h is not None]

        def med(xs, fmt):
            return fmt.format(statistics.median(xs)) if xs else "-"

        mid = _median_time(mine, target, key)  # '-' when most seeds miss
        final_acc = [r["points"][-1]["accuracy"] for r in mine if r["points"] and r["points"][-1]["accuracy"] is not None]
        final_loss = [r["points"][-1]["loss"] for r in mine if r["points"]]
        ratio = mid / peer_s if mid < float("inf") and peer_s < float("inf") else None
        out.append(
            f"| {name} | {med([r['real_per_step'] for r in mine], '{:.0f}')} | {med([r['fill'] for r in mine], '{:.3f}')} "
            f"| {'-' if mid == float('inf') else round(mid, 1)} | {'-' if ratio is None else f'{ratio:.2f}'} "
            f"| {med([h['step'] for h in got], '{:.0f}') if len(got) * 2 > len(mine) else '-'} "
            f"| {med([h['tokens'] for h in got], '{:,.0f}') if len(got) * 2 > len(mine) else '-'} "
            f"| {med(final_acc, '{:.3f}')} | {med(final_loss, '{:.4f}')} | {len(got)}/{len(mine)} |"
        )
    out.append("")
    out.append(f"per seed (train s to target, or '-'; × the same seed's {peer}; final accuracy / loss):")
    peer_by_seed = {r["seed"]: reached(r, target, key) for r in runs if r["setup"] == peer}
    for r in runs:
        h = reached(r, target, key)
        last = r["points"][-1] if r["points"] else {}
        when = "-" if h is None else "{:.1f} s (step {})".format(h["train_s"], h["step"])
        ph = peer_by_seed.get(r["seed"])
        paired = f" ×{h['train_s'] / ph['train_s']:.2f}" if h and ph else ""
        out.append(
            f"  {r['setup']:<24} seed {r['seed']}: {when}{paired}; final {last.get('accuracy')} / {last.get('loss', float('nan')):.4f}"
        )
    return "\n".join(out)


def ladder(runs: list[dict], steps: list[int], peer: str = "random-8") -> list[dict]:
    """Per-source targets from the peer's own runs: at each of ``steps``, the median over its seeds of each
    source's eval loss there (a quality the peer reaches at that step on a typical seed)."""
    mine = [r for r in runs if r["setup"] == peer]
    out = []
    for k in steps:
        at = [p["by_source"] for r in mine for p in r["points"] if p["step"] == k and p.get("by_source")]
        if at:
            out.append({s: statistics.median(x[s] for x in at) for s in at[0]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", choices=("default", "mixture"), default="default")
    ap.add_argument("--setups", help="comma-separated names (default: all of the set's)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=None, help="default: 500 (default set), 300 (mixture)")
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--target", type=float, default=None, help="default: accuracy 0.99 (default set); random's final loss (mixture)"
    )
    ap.add_argument(
        "--per-source-at",
        type=int,
        nargs="*",
        default=[150, 200, 250, 300],
        help="mixture: also tables whose target is every source's loss at or below random's (median over seeds) at these steps",
    )
    ap.add_argument("--peer", default="random-8", help="the setup the others are measured against")
    ap.add_argument(
        "--paired",
        action="store_true",
        help="run each seed's setups side by side, one thread each, so that the machine's load falls on all of them "
        "at the same moments (the setup that ends first leaves the others the whole machine: that favours the slower)",
    )
    ap.add_argument("--out", default=None, help="JSON lines of every run (appended); read back with --report")
    ap.add_argument("--report", action="store_true", help="only print the table of the runs in --out")
    ap.add_argument("--data-dir", default=None)
    a = ap.parse_args()
    setups = DEFAULT_SETUPS if a.set == "default" else MIXTURE_SETUPS
    names = a.setups.split(",") if a.setups else list(setups)
    steps = a.steps or (500 if a.set == "default" else 300)
    shared = None if a.set == "default" else require_shared_data(a.data_dir)
    base = [] if shared is None else mixture_args(shared)

    def args_of(name: str) -> tuple[list[str], int]:
        """A setup's arguments and steps: ``NAME@N`` runs setup NAME for N steps (its schedule too)."""
        plain, _, n = name.partition("@")
        extra = [mixture_sources(shared, RANDOM_LIKE_WEIGHTS) if x == "weights" else x for x in setups[plain]]
        return base + extra, int(n) if n else steps

    runs: list[dict] = []
    if a.out and Path(a.out).is_file():
        runs = [json.loads(x) for x in Path(a.out).read_text().splitlines() if x.strip()]
    if not a.report:
        # seeds outer, setups inner: the runs being compared sit side by side in time, so the
        # machine's drift over a sweep (up to 40% here) falls on all of them alike
        for seed in a.seeds:
            todo = [n for n in names if not any(r["setup"] == n and r["seed"] == seed for r in runs)]  # not in --out
            if a.paired:
                with ThreadPoolExecutor(len(todo) or 1) as pool:
                    done = list(pool.map(lambda n, seed=seed: run_one(n, *args_of(n), seed, a.every, 1), todo))
            else:
                done = (run_one(n, *args_of(n), seed, a.every, a.threads) for n in todo)
            for name, run in zip(todo, done):
                run["paired"] = a.paired
                runs.append(run)
                print(f"{name} seed {seed}: {run['wall_s']:.0f} s wall", file=sys.stderr, flush=True)
                if a.out:
                    with open(a.out, "a") as f:
                        f.write(json.dumps(run) + "\n")
    runs = [r for r in runs if r["setup"] in names]
    if a.set == "default":
        print(table(runs, "accuracy", a.target or 0.99, a.peer))
        return
    finals = [r["points"][-1]["loss"] for r in runs if r["setup"] == a.peer and r["points"]]
    print(table(runs, "loss", a.target or (statistics.median(finals) if finals else float("nan")), a.peer))
    for target in ladder(runs, a.per_source_at, a.peer):
        print()
        print(table(runs, "loss", target, a.peer))


if __name__ == "__main__":
    main()

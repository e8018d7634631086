"""Training throughput, side by side: densebatch vs Hugging Face ``Trainer`` vs plain dense loops.

One process, one model (a Hugging Face GPT-2 config: 4 layers, width 256, 4 heads, vocabulary 50,257,
random init, dropout 0, fp32), one dataset (documents prepared once by ``densebatch.data.prepare.pipeline``:
the same token ids and loss mask for every method), the same number of steps. Two modes:

- default (``--dataset``): instruction / oasst records with their templates, loss on the responses
  only, a target of ``--tokens-per-step`` real tokens per step (HF rows = target / mean length).
- ``--full-loss SETS``: pre-tokenised records (``benchmarks/throughput/fullloss_sets.py``; every token carries
  loss), HF Trainer batches of ``--hf-rows`` 8 documents, and densebatch / the plain loop at the same
  real tokens per step (8 x the mean document length): the comparison of issue 10.

Methods:

- ``db_token_budget``  densebatch ``token_budget`` batches (rows x longest <= budget; the slot budget is
  chosen from the plan so that the epoch's mean real tokens per batch equals the target);
  ``db_token_budget_plain`` the same with ``loss_head="plain"`` (all loss positions' logits at once).
- ``db_packed``        densebatch ``packed`` rows of ``--seq-len`` (target / seq_len rows per batch).
- ``hf_random``        ``transformers.Trainer``, random sampling, ``DataCollatorForSeq2Seq`` padding,
  its default optimizer (``adamw_torch_fused``).
- ``hf_group_by_length``  the same with ``train_sampling_strategy="group_by_length"``.
- ``plain_fused``      the plain loop of issue 10: the HF model called on full rows (documents back to
  back, no padding, no mask, loss on every token), clip 1.0, fused AdamW (HF Trainer's default
  optimizer); ``ceiling`` the same with multi-tensor (foreach) AdamW; ``ceiling_lossonly`` the same
  rows through densebatch's ``HFCausalLM.token_losses`` with the data's loss mask.

Each repeat runs every method once, step-interleaved (``benchmarks/throughput/interleave.py``): one optimizer
step of each method in turn, in one process, so that all of them sample the machine's load at the
same moments (``--sequential``: one run after the other). A step's time runs from the moment its
method gets its turn to the end of that optimizer step (data, collation, forward, backward,
clipping, optimizer, logging: everything); the first ``--warmup-steps`` steps are excluded. Only
real (non-padding) tokens count. Ratios are given per repeat and as the median of those; the
1-minute load average is recorded at the start of every repeat.

    .venv/bin/python -m benchmarks.throughput.train_throughput                      # both data sets, defaults
    .venv/bin/python -m benchmarks.throughput.train_throughput --full-loss tune,pareto --steps 20 --repeats 3
    .venv/bin/python -m benchmarks.throughput.train_throughput --methods db_packed,ceiling --json out.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import require_shared_data, write_gpt2_config
from benchmarks.throughput.baselines import hf_epoch_fill, hf_features, hf_window, run_ceiling, run_hf
from benchmarks.throughput.comparison import (
    DATASETS,
    DEFAULT_METHODS,
    FULL_LOSS_METHODS,
    LABELS,
    METHODS,
    Run,
    Setup,
    token_budget_for,
)
from benchmarks.throughput.fullloss_sets import SETS, write_set
from benchmarks.throughput.interleave import run_alone, run_interleaved
from benchmarks.throughput.pipeline import attention_cost, run_densebatch


# ------------------------------------------------------------------------------------ driver
def prepare_setup(name: str, args, data_dir: Path, tmp: Path) -> Setup:
    from densebatch.config import DataConfig
    from densebatch.data.prepare.pipeline import prepare

    full = bool(args.full_loss)
    if full:  # pre-tokenised records, every token a target
        path = write_set(name, tmp / f"{name}.jsonl", seed=args.seed)
        data = DataConfig(path=str(path), loss_on="all", max_seq_len=args.seq_len)
    else:
        fname, template = DATASETS[name]
        data = DataConfig(path=str(data_dir / fname), template=template, max_seq_len=args.seq_len)
    data.tokenizer, data.eval_fraction, data.cache_dir = str(data_dir / "gpt2"), 0.0, str(tmp / "cache")
    prepared = prepare(data)
    # GPT-2's 50,257 ids, plus any the template added (chatml's <|im_start|> and <|im_end|>), for every method
    model_dir = tmp / f"model-{name}"
    vocab = max(50257, int(prepared.train.meta["vocab_size"]))
    write_gpt2_config(model_dir, n_positions=max(1024, args.seq_len), vocab_size=vocab)
    lengths = np.asarray(prepared.train.lengths)
    if full:
        hf_rows = args.hf_rows
        target = args.tokens_per_step or int(round(hf_rows * lengths.mean()))
    else:
        target = args.tokens_per_step or 2048
        hf_rows = max(1, round(target / lengths.mean()))
    s = Setup(
        name,
        prepared.train,
        model_dir,
        target,
        args.seq_len,
        args.steps,
        args.warmup_steps,
        args.lr,
        args.seed,
        data_dir / "gpt2",
    )
    s.hf_rows = hf_rows
    # The plain loop: as many full rows as HF has rows (full-loss mode), else rows of seq_len.
    s.plain_rows, s.plain_len = (hf_rows, max(2, round(target / hf_rows))) if full else (target // args.seq_len, args.seq_len)
    s.budget, tb_fill = token_budget_for(s.store, target, args.seq_len, args.seed)
    s.notes = {
        "documents": len(lengths),
        "mean_len": float(lengths.mean()),
        "p50": float(np.percentile(lengths, 50)),
        "p90": float(np.percentile(lengths, 90)),
        "max": int(lengths.max()),
        "loss_share": float(np.asarray(s.store.loss_mask).mean()),
        "hf_rows": s.hf_rows,
        "plain_rows": f"{s.plain_rows} x {s.plain_len}",
        "token_budget_slots": s.budget,
        "token_budget_epoch_fill": tb_fill,
        "full_loss": full,
    }
    return s


def run_method(setup: Setup, method: str, features, timer) -> Run:
    """One run of ``method``; ``timer`` (interleave.StepTimer, already started) times its steps."""
    if method.startswith("db_"):
        strategy = "packed" if method == "db_packed" else "token_budget"
        kw = (
            {"loss_head": "plain"}
            if method == "db_token_budget_plain"
            else {"before": True}
            if method.endswith("_before")
            else {}
        )
        r = run_densebatch(setup, strategy, timer, **kw)
    elif method.startswith("hf_"):
        r = run_hf(setup, method[3:], features, timer)
    else:
        r = run_ceiling(setup, timer, loss_only=method == "ceiling_lossonly", fused=method == "plain_fused")
    r.method = method
    return r


def profile_method(setup: Setup, method: str, features, rows: int = 22) -> None:
    """Operators by self CPU time over a whole run of ``method`` (warm-up and model build included)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        r = run_alone(functools.partial(run_method, setup, method, features))
        wall = time.perf_counter() - t0
    print(
        f"\n### profile {setup.name} / {LABELS[method]}: {wall:.1f} s in all, timed steps {sum(r.seconds):.1f} s, "
        f"{r.tokens_per_s:.0f} real tok/s under the profiler"
    )
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=48))


def match_hf_window(setup: Setup, args, features) -> None:
    """Full-loss mode: HF group_by_length's timed steps start with its sorted mega-batch's longest
    documents, so they hold more real tokens than 8 x the mean length. Unless --tokens-per-step is
    given, densebatch and the plain loop get the real tokens per step of HF's own timed window."""
    window = hf_window(setup, "group_by_length", features)
    real = [r for r, _, _ in window]
    setup.notes["hf_window_real_per_step"] = statistics.mean(real)
    setup.notes["hf_window_fill"] = sum(real) / sum(s for _, s, _ in window)
    setup.notes["hf_epoch_fill"] = hf_epoch_fill(setup.store.lengths, setup.hf_rows, args.seed)
    if args.tokens_per_step:
        return
    target = int(round(statistics.mean(real)))
    setup.tokens_per_step = target
    setup.plain_len = max(2, round(target / setup.plain_rows))
    setup.budget, setup.notes["token_budget_epoch_fill"] = token_budget_for(setup.store, target, args.seq_len, args.seed)
    setup.notes.update(token_budget_slots=setup.budget, plain_rows=f"{setup.plain_rows} x {setup.plain_len}")


# (numerator, reference, target) pairs whose ratios the report prints
RESPONSE_TARGETS = [
    (db, ref, t)
    for db in ("db_packed", "db_token_budget")
    for ref, t in (("ceiling", 0.9), ("hf_random", 2.0), ("hf_group_by_length", 1.1))
]
FULL_TARGETS = [
    (db, ref, t)
    for db in ("db_token_budget", "db_token_budget_plain", "db_token_budget_before")
    for ref, t in (("hf_group_by_length", 1.05), ("plain_fused", 0.97), ("hf_random", None), ("ceiling", None))
] + [
    ("hf_group_by_length", "plain_fused", None),
    ("db_token_budget", "db_token_budget_plain", None),
    ("db_token_budget", "db_token_budget_before", None),
]


def report(setup: Setup, runs: dict[str, list[Run]]) -> dict:
    n = setup.notes
    print(
        f"\n## {setup.name}: {n['documents']} documents, length mean {n['mean_len']:.0f} p50 {n['p50']:.0f} "
        f"p90 {n['p90']:.0f} max {n['max']}, loss-token share {n['loss_share']:.2f}"
    )
    if "hf_window_fill" in n:
        print(
            f"HF group_by_length: timed window {n['hf_window_real_per_step']:.0f} real tokens/step, fill "
            f"{n['hf_window_fill']:.3f}; whole epoch fill {n['hf_epoch_fill']:.3f} (8 x mean = {8 * n['mean_len']:.0f} per step)"
        )
    print(
        f"target {setup.tokens_per_step} real tokens/step; plain rows {n['plain_rows']}; token_budget {setup.budget} "
        f"slots/batch; HF {setup.hf_rows} rows/batch; {setup.steps} timed steps after {setup.warmup} warm-up; "
        f"{len(next(iter(runs.values())))} repeat(s)"
    )
    med = {m: statistics.median(r.tokens_per_s for r in rs) for m, rs in runs.items()}
    cmed = {m: statistics.median(r.tokens_per_cpu_s for r in rs) for m, rs in runs.items()}
    print(
        f"{'method':34s} {'real tok/s':>10s} {'min-max':>13s} {'real/step':>9s} {'fill':>5s} {'s/step':>6s} "
        f"{'tok/CPU-s':>9s} {'load':>9s}"
    )
    out = {
        "setup": dict(n)
        | {"tokens_per_step": setup.tokens_per_step, "seq_len": setup.seq_len, "steps": setup.steps, "warmup": setup.warmup},
        "methods": {},
    }
    for m, rs in runs.items():
        tps = [r.tokens_per_s for r in rs]
        real = statistics.mean(x for r in rs for x in r.real)
        fill = statistics.mean(r.fill for r in rs)
        sps = statistics.median(statistics.mean(r.seconds) for r in rs)
        loads = [r.load for r in rs]
        print(
            f"{LABELS[m]:34s} {med[m]:10.0f} {min(tps):6.0f}-{max(tps):<6.0f} {real:9.0f} {fill:5.2f} {sps:6.2f} "
            f"{cmed[m]:9.0f} {min(loads):4.1f}-{max(loads):<4.1f}"
        )
        out["methods"][m] = {
            "tokens_per_s_median": med[m],
            "tokens_per_s_all": tps,
            "tokens_per_cpu_s_median": cmed[m],
            "real_tokens_per_step": real,
            "fill_rate": fill,
            "seconds_per_step_median": sps,
            "loss_tokens_per_step": statistics.mean(x for r in rs for x in r.loss_tokens),
            "load_average": loads,
        }
    ratios = {}
    for a, b, target in FULL_TARGETS if n["full_loss"] else RESPONSE_TARGETS:
        if a not in runs or b not in runs:
            continue
        paired = [x.tokens_per_s / y.tokens_per_s for x, y in zip(runs[a], runs[b])]  # same repeat: same load
        r, rc = statistics.median(paired), cmed[a] / cmed[b]
        ratios[f"{a}/{b}"] = {"paired_median": r, "paired": paired, "of_medians": med[a] / med[b], "cpu_time": rc}
        verdict = "" if target is None else f"  target >= {target}: {'met' if r >= target else 'MISSED'}"
        print(
            f"  {LABELS[a]:36s} / {LABELS[b]:32s} = {r:5.3f} (repeats {min(paired):.3f}-{max(paired):.3f}; "
            f"of medians {med[a] / med[b]:.3f}; CPU time {rc:.3f}){verdict}"
        )
    out["ratios"] = ratios
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default="both", choices=("instruction", "oasst", "both"))
    ap.add_argument(
        "--full-loss", default=None, help=f"full-loss mode on these pre-tokenised sets (comma list of {', '.join(SETS)})"
    )
    ap.add_argument(
        "--data-dir", default=None, help="folder with gpt2/, instruction-data.json, oasst-threads.jsonl (default: ../shared/data)"
    )
    ap.add_argument("--steps", type=int, default=None, help="timed optimizer steps per method (default 3; 20 in full-loss mode)")
    ap.add_argument("--warmup-steps", type=int, default=None, help="untimed steps first, >= 1 (default 1; 3 in full-loss mode)")
    ap.add_argument(
        "--tokens-per-step", type=int, default=None, help="real tokens per step (default 2048; full-loss: 8 x mean length)"
    )
    ap.add_argument("--hf-rows", type=int, default=8, help="full-loss mode: HF Trainer's per_device_train_batch_size")
    ap.add_argument("--seq-len", type=int, default=1024, help="packed row length; longest document")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--methods", default=None, help=f"comma list of {', '.join(METHODS)}")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument(
        "--sequential", action="store_true", help="run the methods one after the other instead of one step of each in turn"
    )
    ap.add_argument(
        "--attention-cost",
        action="store_true",
        help="time forward+backward of one packed batch with its "
        "document mask against the same tokens as one causal sequence per row (no mask), alternating",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="run each method once under torch.profiler and print where its CPU time goes (operators by self time), "
        "instead of the throughput table",
    )
    args = ap.parse_args(argv)
    full = bool(args.full_loss)
    args.steps = args.steps or (20 if full else 3)
    args.warmup_steps = args.warmup_steps or (3 if full else 1)
    methods = [
        m.strip() for m in (args.methods or ",".join(FULL_LOSS_METHODS if full else DEFAULT_METHODS)).split(",") if m.strip()
    ]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        ap.error(f"unknown method {bad[0]!r}; expected some of {', '.join(METHODS)}")
    if args.warmup_steps < 1 or args.steps < 1:
        ap.error("--steps and --warmup-steps must be >= 1")
    if not full and (args.tokens_per_step or 2048) % args.seq_len:
        ap.error("--tokens-per-step must be a multiple of --seq-len (packed rows and the ceiling use full rows)")
    names = (
        [x.strip() for x in args.full_loss.split(",")]
        if full
        else ["instruction", "oasst"]
        if args.dataset == "both"
        else [args.dataset]
    )
    if full and any(x not in SETS for x in names):
        ap.error(f"--full-loss: expected some of {', '.join(SETS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    data_dir = require_shared_data(args.data_dir)
    import transformers

    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, methods {', '.join(methods)}",
        flush=True,
    )
    results = {
        "argv": sys.argv[1:],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "datasets": {},
    }
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmpd:
        tmp = Path(tmpd)
        for name in names:
            setup = prepare_setup(name, args, data_dir, tmp)
            features = hf_features(setup.store) if any(m.startswith("hf_") for m in methods) or full else None
            if full:
                match_hf_window(setup, args, features)
            if args.attention_cost:
                attention_cost(setup, args.repeats)
                continue
            if args.profile:
                for m in methods:
                    profile_method(setup, m, features)
                continue
            runs: dict[str, list[Run]] = {m: [] for m in methods}
            for rep in range(args.repeats):
                order = methods[rep % len(methods) :] + methods[: rep % len(methods)]
                load = os.getloadavg()[0]
                jobs = {m: functools.partial(run_method, setup, m, features) for m in order}
                if args.sequential:
                    done = {m: run_alone(job) for m, job in jobs.items()}
                else:  # one step of each method in turn: they share the machine's load alike
                    done = run_interleaved(jobs)
                for m in order:
                    r = done[m]
                    r.load = load
                    runs[m].append(r)
                    print(
                        f"  [{name} repeat {rep + 1}/{args.repeats}] {LABELS[m]:34s} {r.tokens_per_s:8.0f} real tok/s "
                        f"{r.tokens_per_cpu_s:6.0f} per CPU-s (fill {r.fill:.2f}, {statistics.mean(r.seconds):.2f} s/step, "
                        f"{statistics.mean(r.real):.0f} real/step, load {load:.1f})",
                        flush=True,
                    )
            results["datasets"][name] = report(setup, runs)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s, load average now {os.getloadavg()[0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

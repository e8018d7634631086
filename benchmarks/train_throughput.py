"""Training throughput, side by side: densebatch vs Hugging Face ``Trainer`` vs a dense ceiling.

One process, one model (a Hugging Face GPT-2 config: 4 layers, width 256, 4 heads, vocabulary 50,257,
random init, dropout 0, fp32), one dataset (documents prepared once by ``densebatch.data.prepare``:
the same token ids and the same prompt mask for every method), the same target of real tokens per
optimizer step and the same number of steps. Methods:

- ``db_token_budget``  densebatch ``token_budget`` batches (rows x longest <= budget; the slot budget is
  chosen from the plan so that the epoch's mean real tokens per batch equals the target).
- ``db_packed``        densebatch ``packed`` rows of ``--seq-len`` (target / seq_len rows per batch).
- ``hf_random``        ``transformers.Trainer``, random sampling, ``DataCollatorForSeq2Seq`` padding;
  ``per_device_train_batch_size = round(target / mean document length)``.
- ``hf_group_by_length``  the same with ``train_sampling_strategy="group_by_length"``.
- ``ceiling``          forward + backward + AdamW on full rows of ``--seq-len`` real tokens (no padding,
  one causal sequence per row, loss on every token, plain Hugging Face model call): what the hardware
  does when every slot is a real token.
- ``ceiling_lossonly`` (opt-in with ``--methods``) the same full rows through densebatch's model path
  (``HFCausalLM.token_losses``: the output head projects only positions that carry a target), with the
  data's prompt mask: the ceiling of densebatch's own compute path.

densebatch runs through its real pipeline: ``prepare`` -> ``PlanSettings`` -> ``BatchLoader`` (prefetch
thread) -> ``collator_from_config`` -> ``HFCausalLM`` -> ``densebatch.train.loop.Trainer``. A step's time
is the wall time between the ends of consecutive optimizer steps (data loading, collation, forward,
backward, clipping, optimizer and logging included); the first ``--warmup-steps`` steps are excluded.
Only real (non-padding) tokens count. Each repeat runs every method once (the order rotates between
repeats, so that load from other processes does not favour one method); the table shows medians.

    .venv/bin/python benchmarks/train_throughput.py                      # both data sets, defaults
    .venv/bin/python benchmarks/train_throughput.py --dataset oasst --steps 8 --repeats 3
    .venv/bin/python benchmarks/train_throughput.py --methods db_packed,ceiling --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput_baselines import hf_features, run_ceiling, run_hf  # noqa: E402
from throughput_common import (  # noqa: E402
    DATASETS,
    DEFAULT_METHODS,
    LABELS,
    METHODS,
    Run,
    Setup,
    find_shared_data,
    token_budget_for,
    write_model_dir,
)


def run_densebatch(setup: Setup, strategy: str) -> Run:
    from densebatch.config import BatchingConfig, EvalConfig, TrainConfig
    from densebatch.data.collate import collator_from_config
    from densebatch.data.loader import BatchLoader
    from densebatch.data.plan import PlanSettings
    from densebatch.model import HFCausalLM
    from densebatch.train.loop import Trainer

    if strategy == "packed":
        bcfg = BatchingConfig(strategy="packed", max_tokens_per_batch=setup.tokens_per_step, seq_len=setup.seq_len)
    else:
        bcfg = BatchingConfig(strategy="token_budget", max_tokens_per_batch=setup.budget, seq_len=setup.seq_len)
    settings = PlanSettings.from_config(bcfg)
    collator = collator_from_config(bcfg, setup.store.meta, setup.seed)
    loader = BatchLoader(setup.store, settings, collator, seed=setup.seed, prefetch=bcfg.prefetch)
    torch.manual_seed(setup.seed)
    model = HFCausalLM(setup.model_dir)
    tcfg = TrainConfig(max_steps=setup.warmup + setup.steps, lr=setup.lr, progress=False, device="cpu", spike_zscore=0.0)
    ends: list[float] = []
    cpu: list[float] = []
    recs: list[dict] = []

    def on_step(trainer, step):
        ends.append(time.perf_counter())
        cpu.append(time.process_time())
        recs.append(dict(trainer.last_record))

    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(model, loader, tcfg, EvalConfig(), output_dir=out, device="cpu", on_step=on_step, console=False)
        trainer.run()
        if trainer._it is not None:  # stop the loader's prefetch thread now, not at garbage collection
            trainer._it.close()
    w = setup.warmup
    secs = list(np.diff(ends[w - 1 :]))
    m = recs[w:]
    return Run(
        f"db_{strategy}",
        secs,
        [r["real_tokens"] for r in m],
        [r["slot_tokens"] for r in m],
        [r["loss_tokens"] for r in m],
        list(np.diff(cpu[w - 1 :])),
    )


# ------------------------------------------------------------------------------------ driver
def prepare_setup(name: str, args, data_dir: Path, tmp: Path) -> Setup:
    from densebatch.config import DataConfig
    from densebatch.data.prepare import prepare

    fname, template = DATASETS[name]
    prepared = prepare(
        DataConfig(
            path=str(data_dir / fname),
            template=template,
            tokenizer=str(data_dir / "gpt2"),
            eval_fraction=0.0,
            max_seq_len=args.seq_len,
            cache_dir=str(tmp / "cache"),
        )
    )
    model_dir = tmp / "model"
    if not (model_dir / "config.json").is_file():
        write_model_dir(model_dir, n_positions=max(1024, args.seq_len))
    s = Setup(
        name,
        prepared.train,
        model_dir,
        args.tokens_per_step,
        args.seq_len,
        args.steps,
        args.warmup_steps,
        args.lr,
        args.seed,
        data_dir / "gpt2",
    )
    lengths = np.asarray(s.store.lengths)
    s.hf_rows = max(1, round(args.tokens_per_step / lengths.mean()))
    s.budget, tb_fill = token_budget_for(s.store, args.tokens_per_step, args.seq_len, args.seed)
    s.notes = {
        "documents": len(lengths),
        "mean_len": float(lengths.mean()),
        "p50": float(np.percentile(lengths, 50)),
        "p90": float(np.percentile(lengths, 90)),
        "max": int(lengths.max()),
        "loss_share": float(np.asarray(s.store.loss_mask).mean()),
        "hf_rows": s.hf_rows,
        "token_budget_slots": s.budget,
        "token_budget_epoch_fill": tb_fill,
    }
    return s


def profile_method(setup: Setup, method: str, features, rows: int = 22) -> None:
    """Operators by self CPU time over a whole run of ``method`` (warm-up and model build included)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        r = run_method(setup, method, features)
        wall = time.perf_counter() - t0
    print(
        f"\n### profile {setup.name} / {LABELS[method]}: {wall:.1f} s in all, timed steps {sum(r.seconds):.1f} s, "
        f"{r.tokens_per_s:.0f} real tok/s under the profiler"
    )
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=48))


def attention_cost(setup: Setup, repeats: int) -> None:
    """What document isolation costs densebatch's model path: one packed batch (from the real loader)
    through ``HFCausalLM.token_losses`` forward + backward, with its positions (4-D document mask, SDPA
    over all T x T pairs) and with ``positions = arange(T)`` (plain causal SDPA, no mask), same tokens
    and labels; alternating, median of ``repeats`` (at least 3) each."""
    import dataclasses

    from densebatch.config import BatchingConfig
    from densebatch.data.collate import collator_from_config
    from densebatch.data.loader import BatchLoader
    from densebatch.data.plan import PlanSettings
    from densebatch.model import HFCausalLM
    from densebatch.model.attention import document_mask

    bcfg = BatchingConfig(strategy="packed", max_tokens_per_batch=setup.tokens_per_step, seq_len=setup.seq_len)
    loader = BatchLoader(
        setup.store, PlanSettings.from_config(bcfg), collator_from_config(bcfg, setup.store.meta), seed=setup.seed, prefetch=0
    )
    packed = next(iter(loader.iter_epoch(0)))
    rows, T = packed.input_ids.shape
    causal = dataclasses.replace(packed, positions=torch.arange(T).expand(rows, T).contiguous(), num_real_tokens=packed.num_slots)
    torch.manual_seed(setup.seed)
    model = HFCausalLM(setup.model_dir)
    times: dict[str, list[float]] = {"packed (document mask)": [], "causal (no mask)": [], "mask build only": []}
    for i in range(max(3, repeats) + 1):
        for name, batch in (("packed (document mask)", packed), ("causal (no mask)", causal)):
            t0 = time.perf_counter()
            model.token_losses(batch).sum().backward()
            model.zero_grad(set_to_none=True)
            if i:
                times[name].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        document_mask(packed.positions)
        if i:
            times["mask build only"].append(time.perf_counter() - t0)
    segs = int((packed.positions == 0).sum())
    print(
        f"\n### attention cost, {setup.name}: one packed batch {rows} x {T}, {segs} segments, "
        f"{packed.num_real_tokens} real / {packed.num_loss_tokens} loss tokens; forward + backward, median of {len(times['mask build only'])}"
    )
    base = statistics.median(times["causal (no mask)"])
    for name, ts in times.items():
        print(f"  {name:24s} {statistics.median(ts):7.3f} s  ({statistics.median(ts) / base:.2f} x causal)")


def run_method(setup: Setup, method: str, features) -> Run:
    if method == "db_token_budget":
        return run_densebatch(setup, "token_budget")
    if method == "db_packed":
        return run_densebatch(setup, "packed")
    if method == "hf_random":
        return run_hf(setup, "random", features)
    if method == "hf_group_by_length":
        return run_hf(setup, "group_by_length", features)
    if method == "ceiling":
        return run_ceiling(setup, loss_only=False)
    if method == "ceiling_lossonly":
        return run_ceiling(setup, loss_only=True)
    raise ValueError(method)


def report(setup: Setup, runs: dict[str, list[Run]]) -> dict:
    n = setup.notes
    print(
        f"\n## {setup.name}: {n['documents']} documents, length mean {n['mean_len']:.0f} p50 {n['p50']:.0f} "
        f"p90 {n['p90']:.0f} max {n['max']}, loss-token share {n['loss_share']:.2f}"
    )
    print(
        f"target {setup.tokens_per_step} real tokens/step; packed rows {setup.tokens_per_step // setup.seq_len} x "
        f"{setup.seq_len}; token_budget {setup.budget} slots/batch; HF {setup.hf_rows} rows/batch; "
        f"{setup.steps} timed steps after {setup.warmup} warm-up; {len(next(iter(runs.values())))} repeat(s)"
    )
    med = {m: statistics.median(r.tokens_per_s for r in rs) for m, rs in runs.items()}
    ceil = med.get("ceiling")
    cmed = {m: statistics.median(r.tokens_per_cpu_s for r in rs) for m, rs in runs.items()}
    print(
        f"{'method':32s} {'real tok/s':>10s} {'min-max':>13s} {'real/step':>9s} {'fill':>5s} {'s/step':>6s} "
        f"{'vs ceiling':>10s} {'tok/CPU-s':>9s} {'vs ceil':>7s}"
    )
    out = {
        "setup": {k: v for k, v in n.items()}
        | {"tokens_per_step": setup.tokens_per_step, "seq_len": setup.seq_len, "steps": setup.steps, "warmup": setup.warmup},
        "methods": {},
    }
    for m, rs in runs.items():
        tps = [r.tokens_per_s for r in rs]
        real = statistics.mean(x for r in rs for x in r.real)
        fill = statistics.mean(r.fill for r in rs)
        sps = statistics.median(statistics.mean(r.seconds) for r in rs)
        rc = f"{med[m] / ceil:10.2f}" if ceil else f"{'-':>10s}"
        cc = f"{cmed[m] / cmed['ceiling']:7.2f}" if ceil else f"{'-':>7s}"
        print(
            f"{LABELS[m]:32s} {med[m]:10.0f} {min(tps):6.0f}-{max(tps):<6.0f} {real:9.0f} {fill:5.2f} {sps:6.2f} {rc} "
            f"{cmed[m]:9.0f} {cc}"
        )
        out["methods"][m] = {
            "tokens_per_s_median": med[m],
            "tokens_per_s_all": tps,
            "tokens_per_cpu_s_median": cmed[m],
            "real_tokens_per_step": real,
            "fill_rate": fill,
            "seconds_per_step_median": sps,
            "loss_tokens_per_step": statistics.mean(x for r in rs for x in r.loss_tokens),
        }
    ratios = {}
    for db in ("db_packed", "db_token_budget"):
        if db not in med:
            continue
        for ref, target in (("ceiling", 0.9), ("hf_random", 2.0), ("hf_group_by_length", 1.1)):
            if ref in med:
                r, rc = med[db] / med[ref], cmed[db] / cmed[ref]
                ratios[f"{db}/{ref}"] = r
                ratios[f"{db}/{ref} (CPU time)"] = rc
                print(
                    f"  {LABELS[db]:24s} / {LABELS[ref]:28s} = {r:5.2f} wall, {rc:5.2f} CPU time  (target >= {target}: "
                    f"{'met' if r >= target else 'MISSED'}{'' if (r >= target) == (rc >= target) else ', CPU-time ratio disagrees'})"
                )
    if "hf_group_by_length" in med and "hf_random" in med:
        ratios["hf_group_by_length/hf_random"] = med["hf_group_by_length"] / med["hf_random"]
    out["ratios"] = ratios
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default="both", choices=("instruction", "oasst", "both"))
    ap.add_argument(
        "--data-dir", default=None, help="folder with gpt2/, instruction-data.json, oasst-threads.jsonl (default: ../shared/data)"
    )
    ap.add_argument("--steps", type=int, default=3, help="timed optimizer steps per method")
    ap.add_argument("--warmup-steps", type=int, default=1, help="untimed steps first (>= 1)")
    ap.add_argument("--tokens-per-step", type=int, default=2048, help="target real tokens per optimizer step")
    ap.add_argument("--seq-len", type=int, default=1024, help="packed / ceiling row length; longest document")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"comma list of {', '.join(METHODS)}")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument(
        "--attention-cost",
        action="store_true",
        help="time forward+backward of one packed batch with its "
        "document mask against the same tokens as one causal sequence per row (no mask), alternating",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="run each method once under torch.profiler and print "
        "where its CPU time goes (operators by self time), instead of the throughput table",
    )
    args = ap.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        ap.error(f"unknown method {bad[0]!r}; expected some of {', '.join(METHODS)}")
    if args.warmup_steps < 1 or args.steps < 1:
        ap.error("--steps and --warmup-steps must be >= 1")
    if args.tokens_per_step % args.seq_len:
        ap.error("--tokens-per-step must be a multiple of --seq-len (packed rows and the ceiling use full rows)")
    if args.threads:
        torch.set_num_threads(args.threads)
    data_dir = find_shared_data(args.data_dir)
    names = ["instruction", "oasst"] if args.dataset == "both" else [args.dataset]
    import transformers

    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads, "
        f"methods {', '.join(methods)}",
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
            features = hf_features(setup.store) if any(m.startswith("hf_") for m in methods) else None
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
                for m in order:
                    r = run_method(setup, m, features)
                    runs[m].append(r)
                    print(
                        f"  [{name} repeat {rep + 1}/{args.repeats}] {LABELS[m]:32s} {r.tokens_per_s:8.0f} real tok/s "
                        f"{r.tokens_per_cpu_s:6.0f} per CPU-s (fill {r.fill:.2f}, {statistics.mean(r.seconds):.2f} s/step)",
                        flush=True,
                    )
            results["datasets"][name] = report(setup, runs)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The GPU check: densebatch against Hugging Face Trainer as users run it, same model, documents and real tokens a step.

Called by ``benchmarks/gpu.sh`` (``--dry-run``: the same runs, tiny, on CPU). No downloads: the models are
built from configs with random weights; the documents are random tokens whose lengths are those of
``oasst-threads.jsonl`` under the GPT-2 BPE (a lognormal fit, p50 317 / p90 807, when the shared data are
absent) at the first context, and a long-document set (log-uniform up to the context) at the longer ones.

Models (``--models``): ``gpt2`` (124M: 12 layers, width 768, 12 heads, vocabulary 50,257) and ``llama``
(~0.5B: 16 layers, hidden 1,536, 12 heads, 2 key/value heads, MLP 4,096, vocabulary 32,000, untied head).
A step holds ``--slots`` (32,768) token slots: densebatch packs them into rows of the context; the Hugging
Face runs take as many documents a step as hold the same real tokens on average.

Runs, in this order (the key comparisons first, so a short lease still returns them):
1. per model at the first context: ``densebatch`` (bf16, attention densebatch: varlen FlashAttention), then
   ``hf-flattening`` (Trainer + ``DataCollatorWithFlattening`` with the best kernel the image has, named);
2. ``densebatch+compile`` and ``hf-flattening+compile`` per model; 3. ``densebatch-fp16`` (first model;
   its losses compared with bf16's); 4. ``densebatch`` and ``hf-flattening`` at the longer contexts;
5. ``hf-group_by_length``: padded micro-batches bounded to the slots, gradient accumulation to the same
   documents a step (or "OOM at N padded slots": a result).

Each row is printed and the JSON and table rewritten as it finishes; SIGTERM stops the run in progress and
still prints the table and writes both. A run starts only if its estimated cost (a prior per kind of run,
scaled by how the finished runs compared with theirs) fits before ``--budget-s``. Between runs: gc, dynamo
reset, CUDA cache emptied and peak counters reset; graph breaks are counted per run. MFU = real tokens/s x
FLOPs per token / peak, against the spec sheet and against a bf16 matmul ceiling measured in the same call
(8192^3, 10 timed products). FLOPs per token = 6 N (N without the input embeddings; a tied head counts as
the output matrix) + 12 L d l (l: the document's own length).
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.gpu.ceiling import matmul_ceiling, spec_flops, tf32_on
from benchmarks.gpu.runs import OutOfMemory, gib, reset, run_densebatch, run_hf
from benchmarks.gpu.workload import long_lengths, make_documents, oasst_lengths

METHODS = ("densebatch", "hf-flattening", "densebatch+compile", "hf-flattening+compile", "densebatch-fp16", "hf-group_by_length")
SIZES = {  # (layers, width, heads, key/value heads, MLP, vocabulary)
    "gpt2": (12, 768, 12, 12, 3072, 50257),
    "llama": (16, 1536, 12, 2, 4096, 32000),
}
TINY = {"gpt2": (2, 64, 4, 4, 256, 2048), "llama": (2, 64, 4, 2, 128, 2048)}
# Prior cost of a run in seconds (model build, warm-up and timed steps): H200 guesses, and CPU dry-run ones;
# scaled by llama x1.5 and a long context x1.3, then by measured / prior over the runs finished so far.
PRIOR_S = {"densebatch": 20, "hf-flattening": 25, "hf-group_by_length": 35, "densebatch-fp16": 20, "compile": 90}
MIN_RUN_S = 60.0  # a run's own deadline is 3x its estimate, never less than this
PRIOR_DRY_S = {"densebatch": 4, "hf-flattening": 4, "hf-group_by_length": 5, "densebatch-fp16": 4, "compile": 60}


class Stopped(BaseException):  # not an Exception: no library handler swallows it
    """SIGTERM arrived: stop the run in progress, print the table, write the JSON."""


def _on_term(signum, frame):
    raise Stopped()


class OverTime(BaseException):
    """A run past its own deadline (3x its estimate, at least a minute, never past the budget): its row says so
    and the check goes on with the next run (HF's compiled runs can recompile every step)."""


def _on_alarm(signum, frame):
    raise OverTime()


def log(msg: str = "", out: Path | None = None) -> None:
    """One line to stdout, now (``benchmarks/gpu.sh`` copies stdout and stderr into ``--out``'s log)."""
    print(msg, flush=True)


def model_config(name: str, sizes, seq_len: int):
    import transformers

    layers, width, heads, kv, mlp, vocab = sizes
    ids = dict(vocab_size=vocab, bos_token_id=vocab - 1, eos_token_id=vocab - 1, pad_token_id=vocab - 1)
    if name == "gpt2":
        return transformers.GPT2Config(
            n_layer=layers, n_embd=width, n_head=heads, n_inner=mlp, n_positions=seq_len,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **ids,
        )  # fmt: skip
    return transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads, num_key_value_heads=kv,
        intermediate_size=mlp, max_position_embeddings=seq_len, tie_word_embeddings=False, **ids,
    )  # fmt: skip


def flops_per_token(config, lengths: np.ndarray) -> float:
    import transformers

    with torch.device("meta"):
        m = transformers.AutoModelForCausalLM.from_config(config)
    n = sum(p.numel() for p in m.parameters())
    n -= sum(p.numel() for e in m.modules() if isinstance(e, torch.nn.Embedding) for p in e.parameters())
    if getattr(config, "tie_word_embeddings", True):
        n += m.get_output_embeddings().weight.numel()  # the tied table is also the output matrix
    ctx = float((lengths.astype(np.float64) ** 2).sum() / lengths.sum())  # token-weighted mean document length
    width = getattr(config, "hidden_size", None) or config.n_embd
    layers = getattr(config, "num_hidden_layers", None) or config.n_layer
    return 6.0 * n + 12.0 * layers * width * ctx


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", "--smoke", dest="dry_run", action="store_true", help="tiny models and rows on CPU, fp32")
    ap.add_argument("--models", default="gpt2,llama")
    ap.add_argument("--seq-lens", default=None, help="contexts, the key one first (default 2048,8192; dry run 128,256)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--slots", type=int, default=None, help="token slots a step (default 32768; dry run 1024)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 10; dry run 2)")
    ap.add_argument("--warmup-steps", type=int, default=None, help="untimed first steps (default 3; dry run 1)")
    ap.add_argument("--budget-s", type=float, default=None, help="every run ends within this many seconds (420; dry run 900)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the spec sheet's dense bf16 TFLOP/s, if not known by name")
    ap.add_argument("--matmul-n", type=int, default=None, help="the ceiling's matrix size (8192; dry run 256)")
    ap.add_argument("--shared-data", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="folder for the log, table.md and results.json")
    ap.add_argument("--json", default=None, help="also write the JSON here")
    a = ap.parse_args(argv)
    a.models = [m for m in a.models.split(",") if m]
    a.methods = [m for m in a.methods.split(",") if m]
    for m in a.methods:
        if m not in METHODS:
            ap.error(f"unknown method {m!r}; expected some of {', '.join(METHODS)}")
    for m in a.models:
        if m not in SIZES:
            ap.error(f"unknown model {m!r}; expected gpt2 or llama")
    a.seq_lens = [int(x) for x in (a.seq_lens or ("128,256" if a.dry_run else "2048,8192")).split(",")]
    a.budget_s = a.budget_s or (900.0 if a.dry_run else 420.0)
    a.slots = a.slots or (1024 if a.dry_run else 32768)
    a.steps = a.steps or (2 if a.dry_run else 10)
    a.warmup_steps = a.warmup_steps or (1 if a.dry_run else 3)
    a.matmul_n = a.matmul_n or (256 if a.dry_run else 8192)
    return a


def planned_runs(a) -> list[tuple[str, int, str]]:
    """(model, context, method) in the order they run: key comparisons, compile, fp16, long contexts, group_by_length."""
    key, longer = a.seq_lens[0], a.seq_lens[1:]
    runs = [(m, key, x) for m in a.models for x in ("densebatch", "hf-flattening")]
    runs += [(m, key, x) for m in a.models for x in ("densebatch+compile", "hf-flattening+compile")]
    runs += [(a.models[0], key, "densebatch-fp16")]
    runs += [(m, ctx, x) for ctx in longer for m in a.models for x in ("densebatch", "hf-flattening")]
    runs += [(m, key, "hf-group_by_length") for m in a.models]
    return [r for r in runs if r[2] in a.methods]


def prior_s(a, model: str, seq_len: int, method: str) -> float:
    table = PRIOR_DRY_S if a.dry_run else PRIOR_S
    base = table[method.replace("+compile", "")] + (table["compile"] if method.endswith("+compile") else 0)
    return base * (1.5 if model == "llama" else 1.0) * (1.3 if seq_len != a.seq_lens[0] else 1.0)


class Report:
    """The rows so far, printed one by one, with the JSON and the table rewritten after each."""

    COLUMNS = "| model | context | run | kernel | real tok/s | real tok/step | fill | MFU spec | MFU ceiling | peak alloc GiB | peak reserved GiB | graph breaks | vs hf-flattening | note |"

    def __init__(self, a, meta: dict):
        self.a, self.meta, self.rows, self.not_run, self.out = a, meta, [], [], Path(a.out) if a.out else None
        self.stopped = None

    def line(self, r: dict) -> str:
        base = next(
            (x for x in self.rows if (x["model"], x["seq_len"], x["method"]) == (r["model"], r["seq_len"], "hf-flattening")), None
        )
        tps = r.get("tokens_per_s")
        vs = f"{tps / base['tokens_per_s']:.2f}" if tps and base and base.get("tokens_per_s") else "-"
        pct = lambda v: f"{v:.1%}" if v is not None else "n/a"  # noqa: E731
        if tps is None:
            return f"| {r['model']} | {r['seq_len']} | {r['method']} | {r.get('kernel', '-')} | {r['note']} | | | | | | | | | |"
        return (
            f"| {r['model']} | {r['seq_len']} | {r['method']} | {r['kernel']} | {tps:,.0f} | {r['real_per_step']:,.0f} "
            f"| {r['fill']:.2f} | {pct(r['mfu_spec'])} | {pct(r['mfu_ceiling'])} | {gib(r['peak_alloc_gib'])} "
            f"| {gib(r['peak_reserved_gib'])} | {'-' if r['graph_breaks'] is None else r['graph_breaks']} | {vs} | {r['note']} |"
        )

    def add(self, row: dict) -> None:
        self.rows.append(row)
        self.write()  # before the line: whoever reads the line finds the files already holding the row
        log(self.line(row), self.out)

    def write(self) -> None:
        doc = self.meta | {"runs": self.rows, "not_run": self.not_run, "stopped": self.stopped}
        text = json.dumps(doc, indent=1, default=lambda v: None)
        for path in [self.out / "results.json" if self.out else None, Path(self.a.json) if self.a.json else None]:
            if path is not None:
                path.write_text(text)
        if self.out is not None:
            (self.out / "table.md").write_text(self.table())

    def table(self) -> str:
        lines = [self.COLUMNS, "|" + "---|" * (self.COLUMNS.count("|") - 1)] + [self.line(r) for r in self.rows]
        lines += [f"| {m} | {s} | {x} | - | not run: {why} | | | | | | | | | |" for m, s, x, why in self.not_run]
        return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    a = parse(argv)
    if not a.dry_run and not torch.cuda.is_available():
        log("no CUDA device here: the check needs one (--dry-run runs the same script on CPU, tiny)")
        return 2
    t_start = time.perf_counter()
    previous = signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGALRM, _on_alarm)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
    out = Path(a.out) if a.out else None
    device = torch.device("cuda" if torch.cuda.is_available() and not a.dry_run else "cpu")
    import transformers

    tf32 = tf32_on(device)
    spec, spec_note = spec_flops(device, a.peak_tflops)
    ceiling, ceiling_note = matmul_ceiling(device, a.matmul_n)
    meta = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "spec_flops": spec,
        "spec": spec_note,
        "ceiling_flops": ceiling,
        "ceiling": ceiling_note,
        "tf32": tf32,
        "budget_s": a.budget_s,
    }
    log(f"{meta['device']}; torch {meta['torch']}; transformers {meta['transformers']}; TF32 via {tf32}", out)
    log(f"peak: {spec_note}; ceiling: {ceiling_note}", out)
    report = Report(a, meta)
    oasst, oasst_source = oasst_lengths(a.shared_data)
    workloads: dict = {}
    ratios: list[float] = []  # measured / prior seconds of the finished runs
    bf16_losses: dict = {}
    runs = planned_runs(a)
    current = None  # the run in progress
    tmp = tempfile.TemporaryDirectory()
    log(Report.COLUMNS, out)
    try:
        for model, seq_len, method in runs:
            current, elapsed = None, time.perf_counter() - t_start
            est = prior_s(a, model, seq_len, method) * (statistics.median(ratios) if ratios else 1.0)
            if elapsed + est > a.budget_s:
                report.not_run.append((model, seq_len, method, f"estimated {est:.0f} s, {a.budget_s - elapsed:.0f} s left"))
                report.write()
                continue
            if method == "densebatch-fp16" and device.type != "cuda":
                report.not_run.append((model, seq_len, method, "fp16 needs CUDA"))
                continue
            key = (model, seq_len)
            if key not in workloads:
                workloads[key] = _workload(a, model, seq_len, oasst if seq_len == a.seq_lens[0] else None, oasst_source, tmp.name)
                log(f"   ({model}, context {seq_len}: {workloads[key]['about']})", out)
            w = workloads[key]
            a.vocab, a.seq_len, a.examples = w["vocab"], seq_len, w["examples"]
            current = f"{model}/{seq_len}/{method}"
            reset(device)
            t0 = time.perf_counter()
            allowed = min(a.budget_s - elapsed, max(3 * est, MIN_RUN_S))
            signal.setitimer(signal.ITIMER_REAL, allowed)
            row = {"model": model, "seq_len": seq_len, "method": method}
            try:
                if method.startswith("densebatch"):
                    precision = "fp16" if method == "densebatch-fp16" else "auto"
                    r = run_densebatch(a, w["store"], device, w["dir"], precision, method.endswith("+compile"))
                else:
                    r = run_hf(a, w["store"], device, w["dir"], method.endswith("+compile"), method.startswith("hf-flattening"))
            except OutOfMemory as e:
                report.add(row | {"note": str(e), "seconds": time.perf_counter() - t0})
                continue
            except OverTime:
                note = f"stopped after {time.perf_counter() - t0:.0f} s: over its time (estimated {est:.0f} s)"
                report.add(row | {"note": note, "seconds": time.perf_counter() - t0})
                continue
            except Stopped:
                raise
            except Exception as e:  # one failing run must not hide the others
                report.add(row | {"note": f"FAILED: {type(e).__name__}: {str(e)[:200]}", "seconds": time.perf_counter() - t0})
                continue
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                reset(device)
            current, seconds = None, time.perf_counter() - t0
            ratios.append(seconds / prior_s(a, model, seq_len, method))
            note = ""
            if method == "densebatch":
                bf16_losses[key] = r.losses
            if method == "densebatch-fp16" and bf16_losses.get(key):
                diff = max(abs(x - y) for x, y in zip(r.losses, bf16_losses[key]))
                note = f"losses within {diff:.3g} of bf16's over {min(len(r.losses), len(bf16_losses[key]))} steps"
            report.add(
                row
                | {
                    "kernel": r.kernel,
                    "tokens_per_s": r.tokens_per_s,
                    "real_per_step": r.real_per_step,
                    "fill": r.fill,
                    "mfu_spec": r.tokens_per_s * w["flops_per_token"] / spec if spec else None,
                    "mfu_ceiling": r.tokens_per_s * w["flops_per_token"] / ceiling,
                    "ms_per_step": statistics.mean(r.seconds) * 1e3,
                    "peak_alloc_gib": None if math.isnan(r.peak_alloc) else r.peak_alloc,
                    "peak_reserved_gib": None if math.isnan(r.peak_reserved) else r.peak_reserved,
                    "graph_breaks": r.graph_breaks,
                    "note": "; ".join(x for x in (r.note, note) if x),
                    "seconds": seconds,
                }
            )
    except Stopped:
        report.stopped = f"SIGTERM during {current}" if current else "SIGTERM between runs"
        log(f"\nstopped by {report.stopped} after {time.perf_counter() - t_start:.0f} s", out)
        done = {(r["model"], r["seq_len"], r["method"]) for r in report.rows} | {x[:3] for x in report.not_run}
        report.not_run += [(*r, "stopped by SIGTERM") for r in runs if r not in done]
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the table is written whole
        signal.setitimer(signal.ITIMER_REAL, 0)
        report.write()
        log("\n" + report.table(), out)
        log(f"total {time.perf_counter() - t_start:.0f} s (budget {a.budget_s:.0f} s)", out)
        tmp.cleanup()
        signal.signal(signal.SIGTERM, previous)
    if report.stopped:
        return 143
    return 0 if report.rows else 1


def _workload(a, model: str, seq_len: int, oasst, oasst_source: str, tmp: str) -> dict:
    """The documents (a store), model directory, FLOPs per token and documents a step of one (model, context)."""
    from densebatch.data.store.store import DocumentStore

    sizes = (TINY if a.dry_run else SIZES)[model]
    vocab = sizes[-1]
    lengths, about = (oasst, oasst_source) if oasst is not None else long_lengths(seq_len, seed=a.seed)
    need = int(1.5 * (a.steps + a.warmup_steps) * a.slots)
    lens, tokens = make_documents(lengths, seq_len, vocab, need, a.seed)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    mask = np.ones(len(tokens), np.uint8)
    mask[offsets[:-1]] = 0  # a document's first token is never a target
    eos = vocab - 1
    meta = {"eos_id": eos, "pad_id": eos, "vocab_size": vocab, "mask_id": None, "special_ids": [eos]}
    config = model_config(model, sizes, seq_len)
    path = Path(tmp) / f"{model}-{seq_len}"
    config.save_pretrained(path)
    examples = max(1, round(a.slots * 0.97 / lens.mean()))
    return {
        "store": DocumentStore(tokens, offsets=offsets, loss_mask=mask, meta=meta),
        "dir": path,
        "vocab": vocab,
        "flops_per_token": flops_per_token(config, lens),
        "examples": examples,
        "about": f"{sizes[0]} layers, width {sizes[1]}; {about}; HF runs take {examples} documents a step (mean {lens.mean():.0f})",
    }


if __name__ == "__main__":
    raise SystemExit(main())

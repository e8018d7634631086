"""GPU throughput, MFU and memory: densebatch against Hugging Face Trainer as users run it, same model, same documents.

Called by ``benchmarks/gpu.sh`` (``--dry-run``: the same runs, CI-sized, on CPU). No downloads: the
models are built from configs with random weights, the documents are random tokens whose lengths are
those of ``oasst-threads.jsonl`` under the GPT-2 BPE (a lognormal fit with its p50 317 / p90 807 when
the shared data are absent), truncated to the context, every token a target.

Models (``--models``): ``gpt2`` (124M: 12 layers, width 768, 12 heads, vocabulary 50,257) and ``llama``
(~0.5B Llama architecture: 16 layers, hidden 1,536, 12 heads, 2 key/value heads, MLP 4,096, vocabulary
32,000, untied head). Contexts (``--seq-lens``): 2,048 and 8,192. A step holds ``--slots`` (32,768) token
slots: densebatch packs them into rows of the context; the Hugging Face runs take as many documents a
step as hold the same real tokens on average (``slots x 0.97 / mean length``).

Runs, per model and context (``--methods``):
- ``densebatch``: ``densebatch`` packed, the Hugging Face model through ``HFCausalLM``
  (``attn_implementation: densebatch``: varlen FlashAttention on CUDA), ``train.precision: auto`` (bf16).
- ``hf-flattening``: ``transformers.Trainer`` + ``DataCollatorWithFlattening`` (HF's recommended packing)
  with the best attention importable: flash_attention_2, else flex_attention, else sdpa; bf16,
  ``adamw_torch_fused``.
- ``hf-group_by_length``: ``transformers.Trainer``, padded batches, ``train_sampling_strategy="group_by_length"``, SDPA.
- ``densebatch+compile`` / ``hf-flattening+compile``: the same, compiled (``train.compile`` /
  ``torch_compile``); at the first context only (compiling costs about a minute a run).
- ``densebatch-fp16``: fp16 autocast with the grad scaler; its losses are compared with the bf16 run's
  (first context of the first model only).

Reported per run: real tokens per second over the timed steps (after ``--warmup-steps``, CUDA synchronised
at each step end), real tokens a step, MFU and peak allocated memory. MFU = real tokens/s x FLOPs per token
/ peak bf16 FLOP/s of the device, which is read from its name and memory (SXM and NVL/PCIe parts differ),
FLOPs per token = 6 N (N: parameters without the input and position embeddings; a tied head counts as the
output matrix) + 12 L d l (l: the document's own length; padding and cross-document attention are not
useful work). ``--budget-s``: runs that would start after it are skipped and listed.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.gpu.runs import gib, reset, run_densebatch, run_hf
from benchmarks.gpu.workload import make_documents, oasst_lengths

METHODS = ("densebatch", "hf-flattening", "hf-group_by_length", "densebatch+compile", "hf-flattening+compile", "densebatch-fp16")
# (name substring, memory at least GiB, dense bf16 TFLOP/s): the first match wins. SXM parts first by memory.
PEAKS = (
    ("H200 NVL", 0, 835),
    ("H200", 0, 989),
    ("H100 NVL", 0, 835),
    ("H100 PCIe", 0, 756),
    ("H100", 0, 989),
    ("GH200", 0, 989),
    ("B200", 0, 2250),
    ("A100", 0, 312),
    ("L40S", 0, 362),
    ("L4", 0, 121),
    ("A10G", 0, 70),
)
SIZES = {  # (layers, width, heads, key/value heads, MLP, vocabulary)
    "gpt2": (12, 768, 12, 12, 3072, 50257),
    "llama": (16, 1536, 12, 2, 4096, 32000),
}
TINY = {"gpt2": (2, 64, 4, 4, 256, 2048), "llama": (2, 64, 4, 2, 128, 2048)}


def log(msg: str = "") -> None:
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


def peak_flops(device: torch.device, override_tflops: float | None) -> tuple[float | None, str]:
    if override_tflops:
        return override_tflops * 1e12, f"--peak-tflops {override_tflops}"
    if device.type != "cuda":
        return None, "no peak for CPU"
    name = torch.cuda.get_device_name(device)
    mem = torch.cuda.get_device_properties(device).total_memory / 2**30
    for key, min_mem, tf in PEAKS:
        if key in name and mem >= min_mem:
            return tf * 1e12, f"{name} ({mem:.0f} GiB): {tf} TFLOP/s bf16 dense"
    return None, f"{name} ({mem:.0f} GiB): peak unknown (pass --peak-tflops)"


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", "--smoke", dest="dry_run", action="store_true", help="CI-sized models and rows on CPU, fp32")
    ap.add_argument("--models", default="gpt2,llama")
    ap.add_argument("--seq-lens", default=None, help="contexts (default 2048,8192; dry run 128,256)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--slots", type=int, default=None, help="token slots a step (default 32768; dry run 1024)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 10; dry run 2)")
    ap.add_argument("--warmup-steps", type=int, default=None, help="untimed first steps (default 3; dry run 1)")
    ap.add_argument("--budget-s", type=float, default=None, help="no run starts after this many seconds (420; dry run 900)")
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--shared-data", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
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
    return a


def runs_for(a, model: str, seq_len: int) -> list[str]:
    first_ctx, first_model = seq_len == a.seq_lens[0], model == a.models[0]
    out = []
    for m in a.methods:
        if m.endswith("+compile") and not first_ctx:
            continue
        if m == "densebatch-fp16" and not (first_ctx and first_model):
            continue
        out.append(m)
    return out


def main(argv=None) -> int:
    a = parse(argv)
    t_start = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() and not a.dry_run else "cpu")
    bf16 = "bf16" if device.type == "cuda" else "fp32"
    peak, peak_note = peak_flops(device, a.peak_tflops)
    import transformers

    log(
        f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; torch {torch.__version__}; "
        f"transformers {transformers.__version__}; peak: {peak_note}"
    )
    lengths, source = oasst_lengths(a.shared_data)
    from densebatch.data.store.store import DocumentStore

    table, skipped, out = [], [], {"device": str(device), "peak_flops": peak, "runs": []}
    for model in a.models:
        sizes = (TINY if a.dry_run else SIZES)[model]
        for seq_len in a.seq_lens:
            vocab = sizes[-1]
            need = int(1.5 * (a.steps + a.warmup_steps) * a.slots)
            lens, tokens = make_documents(lengths, seq_len, vocab, need, a.seed)
            offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
            mask = np.ones(len(tokens), np.uint8)
            mask[offsets[:-1]] = 0  # a document's first token is never a target
            eos = vocab - 1
            meta = {"eos_id": eos, "pad_id": eos, "vocab_size": vocab, "mask_id": None, "special_ids": [eos]}
            store = DocumentStore(tokens, offsets, mask, meta)
            config = model_config(model, sizes, seq_len)
            fpt = flops_per_token(config, lens)
            a.layers, a.width, a.heads, a.vocab, a.seq_len = sizes[0], sizes[1], sizes[2], vocab, seq_len
            a.examples = max(1, round(a.slots * 0.97 / lens.mean()))
            log(
                f"\n== {model} ({sizes[0]} layers, width {sizes[1]}, vocabulary {vocab}), context {seq_len}: "
                f"{a.slots} slots a step; HF runs take {a.examples} documents a step (mean {lens.mean():.0f} tokens; {source})"
            )
            bf16_losses = None
            with tempfile.TemporaryDirectory() as tmp:
                model_dir = Path(tmp) / model
                config.save_pretrained(model_dir)
                for m in runs_for(a, model, seq_len):
                    if time.perf_counter() - t_start > a.budget_s:
                        skipped.append(f"{model}/{seq_len}/{m}")
                        continue
                    if m == "densebatch-fp16" and device.type != "cuda":
                        log(f"  {m:24s} skipped: fp16 needs CUDA")
                        continue
                    t0 = time.perf_counter()
                    try:
                        if m.startswith("densebatch"):
                            precision = "fp16" if m == "densebatch-fp16" else "auto"
                            r = run_densebatch(a, store, device, model_dir, precision, m.endswith("+compile"))
                        else:
                            r = run_hf(a, store, device, model_dir, bf16, m.endswith("+compile"), m.startswith("hf-flattening"))
                    except Exception as e:  # one failing run must not hide the others
                        log(f"  {m:24s} FAILED: {type(e).__name__}: {str(e)[:300]}")
                        continue
                    finally:
                        reset(device)
                    if m == "densebatch":
                        bf16_losses = r.losses
                    if m == "densebatch-fp16" and bf16_losses:
                        diff = max(abs(x - y) for x, y in zip(r.losses, bf16_losses))
                        r.note += f"; losses within {diff:.3g} of bf16's over {min(len(r.losses), len(bf16_losses))} steps"
                    mfu = r.tokens_per_s * fpt / peak if peak else None
                    row = {
                        "model": model, "seq_len": seq_len, "method": m, "tokens_per_s": r.tokens_per_s,
                        "real_per_step": r.real_per_step, "fill": r.fill, "mfu": mfu,
                        "ms_per_step": statistics.mean(r.seconds) * 1e3,
                        "peak_mem_gib": None if math.isnan(r.peak_mem) else r.peak_mem, "note": r.note,
                    }  # fmt: skip
                    table.append(row)
                    out["runs"].append(row)
                    log(
                        f"  {m:24s} {r.tokens_per_s:12,.0f} real tok/s  {r.real_per_step:8,.0f} real/step  fill {r.fill:.2f}  "
                        f"{(f'MFU {mfu:.1%}' if mfu is not None else 'MFU n/a')}  mem {gib(r.peak_mem)} GiB  "
                        f"({time.perf_counter() - t0:.0f} s) {r.note}"
                    )
    log("\n| model | context | run | real tok/s | real tok/step | MFU | peak GiB | vs hf-flattening |")
    log("|---|---|---|---|---|---|---|---|")
    for row in table:
        base = next(
            (x for x in table if (x["model"], x["seq_len"], x["method"]) == (row["model"], row["seq_len"], "hf-flattening")), None
        )
        vs = f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else "-"
        mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "n/a"
        mem = f"{row['peak_mem_gib']:.1f}" if row["peak_mem_gib"] is not None else "-"
        log(
            f"| {row['model']} | {row['seq_len']} | {row['method']} | {row['tokens_per_s']:,.0f} | {row['real_per_step']:,.0f} "
            f"| {mfu} | {mem} | {vs} |"
        )
    if skipped:
        log(f"\nnot run (past --budget-s {a.budget_s:.0f} s): {', '.join(skipped)}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    log(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    return 0 if table else 1


if __name__ == "__main__":
    raise SystemExit(main())

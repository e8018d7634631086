"""GPU throughput and MFU: densebatch ``packed`` vs Hugging Face ``Trainer`` ``group_by_length``, same memory cap.

Called by ``benchmarks/gpu/gpu.sh`` (read that for the one-line usage) as ``python -m benchmarks.gpu.bench``. No downloads: the model is a
GPT-2 124M-shaped config with random weights (12 layers, width 768, 12 heads, vocabulary 50,257,
context 1024, dropout 0), the data are random token documents whose lengths are those of
``oasst-threads.jsonl`` under the GPT-2 BPE (computed from ``../shared/data`` when it is there; else a
lognormal with the same p50 317 / p90 807, clipped to 3,031), truncated to the context like
``prepare`` does, resampled to enough documents for the run; every token carries loss.

Memory cap: ``--slots`` token slots per batch (rows x row length). densebatch packs documents into
``slots / seq_len`` rows of ``seq_len``; Hugging Face pads each batch to its longest document, so the
same cap allows ``slots / seq_len`` rows (a batch of the longest documents must fit too).

Methods (``--methods``):
- ``db_packed``      densebatch packed, reference GPT (``model.kind: gpt``), attention ``auto`` (varlen
  FlashAttention on CUDA when torch has it, else flex, else SDPA with a block mask), bf16 autocast,
  fused AdamW, pinned memory + non-blocking copies (the loader's defaults on CUDA).
- ``db_packed_hf``   densebatch packed, the same GPT-2 as Hugging Face builds it, through ``HFCausalLM``
  (SDPA with a 4-D document mask).
- ``hf_group_by_length``  ``transformers.Trainer``, ``train_sampling_strategy="group_by_length"``, bf16,
  its default fused AdamW, SDPA, right padding.
- ``ceiling``        forward + backward + fused AdamW of the Hugging Face GPT-2 on full rows of real
  tokens (no padding, one causal sequence per row): the ceiling at this cap.

Reported: real (non-padding) tokens per second over the timed steps (after ``--warmup-steps``; CUDA
synchronised at every step end) and MFU = real tokens/s x model FLOPs per token / peak bf16 FLOP/s.
Model FLOPs per token = 6 N (N = parameters without the position table; the tied head counts) +
12 L d l, with l the document's own length (PaLM's formula with document-isolated attention: the
padding and any cross-document attention are not useful work, whoever computes them).

``--smoke``: a tiny config on CPU in fp32 (seconds), proving the whole script end to end.
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

from benchmarks.gpu.runs import Result, gib, run_ceiling, run_densebatch, run_hf
from benchmarks.gpu.workload import make_documents, oasst_lengths

METHODS = ("db_packed", "db_packed_hf", "hf_group_by_length", "ceiling")
LABELS = {
    "db_packed": "densebatch packed (reference GPT)",
    "db_packed_hf": "densebatch packed (HF GPT-2 adapter)",
    "hf_group_by_length": "HF Trainer group_by_length",
    "ceiling": "dense ceiling (HF GPT-2, full rows)",
}
# Dense bf16 peak FLOP/s (no sparsity) by device-name substring; first match wins.
PEAK_BF16 = (
    ("H200", 989e12),
    ("H100", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("L4", 121e12),
    ("4090", 165e12),
)


def log(msg: str) -> None:
    print(msg, flush=True)


# --------------------------------------------------------------------------------------- models
def gpt2_config(a):
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=a.vocab,
        n_positions=a.seq_len,
        n_embd=a.width,
        n_layer=a.layers,
        n_head=a.heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=a.vocab - 1,
        eos_token_id=a.vocab - 1,
    )


def flops_per_token(a, n_params: int, lengths: np.ndarray) -> float:
    ctx = float((lengths.astype(np.float64) ** 2).sum() / lengths.sum())  # token-weighted mean document length
    return 6.0 * n_params + 12.0 * a.layers * a.width * ctx


def peak_flops(device: torch.device, override_tflops: float | None) -> tuple[float | None, str]:
    if override_tflops:
        return override_tflops * 1e12, f"--peak-tflops {override_tflops}"
    if device.type != "cuda":
        return None, "no peak known for CPU"
    name = torch.cuda.get_device_name(device)
    for key, val in PEAK_BF16:
        if key in name:
            return val, f"{name}: {val / 1e12:.0f} TFLOP/s bf16 dense"
    return None, f"{name}: peak unknown (pass --peak-tflops)"


# ---------------------------------------------------------------------------------------- main
def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", "--dry-run", action="store_true", help="tiny config on CPU, fp32: proves the script runs")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--slots", type=int, default=None, help="token slots per batch, the memory cap (default 32768; smoke 1024)")
    ap.add_argument("--seq-len", type=int, default=None, help="packed row length and context (default 1024; smoke 256)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 30; smoke 2)")
    ap.add_argument("--warmup-steps", type=int, default=None, help="untimed first steps (default 5; smoke 1)")
    ap.add_argument("--attention", default="auto", choices=("auto", "varlen", "flex", "masked"))
    ap.add_argument("--precision", default=None, choices=("bf16", "fp32"), help="default bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--compile", action="store_true", help="torch.compile both densebatch and HF")
    ap.add_argument("--peak-tflops", type=float, default=None, help="peak bf16 TFLOP/s when the GPU is not in the table")
    ap.add_argument("--shared-data", default=None, help="folder with oasst-threads.jsonl and gpt2/ (default: ../shared/data)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    tiny = a.smoke
    a.layers, a.width, a.heads, a.vocab = (2, 64, 2, 2048) if tiny else (12, 768, 12, 50257)
    a.slots = a.slots or (1024 if tiny else 32768)
    a.seq_len = a.seq_len or (256 if tiny else 1024)
    a.steps = a.steps or (2 if tiny else 30)
    a.warmup_steps = a.warmup_steps or (1 if tiny else 5)
    if a.slots < a.seq_len:
        ap.error("--slots must hold at least one row of --seq-len")
    a.methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    for m in a.methods:
        if m not in METHODS:
            ap.error(f"unknown method {m!r}; expected some of {', '.join(METHODS)}")
    return a


def main(argv=None) -> int:
    a = parse(argv)
    device = torch.device("cpu" if a.smoke or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not a.smoke:
        log(
            "WARNING: no CUDA device here; running the full-size benchmark on CPU will be very slow. "
            "Use --smoke for an end-to-end check."
        )
    a.precision = a.precision or ("bf16" if device.type == "cuda" else "fp32")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    from densebatch.data.prepare.store import DocumentStore

    lengths, source = oasst_lengths(a.shared_data)
    need = int(1.5 * (a.steps + a.warmup_steps) * a.slots)
    lens, tokens = make_documents(lengths, a.seq_len, a.vocab, need, a.seed)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    mask = np.ones(len(tokens), np.uint8)
    mask[offsets[:-1]] = 0  # a document's first token is never a target
    eos = a.vocab - 1
    meta = {"eos_id": eos, "pad_id": eos, "vocab_size": a.vocab, "mask_id": None, "special_ids": [eos]}
    store = DocumentStore(tokens, offsets, mask, meta)
    try:
        import transformers

        hf_version = transformers.__version__
    except ImportError:
        hf_version = None
    log(
        f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; torch {torch.__version__}; "
        f"transformers {hf_version}; precision {a.precision}; compile {a.compile}"
    )
    log(
        f"model GPT-2 shape: {a.layers} layers, width {a.width}, {a.heads} heads, vocab {a.vocab}, context {a.seq_len}, random init"
    )
    log(
        f"lengths: {source}: p50 {np.percentile(lengths, 50):.0f} p90 {np.percentile(lengths, 90):.0f} max {lengths.max()}; "
        f"{len(lens)} documents resampled, truncated to {a.seq_len}, mean {lens.mean():.0f}"
    )
    log(
        f"memory cap {a.slots} token slots per batch: packed {a.slots // a.seq_len} x {a.seq_len}; HF {a.slots // a.seq_len} rows "
        f"padded to the batch's longest; {a.steps} timed steps after {a.warmup_steps} warm-up"
    )

    tmp = tempfile.TemporaryDirectory()
    model_dir = Path(tmp.name) / "gpt2"
    peak, peak_note = peak_flops(device, a.peak_tflops)
    results: dict[str, Result] = {}
    for m in a.methods:
        if m != "db_packed" and hf_version is None:
            log(f"SKIP {LABELS[m]}: transformers is not installed")
            continue
        if m == "hf_group_by_length":
            try:
                import accelerate  # noqa: F401  (transformers.Trainer needs it)
            except ImportError:
                log(f"SKIP {LABELS[m]}: accelerate is not installed (transformers.Trainer needs it)")
                continue
        if hf_version is not None and not (model_dir / "config.json").is_file():
            gpt2_config(a).save_pretrained(model_dir)
        log(f"running {LABELS[m]} ...")
        t0 = time.perf_counter()
        try:
            if m == "db_packed":
                r = run_densebatch(a, store, device, "gpt", model_dir)
            elif m == "db_packed_hf":
                r = run_densebatch(a, store, device, "hf", model_dir)
            elif m == "hf_group_by_length":
                r = run_hf(a, store, device, model_dir)
            else:
                r = run_ceiling(a, store, device, model_dir)
        except Exception as e:  # report and go on: one failing method must not hide the others
            log(f"FAILED {LABELS[m]}: {type(e).__name__}: {e}")
            continue
        results[m] = r
        log(
            f"  {r.tokens_per_s:,.0f} real tokens/s, fill {r.fill:.2f}, {statistics.mean(r.seconds) * 1e3:.0f} ms/step, "
            f"peak memory {gib(r.peak_mem)} GiB ({time.perf_counter() - t0:.0f} s)"
        )
    from densebatch.model import GPT, GPTConfig

    with torch.device("meta"):
        ref = GPT(GPTConfig(vocab_size=a.vocab, n_layer=a.layers, n_head=a.heads, n_embd=a.width, block_size=a.seq_len))
    n_params = sum(p.numel() for p in ref.parameters()) - ref.wpe.weight.numel()  # tied head counted once
    fpt = flops_per_token(a, n_params, lens)

    log("")
    log(f"model FLOPs per real token {fpt / 1e9:.3f} GFLOP; peak: {peak_note}")
    log(f"{'method':40s} {'real tok/s':>12s} {'fill':>5s} {'ms/step':>8s} {'MFU':>6s} {'vs ceiling':>10s} {'mem GiB':>8s}")
    ceil = results.get("ceiling")
    out = {
        "device": str(device),
        "precision": a.precision,
        "lengths": source,
        "slots": a.slots,
        "seq_len": a.seq_len,
        "flops_per_token": fpt,
        "peak_flops": peak,
        "methods": {},
    }
    for m, r in results.items():
        mfu = r.tokens_per_s * fpt / peak if peak else None
        vs = r.tokens_per_s / ceil.tokens_per_s if ceil else None
        log(
            f"{LABELS[m]:40s} {r.tokens_per_s:12,.0f} {r.fill:5.2f} {statistics.mean(r.seconds) * 1e3:8.0f} "
            f"{(f'{mfu:6.1%}' if mfu is not None else '   n/a')} {(f'{vs:10.2f}' if vs else '         -')} {gib(r.peak_mem):>8s}"
        )
        out["methods"][m] = {
            "tokens_per_s": r.tokens_per_s,
            "fill": r.fill,
            "mfu": mfu,
            "vs_ceiling": vs,
            "ms_per_step": statistics.mean(r.seconds) * 1e3,
            "peak_mem_gib": None if math.isnan(r.peak_mem) else r.peak_mem,
        }
    if "db_packed" in results and "hf_group_by_length" in results:
        ratio = results["db_packed"].tokens_per_s / results["hf_group_by_length"].tokens_per_s
        log(f"densebatch packed / HF group_by_length = {ratio:.2f}")
        out["db_packed/hf_group_by_length"] = ratio
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    tmp.cleanup()
    missing = [m for m in a.methods if m not in results]
    if missing:
        log(f"not measured: {', '.join(missing)}")
    return 1 if not results else 0


if __name__ == "__main__":
    raise SystemExit(main())

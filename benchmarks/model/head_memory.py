"""Peak memory of one training step with the fused (chunked) loss head and with the plain one.

Each measurement runs in a fresh Python process: build the model (4 layers x 256, vocabulary
50,257: the Hugging Face GPT-2 config of the throughput benchmark, or the reference GPT of the same
shape), take one small step so that AdamW's state exists, read the resident set size (RSS), then run
one full step (forward, backward, clip, AdamW) on ``rows x T`` tokens that all carry loss, and read
the process's peak RSS (``ru_maxrss``). The figure is peak - before: what the step itself added,
activations and logits included, as the operating system saw it (allocator caching included).

    .venv/bin/python -m benchmarks.model.head_memory                   # both heads, both models, 2 sizes
    .venv/bin/python -m benchmarks.model.head_memory --tokens 2x719 --models hf
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import REPO, write_gpt2_config


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def one_step(kind: str, head: str, rows: int, T: int) -> dict:
    import torch

    from densebatch.batch import IGNORE_INDEX, Batch
    from densebatch.config import TrainConfig
    from densebatch.train.optim import build_optimizer

    torch.manual_seed(0)
    if kind == "hf":
        from densebatch.model.hf.adapter import HFCausalLM

        d = tempfile.mkdtemp()
        write_gpt2_config(Path(d), n_positions=1024)
        model = HFCausalLM(d, loss_head=head)
    else:
        from densebatch.model import GPT, GPTConfig

        model = GPT(GPTConfig(vocab_size=50257, n_layer=4, n_head=4, n_embd=256, block_size=1024, loss_head=head))
    opt = build_optimizer(model, TrainConfig())

    def step(r: int, t: int) -> None:
        ids = torch.randint(0, 50257, (r, t))
        labels = torch.roll(ids, -1, 1)
        labels[:, -1] = IGNORE_INDEX
        pos = torch.arange(t).expand(r, t)
        batch = Batch(ids, labels, pos, int((labels != IGNORE_INDEX).sum()), r * t, single_doc_rows=True, max_position=t - 1)
        losses = model.token_losses(batch)
        (losses.sum() / batch.num_loss_tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(1, 8)  # optimizer state, lazy initialisations
    before = rss_mb()
    step(rows, T)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"model": kind, "head": head, "tokens": f"{rows}x{T}", "before_mb": before, "peak_mb": peak, "step_mb": peak - before}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="2x719,4x1024", help="comma list of ROWSxT batches")
    ap.add_argument("--models", default="hf,gpt")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        kind, head, rows, T = args.child.split(":")
        print(json.dumps(one_step(kind, head, int(rows), int(T))))
        return 0
    print("| model | rows x T | plain head: step peak RSS (MiB) | fused head | fused / plain | full logits (fp32, MiB) |")
    print("|---|---|---|---|---|---|")
    for kind in args.models.split(","):
        for shape in args.tokens.split(","):
            rows, T = (int(x) for x in shape.split("x"))
            got = {}
            for head in ("plain", "fused"):
                # a fresh process per cell (this module again): its peak RSS is this step's alone
                cmd = [sys.executable, "-m", __spec__.name, "--child", f"{kind}:{head}:{rows}:{T}"]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO)
                got[head] = json.loads(out.stdout.strip().splitlines()[-1])["step_mb"]
            logits = rows * T * 50257 * 4 / 2**20
            print(
                f"| {kind} | {rows} x {T} | {got['plain']:.0f} | {got['fused']:.0f} | {got['fused'] / got['plain']:.2f} | {logits:.0f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Speed of the loss head alone: the fused chunked head at several chunk sizes against the plain one.

One forward + backward of ``head_token_losses`` (fused, ``chunk_tokens`` positions at a time) and of
``plain_head_token_losses`` (all logits at once) on ``N`` positions that all carry a target, through
a 50,257 x 256 head (the GPT-2 vocabulary at the throughput benchmark's width). The variants take
turns within each repeat (so they share the machine's load); the first round is a warm-up; medians
of process CPU seconds (all threads) and wall seconds.

    .venv/bin/python -m benchmarks.model.head_speed --tokens 1866 --chunks plain,163,652,1304
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from densebatch.model.loss_head import chunk_tokens_for, head_token_losses, plain_head_token_losses


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1866, help="positions with a target")
    ap.add_argument("--chunks", default="plain,163,652,1304", help="comma list: plain, or chunk sizes in positions")
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    V, C, N = args.vocab, args.width, args.tokens
    head = torch.nn.Linear(C, V, bias=False)
    h0 = torch.randn(1, N, C)  # (1, N, C)
    labels = torch.randint(0, V, (1, N))  # (1, N)

    def run(kind: str) -> None:
        h = h0.clone().requires_grad_(True)
        head.weight.grad = None
        if kind == "plain":
            losses = plain_head_token_losses(h, labels, head)
        else:
            losses = head_token_losses(h, labels, head.weight, None, N, chunk_tokens=int(kind))
        (losses.sum() / N).backward()

    kinds = [k.strip() for k in args.chunks.split(",")]
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
    for i in range(args.repeats + 1):
        for k in kinds:
            c, w = time.process_time(), time.perf_counter()
            run(k)
            if i:
                times[k].append((time.process_time() - c, time.perf_counter() - w))
    print(f"{N} positions, vocabulary {V}, width {C}, {torch.get_num_threads()} threads; default chunk {chunk_tokens_for(V)}")
    base = statistics.median(c for c, _ in times["plain"]) if "plain" in times else None
    print("| head | CPU s | wall s | CPU / plain |\n|---|---|---|---|")
    for k, ts in times.items():
        cpu, wall = statistics.median(c for c, _ in ts), statistics.median(w for _, w in ts)
        rel = f"{cpu / base:.2f}" if base else "-"
        print(f"| {'plain' if k == 'plain' else f'fused, chunk {k}'} | {cpu:.3f} | {wall:.3f} | {rel} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

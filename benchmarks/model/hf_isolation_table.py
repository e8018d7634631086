"""Packed-document isolation per Hugging Face architecture: the table in docs/hf-models.md.

For each tiny random config of ``densebatch.testing.models`` (width 32, 1-2 layers, sliding windows of 6
tokens where the architecture has them, fp32, CPU), three rows of packed documents (lengths 1 to 20)
go through ``HFCausalLM`` with its 4-D document mask; each document then goes alone through a row
of its own (no mask). Printed: the largest |difference| of logits and of per-token losses, or the
refusal (a ``ConfigError``) for architectures that cannot be isolated. Deterministic (seed 0).

    .venv/bin/python -m benchmarks.model.hf_isolation_table
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import transformers

from densebatch.errors import ConfigError
from densebatch.model.hf import HFCausalLM
from densebatch.testing.batches import random_docs
from densebatch.testing.models import ARCHITECTURES, LENGTHS, VOCAB, packed_vs_alone, write_config_dir


def main() -> None:
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, CPU, fp32\n")
    print("| architecture | attn_implementation | packed vs alone: max abs logit diff | max abs loss diff |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as root:
        for kind, impl in ARCHITECTURES:
            path = write_config_dir(Path(root), kind)
            torch.manual_seed(0)
            try:
                model = HFCausalLM(path, attn_implementation=impl).eval()
            except ConfigError as e:
                print(f"| {kind} | {impl} | refused: {e} | |")
                continue
            docs = [random_docs(torch.Generator().manual_seed(0), row, VOCAB) for row in LENGTHS]
            loss_diff, logit_diff = packed_vs_alone(model, docs)
            print(f"| {kind} | {impl} | {logit_diff:.1e} | {loss_diff:.1e} |")


if __name__ == "__main__":
    main()

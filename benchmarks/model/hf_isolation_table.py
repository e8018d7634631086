"""Packed-document isolation per Hugging Face architecture: the table in docs/hf-models.md.

For each tiny random config of ``densebatch.testing.models`` (width 32, 1-2 layers, sliding windows of 6
tokens where the architecture has them, fp32, CPU), three rows of packed documents (lengths 1 to 20)
go through ``HFCausalLM``: under ``attn_implementation: densebatch`` (documents one by one through
transformers' attention interface; the segmented backend, the one long rows use on CPU), and under
transformers' own kernel with the 4-D document mask. Each document then goes alone through a row of
its own under transformers' own kernel, no mask (the reference shares no code with densebatch's
attention). Printed: the largest |difference| of logits and of per-token losses, or the refusal (a
``ConfigError``). Deterministic (seed 0).

    .venv/bin/python -m benchmarks.model.hf_isolation_table
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import transformers

from densebatch.errors import ConfigError
from densebatch.model.hf.adapter import HFCausalLM
from densebatch.testing.batches import random_docs
from densebatch.testing.models import ARCHITECTURES, LENGTHS, VOCAB, packed_vs_alone, write_config_dir


def measure(path: Path, kind: str, impl: str, own: str, attention: str = "auto") -> str:
    torch.manual_seed(0)
    try:
        model = HFCausalLM(path, attn_implementation=impl, attention=attention).eval()
    except ConfigError as e:
        return f"refused: {e} | "
    reference = HFCausalLM(path, attn_implementation=own).eval()
    reference.load_state_dict(model.state_dict())
    docs = [random_docs(torch.Generator().manual_seed(0), row, VOCAB) for row in LENGTHS]
    loss_diff, logit_diff = packed_vs_alone(model, docs, reference)
    return f"{logit_diff:.1e} | {loss_diff:.1e}"


def main() -> None:
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, CPU, fp32\n")
    print("packed vs alone, max abs difference of logits | of per-token losses:\n")
    print("| architecture | densebatch (segmented): logits | losses | transformers' kernel + 4-D mask | logits | losses |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as root:
        for kind, own in ARCHITECTURES:
            path = write_config_dir(Path(root), kind)
            ours = measure(path, kind, "densebatch", own, "segmented")
            theirs = measure(path, kind, own, own)
            print(f"| {kind} | {ours} | {own} | {theirs} |")


if __name__ == "__main__":
    main()

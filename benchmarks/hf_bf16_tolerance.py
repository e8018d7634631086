"""How far bf16 autocast moves an HF model's per-token losses from fp32: the bound tests/model/test_hf.py uses.

The models and batch of ``test_token_losses_float32_under_autocast`` (tiny random Llama and GPT-2,
vocabulary 300, three packed rows), over 20 seeds of weights and documents; prints the largest
|bf16 - fp32| per-token loss difference per architecture (deterministic).

    .venv/bin/python benchmarks/hf_bf16_tolerance.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "model"))
import test_hf  # noqa: E402
from conftest import pack, random_docs  # noqa: E402


def main(seeds: int = 20) -> None:
    with tempfile.TemporaryDirectory() as root:
        for kind in ("llama", "gpt2"):
            test_hf.tiny_config(kind).save_pretrained(Path(root) / kind)
            worst, loss = 0.0, 0.0
            for seed in range(seeds):
                torch.manual_seed(seed)
                model = test_hf.HFCausalLM(Path(root) / kind).eval()
                gen = torch.Generator().manual_seed(seed)
                batch = pack([random_docs(gen, row, test_hf.V) for row in test_hf.LENGTHS], seq_len=24)
                with torch.no_grad():
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        low = model.token_losses(batch)
                    ref = model.token_losses(batch)
                worst, loss = max(worst, (low - ref).abs().max().item()), ref[batch.labels != -100].mean().item()
            print(f"{kind}: max |bf16 - fp32| per-token loss over {seeds} seeds {worst:.2e} (losses near {loss:.2f})")


if __name__ == "__main__":
    main()

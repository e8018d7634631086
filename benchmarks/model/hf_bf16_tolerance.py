"""How far bf16 autocast moves an HF model's per-token losses from fp32: the bound tests/model/hf/test_hf.py uses.

The models and batch of ``test_token_losses_float32_under_autocast`` (``densebatch.testing.models.two_layer_config``:
tiny random Llama and GPT-2, vocabulary 300; three packed rows of ``PACKED_LENGTHS``), over 20 seeds
of weights and documents; prints the largest |bf16 - fp32| per-token loss difference per architecture
(deterministic).

    .venv/bin/python -m benchmarks.model.hf_bf16_tolerance
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from densebatch.model.hf.adapter import HFCausalLM
from densebatch.testing.batches import PACKED_LENGTHS, pack, random_docs
from densebatch.testing.models import TWO_LAYER_VOCAB, two_layer_config


def main(seeds: int = 20) -> None:
    with tempfile.TemporaryDirectory() as root:
        for kind in ("llama", "gpt2"):
            two_layer_config(kind).save_pretrained(Path(root) / kind)
            worst, loss = 0.0, 0.0
            for seed in range(seeds):
                torch.manual_seed(seed)
                model = HFCausalLM(Path(root) / kind).eval()
                gen = torch.Generator().manual_seed(seed)
                batch = pack([random_docs(gen, row, TWO_LAYER_VOCAB) for row in PACKED_LENGTHS], seq_len=24)
                with torch.no_grad():
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        low = model.token_losses(batch)
                    ref = model.token_losses(batch)
                worst, loss = max(worst, (low - ref).abs().max().item()), ref[batch.labels != -100].mean().item()
            print(f"{kind}: max |bf16 - fp32| per-token loss over {seeds} seeds {worst:.2e} (losses near {loss:.2f})")


if __name__ == "__main__":
    main()

"""What the Hugging Face Trainer benchmarks share: the model they train (saved once) and a callback that times each optimizer step."""

from __future__ import annotations

import time
from pathlib import Path


def save_llama(path: Path) -> None:
    """A 2-layer Llama shape with GPT-2's vocabulary of 50,257 (untied head, random weights, seed 0), saved at ``path``."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=50257, hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=50256,
        eos_token_id=50256, pad_token_id=50256,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)


def step_clock(times: list[float], cpu: list[float] | None = None):
    """A ``TrainerCallback`` appending each optimizer step's wall seconds (step begin to step end) to ``times``
    and, when given, the process's CPU seconds to ``cpu``."""
    import transformers

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)
            if cpu is not None:
                cpu.append(time.process_time() - self.c0)

    return Clock()

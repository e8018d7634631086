"""Configuration section of the model: the reference GPT or a Hugging Face causal LM (or encoder masked LM), and LoRA."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from densebatch.config.field import _f


@dataclass
class LoraConfig:
    """LoRA adapters for model.kind hf (through peft: pip install 'densebatch[lora]'); only they train."""

    r: int = _f(0, "Rank of the adapters; 0 = off (every weight trains).", minimum=0)
    alpha: float = _f(16.0, "Scale of the adapters' update: alpha / r x B A.", minimum=0.0)
    dropout: float = _f(0.0, "Dropout on the adapters' input, in [0, 1).", minimum=0.0)
    target_modules: list[str] = _f(
        list,
        "Modules to adapt, by name (e.g. q_proj,v_proj), or all-linear; empty = the architecture's attention "
        "projections (peft's default). See docs/hf-models.md.",
    )


@dataclass
class ModelConfig:
    kind: Literal["gpt", "hf"] = _f(
        "gpt", "gpt: the reference decoder; hf: a Hugging Face causal LM (an encoder masked LM with batching.mode mlm)."
    )
    path: str | None = _f(
        None,
        "hf: a local directory with config.json (weights optional: random init when absent); gpt: a saved reference "
        "GPT (a run's final/) to train on from its weights (with its tokenizer: data.tokenizer set to the same directory).",
    )
    n_layer: int = _f(4, "gpt: transformer blocks.", minimum=1)
    n_head: int = _f(4, "gpt: attention heads.", minimum=1)
    n_embd: int = _f(128, "gpt: width.", minimum=1)
    block_size: int = _f(1024, "gpt: context length (largest position + 1).", minimum=2)
    dropout: float = _f(0.0, "gpt: dropout probability, in [0, 1).", minimum=0.0)
    vocab_size: int | None = _f(None, "gpt: vocabulary size; none = the tokenizer's.")
    attention: Literal["auto", "flex", "varlen", "segmented", "masked"] = _f(
        "auto",
        "Document-isolating attention: auto (fastest that isolates here), flex, varlen, segmented (length-bucketed "
        "causal SDPA per document, any device), masked (SDPA with a block mask).",
    )
    gradient_checkpointing: bool = _f(False, "Recompute activations in backward to save memory.")
    attn_implementation: Literal["densebatch", "sdpa", "eager"] = _f(
        "densebatch",
        "hf: densebatch (documents attended one by one through transformers' attention interface, model.attention "
        "picks the kernel: no T x T mask, memory and time grow with the documents), or transformers' own sdpa / eager "
        "kernels given a 4-D document mask. See docs/hf-models.md.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = _f(
        "float32",
        "hf: dtype the weights are loaded and trained in (the optimizer's master weights too): bfloat16 halves "
        "their memory, but updates below its precision are lost (best with LoRA); float16 only with LoRA.",
    )
    lora: LoraConfig = _f(LoraConfig, "hf: LoRA adapters (off while r is 0).")

"""Export the reference GPT as a Hugging Face GPT-2 model that ``AutoModelForCausalLM.from_pretrained`` loads.

The reference GPT is GPT-2's architecture (learned positions, pre-LN blocks, tanh-approximated GELU =
``gelu_new``, LayerNorm eps 1e-5, tied head), so its weights map one to one::

    wte / wpe / ln_f                  transformer.wte / .wpe / .ln_f
    blocks.i.ln1 / ln2                transformer.h.i.ln_1 / ln_2
    blocks.i.attn.qkv / proj          transformer.h.i.attn.c_attn / c_proj     (q, k, v in the same order)
    blocks.i.mlp.fc / proj            transformer.h.i.mlp.c_fc / c_proj

Hugging Face's GPT-2 uses ``Conv1D`` (weight stored as ``(in, out)``), the transpose of ``nn.Linear``.
Logits of the exported model equal the GPT's (tested to 1e-5) for one document per row; a packed
row needs the document mask densebatch passes (see ``model/hf/adapter.py``), as any Hugging Face model does.
"""

from __future__ import annotations

from pathlib import Path

import torch

from densebatch.errors import ConfigError
from densebatch.model.quiet import quiet_progress


def gpt2_state_dict(gpt) -> dict[str, torch.Tensor]:
    """The reference GPT's weights under Hugging Face ``GPT2LMHeadModel`` names (Conv1D layout)."""
    sd = {k: v.detach().cpu() for k, v in gpt.state_dict().items()}
    out = {
        "transformer.wte.weight": sd["wte.weight"],
        "transformer.wpe.weight": sd["wpe.weight"],
        "transformer.ln_f.weight": sd["ln_f.weight"],
        "transformer.ln_f.bias": sd["ln_f.bias"],
        "lm_head.weight": sd["lm_head.weight"],
    }
    names = {"ln1": "ln_1", "ln2": "ln_2", "attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj", "mlp.fc": "mlp.c_fc",
             "mlp.proj": "mlp.c_proj"}  # fmt: skip
    for i in range(gpt.cfg.n_layer):
        for ours, theirs in names.items():
            w, b = sd[f"blocks.{i}.{ours}.weight"], sd[f"blocks.{i}.{ours}.bias"]
            conv = not ours.startswith("ln")  # nn.Linear (out, in) -> Conv1D (in, out)
            out[f"transformer.h.{i}.{theirs}.weight"] = w.t().contiguous() if conv else w
            out[f"transformer.h.{i}.{theirs}.bias"] = b
    return out


def export_gpt_as_hf(gpt, out_dir: str | Path, eos_id: int | None = None, pad_id: int | None = None) -> Path:
    """Write ``gpt`` (a ``model.gpt.GPT``) to ``out_dir`` as a Hugging Face GPT-2 model (safetensors)."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        raise ConfigError("densebatch export needs transformers: pip install 'densebatch[hf]'") from None
    c = gpt.cfg
    config = GPT2Config(
        vocab_size=c.vocab_size,
        n_positions=c.block_size,
        n_embd=c.n_embd,
        n_layer=c.n_layer,
        n_head=c.n_head,
        n_inner=4 * c.n_embd,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    hf = GPT2LMHeadModel(config)
    missing, unexpected = hf.load_state_dict(gpt2_state_dict(gpt), strict=False)
    # attn.bias / masked_bias are causal-mask buffers some versions keep; nothing else may be missing
    missing = [k for k in missing if not k.endswith((".attn.bias", ".attn.masked_bias"))]
    if missing or unexpected:
        raise AssertionError(f"GPT-2 export mapping is incomplete: missing {missing[:4]}, unexpected {unexpected[:4]}")
    hf.tie_weights()
    out_dir = Path(out_dir)
    with quiet_progress():
        hf.save_pretrained(out_dir)
    return out_dir

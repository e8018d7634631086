"""The models name their output embedding matrix, so the optimizer never decays it (unless decay_all).

An untied ``lm_head`` holds one vector per token, like the input embeddings: weight decay would
pull rarely seen tokens towards zero. It stays in the ``head`` group for its learning rate.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from densebatch.config import OptimizerConfig, TrainConfig
from densebatch.model import GPT, GPTConfig
from densebatch.train.optim import param_groups


def groups_of(model, decay_all: bool = False) -> dict[int, str]:
    cfg = TrainConfig(optimizer=OptimizerConfig(weight_decay=0.1, decay_all=decay_all))
    return {id(p): g["name"] for g in param_groups(model, cfg) for p in g["params"]}


def test_untied_gpt_head_is_not_decayed():
    model = GPT(GPTConfig(vocab_size=50, n_layer=1, n_head=2, n_embd=16, block_size=16))
    model.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone())  # untie
    names = groups_of(model)
    assert names[id(model.lm_head.weight)] == "head.no_decay"
    assert names[id(model.blocks[0].mlp.fc.weight)] == "blocks.decay"
    assert groups_of(model, decay_all=True)[id(model.lm_head.weight)] == "head.decay"


def test_tied_gpt_head_is_the_undecayed_embedding():
    model = GPT(GPTConfig(vocab_size=50, n_layer=1, n_head=2, n_embd=16, block_size=16))
    assert groups_of(model)[id(model.lm_head.weight)] == "embeddings.no_decay"


def test_untied_hf_lm_head_is_not_decayed(tmp_path):
    transformers = pytest.importorskip("transformers")
    from densebatch.model.hf.adapter import HFCausalLM

    transformers.LlamaConfig(
        vocab_size=50,
        num_hidden_layers=1,
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
        tie_word_embeddings=False,
    ).save_pretrained(tmp_path)
    torch.manual_seed(0)
    model = HFCausalLM(tmp_path)
    head = model.hf.get_output_embeddings().weight
    assert head is not model.hf.get_input_embeddings().weight
    names = groups_of(model)
    assert names[id(head)] == "head.no_decay"
    assert groups_of(model, decay_all=True)[id(head)] == "head.decay"
    assert any(n == "blocks.decay" for n in names.values())

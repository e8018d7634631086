"""model.path with the reference GPT: a run starts from a saved GPT's weights (an SFT run's final/, before dpo),
its shape the saved one, a differing shape key or a larger tokenizer refused in one line naming the key."""

from __future__ import annotations

import pytest
import torch

from densebatch.config import ModelConfig
from densebatch.errors import ConfigError
from densebatch.model import build_model
from densebatch.testing.models import tiny_gpt


def test_a_saved_gpt_is_built_with_its_weights_and_the_runs_settings(tmp_path):
    saved = tiny_gpt(50)
    saved.save(tmp_path / "final")
    cfg = ModelConfig(kind="gpt", path=str(tmp_path / "final"), n_layer=2, n_head=4, n_embd=32, block_size=64, attention="masked")
    model = build_model(cfg, vocab_size=50)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), saved.state_dict().values()))
    assert model.cfg.attention == "masked"
    with pytest.raises(ConfigError, match="model.n_layer: 4, but the GPT at"):
        build_model(ModelConfig(kind="gpt", path=str(tmp_path / "final")), vocab_size=50)
    with pytest.raises(ConfigError, match="data.tokenizer: 60 ids"):
        build_model(cfg, vocab_size=60)

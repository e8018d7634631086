"""Vocabulary extension in the models: tables grow to the tokenizer's size, added tokens' rows start at the mean.

``build_model(cfg, vocab_size, base_vocab_size)`` for a tokenizer with tokens added past
``base_vocab_size``: a Hugging Face model's input and output embeddings (tied or not, and an output
bias) get rows ``base..vocab`` equal to the mean of the rows before them, every other row untouched;
``config.vocab_size`` follows, so ``save_pretrained`` / ``from_pretrained`` agree with the tokenizer.
The reference GPT is built at random for the whole vocabulary (no trained rows to average).
"""

from __future__ import annotations

import pytest
import torch

from densebatch.config import ModelConfig
from densebatch.errors import ConfigError
from densebatch.model import GPT, build_model, load_model
from densebatch.testing.batches import pack, random_docs
from densebatch.testing.models import VOCAB, tiny_config

transformers = pytest.importorskip("transformers")
from densebatch.model.hf.adapter import HFCausalLM, input_embedding_weight  # noqa: E402

ADDED = 3
# (name, model_type, config overrides): a tied head, an untied head, an untied head with a bias.
HEADS = [("tied", "gpt2", {}), ("untied", "llama", {"tie_word_embeddings": False}), ("biased", "phi", {})]


def base_dir(root, model_type: str, **overrides):
    """A saved tiny model with weights (so its rows are the 'trained' ones a resize must keep)."""
    if model_type == "phi":  # Phi-1/2: untied lm_head with a bias
        config = transformers.PhiConfig(
            num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=4, vocab_size=VOCAB
        )
    else:
        config = tiny_config(model_type, **overrides)
    torch.manual_seed(0)
    out = root / model_type
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


def tables(model: HFCausalLM) -> list[torch.Tensor]:
    lm = model.lm
    out = [input_embedding_weight(lm)]
    head = lm.get_output_embeddings()
    if head.weight is not out[0]:
        out.append(head.weight)
    if getattr(head, "bias", None) is not None:
        out.append(head.bias)
    return out


@pytest.mark.parametrize(("name", "kind", "overrides"), HEADS, ids=[h[0] for h in HEADS])
def test_added_rows_are_the_mean_of_the_base_rows(tmp_path, name, kind, overrides):
    path = base_dir(tmp_path, kind, **overrides)
    before = [t.detach().clone() for t in tables(HFCausalLM(path))]
    model = build_model(ModelConfig(kind="hf", path=str(path)), vocab_size=VOCAB + ADDED, base_vocab_size=VOCAB)
    after = tables(model)
    assert model.vocab_size == model.lm.config.vocab_size == VOCAB + ADDED
    assert len(after) == {"tied": 1, "untied": 2, "biased": 3}[name]
    for old, new in zip(before, after):
        assert new.shape[0] == VOCAB + ADDED
        assert torch.equal(new[:VOCAB], old)  # the trained rows are kept
        for i in range(VOCAB, VOCAB + ADDED):
            assert torch.allclose(new[i], old.mean(0), atol=1e-7)
    if name == "tied":
        assert model.lm.get_output_embeddings().weight is model.lm.get_input_embeddings().weight


def test_a_table_padded_past_the_tokenizer_keeps_its_size(tmp_path):
    """Qwen-style: the model has more rows than its tokenizer; the added ids reuse untrained rows, set to
    the mean of the tokenizer's rows (not of the padding)."""
    path = base_dir(tmp_path, "llama", tie_word_embeddings=False)
    base = VOCAB - 10  # the tokenizer knew only the first 90 rows
    before = tables(HFCausalLM(path))[0].detach().clone()
    model = build_model(ModelConfig(kind="hf", path=str(path)), vocab_size=base + ADDED, base_vocab_size=base)
    emb = tables(model)[0]
    assert model.vocab_size == VOCAB
    assert torch.equal(emb[:base], before[:base]) and torch.equal(emb[base + ADDED :], before[base + ADDED :])
    assert torch.allclose(emb[base : base + ADDED], before[:base].mean(0).expand(ADDED, -1), atol=1e-7)


def test_new_tokens_start_with_an_average_logit(tmp_path, gen):
    """Why the mean: a new token's logit starts at the mean logit, so the loss does not jump when it appears."""
    path = base_dir(tmp_path, "llama", tie_word_embeddings=False)
    model = build_model(ModelConfig(kind="hf", path=str(path)), vocab_size=VOCAB + ADDED, base_vocab_size=VOCAB).eval()
    batch = pack([random_docs(gen, [12], VOCAB)])
    with torch.no_grad():
        logits = model(batch.input_ids, batch.positions)[0]  # (T, vocab)
    new = logits[:, VOCAB:]  # (T, ADDED)
    assert torch.allclose(new, logits[:, :VOCAB].mean(1, keepdim=True).expand_as(new), atol=1e-5)


def test_saved_grown_model_loads_with_from_pretrained(tmp_path, gen):
    path = base_dir(tmp_path, "llama", tie_word_embeddings=False)
    model = build_model(ModelConfig(kind="hf", path=str(path)), vocab_size=VOCAB + ADDED, base_vocab_size=VOCAB).eval()
    model.save(tmp_path / "saved")
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    assert plain.config.vocab_size == plain.get_input_embeddings().weight.shape[0] == VOCAB + ADDED
    ids = torch.tensor([[1, 5, VOCAB, 7, VOCAB + 2]])  # added ids included
    with torch.no_grad():
        assert torch.allclose(plain(input_ids=ids).logits, model(ids, torch.arange(5)[None]), atol=1e-6)
        again = load_model(tmp_path / "saved").eval()
        assert torch.equal(again(ids, torch.arange(5)[None]), model(ids, torch.arange(5)[None]))


def test_no_base_rows_to_average_is_refused(tmp_path):
    path = base_dir(tmp_path, "gpt2")
    with pytest.raises(ConfigError, match="no base vocabulary"):
        build_model(ModelConfig(kind="hf", path=str(path)), vocab_size=VOCAB + ADDED, base_vocab_size=0)


def test_reference_gpt_is_built_for_the_whole_vocabulary():
    cfg = ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=32)
    model = build_model(cfg, vocab_size=VOCAB + ADDED, base_vocab_size=VOCAB)
    assert isinstance(model, GPT) and model.wte.weight.shape[0] == model.lm_head.weight.shape[0] == VOCAB + ADDED
    with pytest.raises(ConfigError, match="model.vocab_size: expected at least the tokenizer's 103 ids"):
        build_model(
            ModelConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=VOCAB), vocab_size=VOCAB + ADDED, base_vocab_size=VOCAB
        )

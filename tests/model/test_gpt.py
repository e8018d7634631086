"""The reference GPT: packed documents see only themselves, on every backend that runs here."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from densebatch.config import ModelConfig
from densebatch.errors import ConfigError
from densebatch.model import GPT, GPTConfig, build_model, load_model
from densebatch.testing.batches import PACKED_LENGTHS, pack, random_docs
from densebatch.testing.models import tiny_gpt

V = 97
LENGTHS = PACKED_LENGTHS  # rows of documents; one of length 1 (no target)


def tiny(attention: str = "masked", **kw) -> GPT:
    return tiny_gpt(V, attention=attention, **kw).eval()


def alone_vs_packed(model, docs_by_row, seq_len=24):
    packed = pack(docs_by_row, seq_len=seq_len)
    got = model.token_losses(packed)
    worst = 0.0
    for r, docs in enumerate(docs_by_row):
        t = 0
        for d in docs:
            alone = model.token_losses(pack([[d]]))[0]
            worst = max(worst, (got[r, t : t + len(d)] - alone).abs().max().item())
            t += len(d)
    return worst


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("backend", ["masked", "segmented", "auto", "flex"])
def test_packed_equals_alone(backend, gen):
    docs = [random_docs(gen, row, V) for row in LENGTHS]
    model = tiny(backend)
    # flex runs forward-only on CPU (no backward in torch 2.13): test it under no_grad.
    ctx = torch.no_grad() if backend == "flex" else torch.enable_grad()
    with ctx:
        assert alone_vs_packed(model, docs) <= 1e-5


def test_auto_on_long_rows_is_segmented_and_exact(gen):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=V, n_layer=2, n_head=4, n_embd=32, block_size=300)).eval()
    assert model.attention_backend(torch.device("cpu"), 300) == "segmented"
    docs = [random_docs(gen, row, V) for row in [[90, 120, 40], [250], [7, 200, 1, 60]]]
    assert alone_vs_packed(model, docs, seq_len=300) <= 1e-5


def grads_of(model, batch):
    model.zero_grad(set_to_none=True)
    model.token_losses(batch).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_segmented_gradients_equal_masked(gen):
    batch = pack([random_docs(gen, row, V) for row in LENGTHS], seq_len=30)
    want = grads_of(tiny("masked").train(), batch)
    got = grads_of(tiny("segmented").train(), batch)
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= 1e-5


def test_segmented_with_gradient_checkpointing(gen):
    batch = pack([random_docs(gen, row, V) for row in LENGTHS])
    want = grads_of(tiny("segmented").train(), batch)
    got = grads_of(tiny("segmented", gradient_checkpointing=True).train(), batch)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)


def test_segmented_under_bf16_autocast_trains(gen):
    batch = pack([random_docs(gen, row, V) for row in LENGTHS])
    model = tiny("segmented").train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.token_losses(batch)
    assert out.dtype == torch.float32
    assert torch.allclose(out, model.token_losses(batch), atol=5e-3)  # measured <= 1.5e-3 over 20 seeds
    out.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_negative_control_plain_causal_leaks(gen):
    docs = [random_docs(gen, row, V) for row in LENGTHS]
    model = tiny()
    packed = dataclasses.replace(pack(docs, seq_len=24), single_doc_rows=True)  # a wrong claim: is_causal
    alone = model.token_losses(pack([[docs[0][0]]]))[0]
    assert (model.token_losses(packed)[0, 7:19] - model.token_losses(pack([[docs[0][1]]]))[0]).abs().max() > 1e-3
    assert torch.allclose(model.token_losses(packed)[0, :7], alone, atol=1e-6)  # the first document is unaffected


def test_single_document_rows_take_the_causal_path_exactly(gen):
    docs = [[d] for d in random_docs(gen, [5, 17, 11], V)]
    model = tiny()
    batch = pack(docs, seq_len=20)
    assert batch.single_doc_rows is None  # unknown: the model works it out
    fast = model.token_losses(dataclasses.replace(batch, single_doc_rows=True))
    assert torch.allclose(fast, model.token_losses(dataclasses.replace(batch, single_doc_rows=False)), atol=1e-6)
    assert torch.allclose(fast, model.token_losses(batch), atol=1e-6)


def test_padding_never_changes_real_losses(gen):
    docs = [random_docs(gen, row, V) for row in LENGTHS]
    model = tiny()
    short = model.token_losses(pack(docs))  # T = longest row
    long = model.token_losses(pack(docs, seq_len=40))
    T = short.shape[1]
    assert torch.allclose(short, long[:, :T], atol=1e-6)
    assert long[:, T:].abs().max() == 0  # padding carries no loss
    assert (short[pack(docs).labels == -100] == 0).all()


def test_token_losses_are_float32_under_autocast(gen):
    docs = [random_docs(gen, row, V) for row in LENGTHS]
    model = tiny()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.token_losses(pack(docs))
    assert out.dtype == torch.float32
    assert torch.allclose(out, model.token_losses(pack(docs)), atol=5e-3)  # measured <= 1.5e-3 over 20 seeds


def test_layer_groups_cover_every_parameter_once():
    model = tiny()
    groups = model.layer_groups()
    ids = [id(p) for ps in groups.values() for p in ps]
    assert len(ids) == len(set(ids))
    assert set(ids) == {id(p) for p in model.parameters()}
    assert {id(model.wte.weight), id(model.wpe.weight)} == {id(p) for p in groups["embeddings"]}
    assert model.lm_head.weight is model.wte.weight  # tied


def test_gradient_checkpointing_same_gradients(gen):
    batch = pack([random_docs(gen, row, V) for row in LENGTHS])
    grads = []
    for ckpt in (False, True):
        model = tiny(gradient_checkpointing=ckpt).train()
        model.token_losses(batch).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)


def test_save_load_round_trip(tmp_path, gen):
    model = tiny()
    model.save(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"config.json", "model.safetensors"}
    again = load_model(tmp_path)
    assert isinstance(again, GPT) and again.cfg == model.cfg
    batch = pack([random_docs(gen, row, V) for row in LENGTHS])
    assert torch.equal(model(batch.input_ids, batch.positions), again.eval()(batch.input_ids, batch.positions))
    assert again.lm_head.weight is again.wte.weight


def test_build_model_from_config():
    cfg = ModelConfig(n_layer=2, n_head=2, n_embd=16, block_size=32, attention="masked", gradient_checkpointing=True)
    model = build_model(cfg, vocab_size=50)
    assert model.cfg.vocab_size == 50 and model.cfg.gradient_checkpointing
    with pytest.raises(ConfigError, match="vocab_size"):
        build_model(dataclasses.replace(cfg, vocab_size=10), vocab_size=50)
    with pytest.raises(ConfigError, match="model.attention"):
        build_model(dataclasses.replace(cfg, attention="nope"), vocab_size=50)


def test_position_beyond_block_size_is_a_programming_error():
    # The run layer refuses such rows before training (a ConfigError there); in forward it is a bug.
    model = tiny()
    with pytest.raises(ValueError, match="block_size"):
        model.token_losses(pack([[list(range(1, 70))]]))
    batch = pack([[list(range(1, 9))]])
    with pytest.raises(ValueError, match="block_size"):  # the batch's own max_position is trusted
        model.token_losses(dataclasses.replace(batch, max_position=64))
    assert torch.isfinite(model.token_losses(dataclasses.replace(batch, max_position=7))).all()


def test_hand_built_config_errors_are_value_errors():
    with pytest.raises(ValueError, match="multiple of n_head"):
        GPT(GPTConfig(vocab_size=V, n_head=3, n_embd=32))
    with pytest.raises(ValueError, match="attention"):
        GPT(GPTConfig(vocab_size=V, attention="fast"))
    with pytest.raises(ValueError, match="loss_head"):
        GPT(GPTConfig(vocab_size=V, loss_head="fast"))


def test_gpt2_style_init():
    model = tiny()
    std = model.blocks[0].attn.proj.weight.std().item()
    assert abs(std - 0.02 / (2 * 2) ** 0.5) < 0.004  # residual projections scaled by 1/sqrt(2 n_layer)

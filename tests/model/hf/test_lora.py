"""LoRA through peft: only the adapters (and the added tokens' rows) train; save, reload and merge agree.

Tiny saved models with weights (GPT-2: tied head, fused qkv ``Conv1D``; Llama: untied head, separate
projections), a tokenizer of ``VOCAB + ADDED`` ids. The optimizer is the trainer's own
(``build_optimizer``: it leaves out what does not require a gradient).
"""

from __future__ import annotations

import sys

import pytest
import torch

from densebatch.config import LoraConfig, ModelConfig, OptimizerConfig, TrainConfig, config_from_dict
from densebatch.errors import ConfigError
from densebatch.model import build_model
from densebatch.testing.batches import pack, random_docs
from densebatch.testing.models import LENGTHS, VOCAB, packed_vs_alone, tiny_config
from densebatch.train.optim import build_optimizer

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from densebatch.model.hf.lora import load_adapter  # noqa: E402

ADDED = 2
KINDS = {"gpt2": {}, "llama": {"tie_word_embeddings": False}}
LORA = LoraConfig(r=4, alpha=8.0)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """kind -> a saved tiny model with weights."""
    root = tmp_path_factory.mktemp("lora_bases")
    out = {}
    for kind, overrides in KINDS.items():
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(tiny_config(kind, **overrides)).save_pretrained(root / kind)
        out[kind] = root / kind
    return out


def lora_model(path, lora=LORA, added=ADDED):
    torch.manual_seed(0)
    return build_model(ModelConfig(kind="hf", path=str(path), lora=lora), VOCAB + added, VOCAB)


def docs_with_added_tokens(gen) -> list[list[list[int]]]:
    rows = [random_docs(gen, row, VOCAB) for row in LENGTHS]
    rows[0][0][2], rows[1][0][5], rows[2][1][3] = VOCAB, VOCAB + 1, VOCAB  # the added ids appear as inputs and targets
    return rows


def train(model, gen, steps: int = 3):
    opt = build_optimizer(model, TrainConfig(lr=1e-2, optimizer=OptimizerConfig(weight_decay=0.1)))
    batch = pack(docs_with_added_tokens(gen), seq_len=32)
    model.train()
    for _ in range(steps):
        (model.token_losses(batch).sum() / batch.num_loss_tokens).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return opt


def effective_rows(model) -> torch.Tensor:
    """Every id's input embedding as the model sees it (PEFT's trainable tokens applied). (vocab, C)"""
    with torch.no_grad():
        return model.lm.get_input_embeddings()(torch.arange(model.vocab_size)).clone()


@pytest.mark.parametrize("kind", KINDS)
def test_only_adapters_and_added_rows_train(bases, kind, gen):
    model = lora_model(bases[kind])
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(("lora_" in n) or ("trainable_tokens_delta" in n) for n in trainable)
    assert any("trainable_tokens_delta" in n for n in trainable)  # the added tokens' rows train
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    rows = effective_rows(model)
    head = model.lm.get_output_embeddings()
    logits_before = (
        head(rows[1:2]).detach().clone()
    )  # (1, vocab), id 1 (0 is padding, a zero row): the output side of the added ids too

    opt = train(model, gen)
    in_optimizer = {id(p) for g in opt.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for p in model.parameters() if p.requires_grad}
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), f"frozen weight {n} changed"
        else:
            assert not torch.equal(p, adapters[n]), f"adapter {n} did not train"
    after = effective_rows(model)
    assert torch.equal(after[:VOCAB], rows[:VOCAB])  # base tokens' rows: untouched
    assert (after[VOCAB:] - rows[VOCAB:]).abs().amax(1).min() > 0  # every added row moved
    new_logits = head(rows[1:2]).detach()
    assert torch.equal(new_logits[:, :VOCAB], logits_before[:, :VOCAB])
    assert not torch.equal(new_logits[:, VOCAB:], logits_before[:, VOCAB:])  # the output rows of added ids train


@pytest.mark.parametrize("kind", KINDS)
def test_trained_adapters_keep_packed_documents_isolated(bases, kind, gen):
    model = lora_model(bases[kind])
    train(model, gen)
    loss_diff, logit_diff = packed_vs_alone(model.eval(), docs_with_added_tokens(gen))
    assert loss_diff <= 1e-5 and logit_diff <= 1e-5


def test_fused_head_with_a_frozen_weight_matches_the_plain_head(bases, gen):
    """No added tokens: the head stays a plain frozen nn.Linear, so the fused loss head runs; same losses and
    adapter gradients as the plain head, and no gradient for the frozen weight."""
    batch = pack([random_docs(gen, row, VOCAB) for row in LENGTHS], seq_len=32)
    results = []
    for head in ("fused", "plain"):
        model = lora_model(bases["llama"], added=0)
        assert type(model.lm.get_output_embeddings()) is torch.nn.Linear
        model.loss_head = head
        with torch.no_grad():  # nonzero B, so the adapters' gradients are not all in A's zero direction
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
        losses = model.token_losses(batch)
        losses.sum().backward()
        assert model.lm.get_output_embeddings().weight.grad is None
        results.append((losses.detach(), [p.grad for p in model.parameters() if p.requires_grad]))
    assert torch.allclose(results[0][0], results[1][0], atol=1e-5)
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_adapter_reloads_and_merges_to_the_same_logits(bases, kind, gen, tmp_path):
    from safetensors.torch import load_file

    model = lora_model(bases[kind])
    train(model, gen)
    model.eval()
    ids = torch.tensor([[1, 7, VOCAB, 3, VOCAB + 1, 9, 4]])
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        want = model(ids, positions)
    model.save(tmp_path / "adapter")
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert not [k for k in saved if "base_layer" in k]  # the grown tables are not copied into the adapter
    assert sum(t.numel() for t in saved.values()) == sum(p.numel() for p in model.parameters() if p.requires_grad)

    cfg = ModelConfig(kind="hf", path=str(bases[kind]), lora=LORA)
    again = load_adapter(tmp_path / "adapter", cfg, VOCAB + ADDED).eval()
    with torch.no_grad():
        assert torch.equal(again(ids, positions), want)
    again.save_merged(tmp_path / "merged")
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert not any("lora" in n for n, _ in plain.named_parameters())
    assert plain.config.vocab_size == VOCAB + ADDED
    with torch.no_grad():
        got = plain(input_ids=ids).logits
    # Merging computes (W + s B A) x where the adapter computed W x + s B (A x): the same sums in another
    # order, fp32 rounding of ~1e-7 relative per layer (measured 1.8e-7 on logits of magnitude ~1.2).
    assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())


def test_a_checkpointed_lora_model_loads_into_a_fresh_one(bases, gen):
    """What resume and load_trained do: the same build (added tokens' modules included), then load_state_dict."""
    model = lora_model(bases["llama"])
    train(model, gen)
    fresh = lora_model(bases["llama"])
    fresh.load_state_dict(model.state_dict())  # strict: the same keys
    ids = torch.tensor([[1, VOCAB, 5, VOCAB + 1]])
    with torch.no_grad():
        assert torch.equal(fresh.eval()(ids, torch.arange(4)[None]), model.eval()(ids, torch.arange(4)[None]))


def test_gradient_checkpointing_gives_the_same_adapter_gradients(bases, gen):
    batch = pack(docs_with_added_tokens(gen), seq_len=32)
    grads = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        cfg = ModelConfig(kind="hf", path=str(bases["llama"]), lora=LORA, gradient_checkpointing=ckpt)
        model = build_model(cfg, VOCAB + ADDED, VOCAB).train()
        with torch.no_grad():  # nonzero B: gradients reach A and the layers below
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
        model.token_losses(batch).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        assert grads[0][n] is not None and torch.allclose(grads[0][n], grads[1][n], atol=1e-6, rtol=1e-5), n


def test_bfloat16_base_keeps_float32_adapters(bases, gen):
    torch.manual_seed(0)
    model = build_model(ModelConfig(kind="hf", path=str(bases["llama"]), dtype="bfloat16", lora=LORA), VOCAB + ADDED, VOCAB)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert all(d == torch.float32 for n, d in dtypes.items() if "lora_" in n)
    assert all(d == torch.bfloat16 for n, d in dtypes.items() if "lora_" not in n and "trainable_tokens" not in n)
    train(model, gen, steps=2)
    assert all(torch.isfinite(p).all() for p in model.parameters())


# ------------------------------------------------------------------------------------------ refusals
def one_line(e: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(e.value)
    return str(e.value)


def test_weightless_base_is_refused(tmp_path):
    tiny_config("llama").save_pretrained(tmp_path)  # config.json only
    with pytest.raises(ConfigError, match="model.lora: .* holds no weights") as e:
        build_model(ModelConfig(kind="hf", path=str(tmp_path), lora=LORA), VOCAB)
    one_line(e)


def test_unknown_target_modules_are_refused(bases):
    with pytest.raises(ConfigError, match="model.lora.target_modules: ") as e:
        lora_model(bases["llama"], LoraConfig(r=4, target_modules=["no_such_proj"]))
    one_line(e)


def test_all_linear_adapts_every_projection(bases):
    model = lora_model(bases["llama"], LoraConfig(r=2, target_modules=["all-linear"]))
    adapted = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in model.named_parameters() if ".lora_A" in n}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_missing_peft_is_a_config_error(bases, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ImportError
    with pytest.raises(ConfigError, match=r"model.lora needs peft: pip install 'densebatch\[lora\]'"):
        lora_model(bases["llama"])


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"lora": {"r": 4}}, r"model.lora.r \(4\) has no effect: it applies under model.kind hf, .* LoRA adapts Hugging Face"),
        ({"dtype": "bfloat16"}, r"model.dtype \('bfloat16'\) has no effect: it applies under model.kind hf"),
        (
            {"attn_implementation": "eager"},
            r"model.attn_implementation \('eager'\) has no effect: it applies under model.kind hf",
        ),
        ({"kind": "hf", "path": "x", "dtype": "float16"}, "model.dtype: float16 weights cannot be trained"),
        ({"kind": "hf", "path": "x", "lora": {"r": 4, "dropout": 1.0}}, "model.lora.dropout: expected a probability"),
        ({"kind": "hf", "path": "x", "attn_implementation": "flash_attention_2"}, "model.attn_implementation"),
        ({"kind": "hf", "path": "x", "attn_implementation": "flex_attention"}, "model.attn_implementation"),
    ],
)
def test_bad_combinations_are_one_line_config_errors(model, message):
    with pytest.raises(ConfigError, match=message) as e:
        config_from_dict({"model": model})
    one_line(e)

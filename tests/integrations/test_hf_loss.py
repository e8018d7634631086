"""densebatch's loss path inside Hugging Face ``Trainer`` (``dense_batches(trainer)``, integrations/hf_loss.py): exact
against densebatch's own loop and the trainer's own loss, and never a (tokens, vocabulary) tensor."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import densebatch
from densebatch.testing.models import tiny_config

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

VOCAB = 259
PACKED = dict(strategy="packed", seq_len=256, max_tokens_per_batch=512, pad_id=0)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("hf_trainer_loss") / "base"
    config = tiny_config("llama", vocab_size=VOCAB, tie_word_embeddings=False, max_position_embeddings=256)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def docs():
    rng = np.random.default_rng(3)
    return datasets.Dataset.from_dict({"input_ids": [rng.integers(3, VOCAB, int(n)).tolist() for n in rng.integers(5, 200, 40)]})


def _sgd_trainer(model, out: Path, dataset, accum: int = 1, eval_dataset=None, **kw):
    """One plain SGD step at learning rate 1, no clipping: the weights move by minus the step's gradient."""
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=1, learning_rate=1.0, lr_scheduler_type="constant", warmup_steps=0, seed=5,
        report_to=[], save_strategy="no", use_cpu=True, optim="sgd", weight_decay=0.0, max_grad_norm=0.0,
        disable_tqdm=True, logging_steps=1, gradient_accumulation_steps=accum, **kw,
    )  # fmt: skip
    return transformers.Trainer(model=model, args=args, train_dataset=dataset, eval_dataset=eval_dataset)


def _step_gradients(trainer) -> tuple[float, dict[str, torch.Tensor]]:
    """(the logged loss of the trainer's one step, minus each trainable weight's change) = (loss, gradient)."""
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    after = dict(trainer.model.named_parameters())
    loss = next(h["loss"] for h in trainer.state.log_history if "loss" in h)
    return loss, {n: before[n] - after[n].detach() for n in before}


def _close(a: dict, b: dict, atol: float) -> float:
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= atol, worst
    return worst


def test_first_step_loss_and_gradients_equal_densebatch_loop_and_trainer_own(base, docs, tmp_path):
    """Two packed micro-batches a step: the fused path's loss and gradients equal densebatch's own model and
    normalisation on the same batches (HFCausalLM.token_losses over the step's loss tokens) and the trainer's
    own Hugging Face loss (loss='hf'), within 1e-6 in fp32."""
    from densebatch.model.hf.adapter import HFCausalLM

    attn = densebatch.register_attention()
    fused = _sgd_trainer(
        transformers.AutoModelForCausalLM.from_pretrained(base, attn_implementation=attn), tmp_path / "f", docs, 2
    )
    densebatch.dense_batches(fused, **PACKED)
    assert fused.densebatch_loss.startswith("densebatch fused head, chunk ")
    loss, grads = _step_gradients(fused)

    own = _sgd_trainer(transformers.AutoModelForCausalLM.from_pretrained(base, attn_implementation=attn), tmp_path / "h", docs, 2)
    densebatch.dense_batches(own, **PACKED, loss="hf")
    assert own.densebatch_loss == "Hugging Face loss (loss='hf')"
    hf_loss, hf_grads = _step_gradients(own)
    assert abs(loss - hf_loss) <= 1e-6
    _close(grads, hf_grads, 1e-6)

    model = HFCausalLM(base, loss_head="fused").train()  # densebatch's own model, loss head and normalisation
    batches = list(zip(range(2), densebatch.dataloader(docs, **PACKED, seed=5, format="batch")))
    n = sum(b.num_loss_tokens for _, b in batches)
    total = sum(model.token_losses(b).sum() for _, b in batches) / n
    total.backward()
    ours = {"model." + k if not k.startswith(("model.", "lm_head.")) else k: v for k, v in model.hf.named_parameters()}
    assert abs(float(total) - loss) <= 1e-6
    _close(grads, {k: p.grad for k, p in ours.items()}, 1e-6)


class _Largest(TorchDispatchMode):
    """The most elements of any tensor an operation returns (every allocation of forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.numel = max([self.numel] + [t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)])
        return out


@pytest.mark.parametrize("loss", ["densebatch", "hf"])
def test_no_tokens_by_vocabulary_tensor_exists_in_forward_or_backward(docs, tmp_path, loss):
    """One training step (forward and backward) of a 512-token packed batch, vocabulary 4,096: with the fused head
    (chunks of 32 positions) no saved activation and no operation's output comes near (tokens, vocabulary)
    elements (the largest are a chunk's logits and the head's weight gradient); the trainer's own loss (the
    control) builds them."""
    vocab = 4096
    config = tiny_config("llama", vocab_size=vocab, tie_word_embeddings=False, max_position_embeddings=256)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=densebatch.register_attention())
    trainer = densebatch.dense_batches(_sgd_trainer(model, tmp_path, docs), **PACKED, loss=loss, loss_chunk_tokens=32)
    samples, n = trainer.get_batch_samples(iter(trainer.get_train_dataloader()), 1, trainer.args.device)
    tokens = samples[0]["input_ids"].numel()
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    largest = _Largest()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), largest:
        trainer.training_step(trainer.model, samples[0], n)
    full, width = tokens * vocab, config.hidden_size
    if loss == "densebatch":
        assert largest.numel <= max(32, width) * vocab and max(saved) <= width * vocab < full / 8, (largest.numel, max(saved))
    else:
        assert largest.numel >= full and max(saved) >= full


def test_generate_evaluate_and_save_model_are_unchanged(base, docs, tmp_path):
    """After dense_batches and a training step, generate, evaluation and save_model are the model's own: the same
    tokens as a model that never met densebatch, the eval loss of a loss='hf' trainer, a loadable checkpoint."""
    attn = densebatch.register_attention()
    models = [transformers.AutoModelForCausalLM.from_pretrained(base, attn_implementation=attn) for _ in range(2)]
    rows = [ids[:32] for ids in docs["input_ids"] if len(ids) >= 32][:8]  # the default collator: equal lengths
    held_out = datasets.Dataset.from_dict({"input_ids": rows, "labels": rows})
    trainers = [_sgd_trainer(m, tmp_path / k, docs, eval_dataset=held_out) for m, k in zip(models, ("f", "h"))]
    densebatch.dense_batches(trainers[0], **PACKED)
    densebatch.dense_batches(trainers[1], **PACKED, loss="hf")
    for t in trainers:
        t.args.learning_rate = 1e-3
        t.train()
    assert _close(dict(models[0].named_parameters()), dict(models[1].named_parameters()), 1e-6) >= 0
    prompt = torch.tensor([[5, 17, 42, 7]])
    plain = transformers.AutoModelForCausalLM.from_pretrained(base, attn_implementation=attn)
    plain.load_state_dict(models[0].state_dict())
    out = models[0].eval().generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, plain.eval().generate(prompt, max_new_tokens=6, do_sample=False))
    assert abs(trainers[0].evaluate()["eval_loss"] - trainers[1].evaluate()["eval_loss"]) <= 1e-6
    trainers[0].save_model(str(tmp_path / "saved"))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert all(torch.equal(p, q) for p, q in zip(back.state_dict().values(), plain.state_dict().values()))


def _arch_config(kind: str):
    """Tiny configs of the head variants: tied (GPT-2), a logit scale (Cohere), a logit divisor (Granite), soft-capped
    logits (Gemma 2 and 3, cap lowered to 2 so that it bends the random model's logits)."""
    if kind == "gpt2":
        return tiny_config("gpt2", vocab_size=VOCAB, n_positions=256)
    if kind == "gemma2":
        return tiny_config("gemma2", vocab_size=VOCAB, max_position_embeddings=256, final_logit_softcapping=2.0)
    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    if kind == "gemma3_text":
        return transformers.Gemma3TextConfig(**common, head_dim=8, final_logit_softcapping=2.0, sliding_window=16)
    if kind == "cohere":
        return transformers.CohereConfig(**common, logit_scale=0.5)
    return transformers.GraniteConfig(**common, logits_scaling=4.0, tie_word_embeddings=False)


@pytest.mark.parametrize("kind", ["gpt2", "cohere", "granite", "gemma2", "gemma3_text"])
def test_unpacked_rows_give_the_trainers_own_loss_and_gradients(docs, tmp_path, kind):
    """Random padded rows (one document each, attention_mask, labels: the trainer's own loss is right there): the
    fused path's loss and gradients equal loss='hf' within 1e-6: tied head, logit scales and soft-capping."""
    torch.manual_seed(0)
    attn = "eager" if kind.startswith("gemma") else "sdpa"  # Gemma 2 soft-caps its attention scores too
    ref = transformers.AutoModelForCausalLM.from_config(_arch_config(kind), attn_implementation=attn)
    runs = []
    for loss in ("densebatch", "hf"):
        model = transformers.AutoModelForCausalLM.from_config(_arch_config(kind), attn_implementation=attn)
        model.load_state_dict(ref.state_dict())
        trainer = densebatch.dense_batches(
            _sgd_trainer(model, tmp_path / loss, docs), strategy="random", rows_per_batch=4, pad_id=0, loss=loss
        )
        assert trainer.densebatch_loss.startswith("densebatch fused" if loss == "densebatch" else "Hugging Face")
        runs.append(_step_gradients(trainer))
    assert abs(runs[0][0] - runs[1][0]) <= 1e-6
    _close(runs[0][1], runs[1][1], 1e-6)


def test_lora_with_gradient_checkpointing_trains_the_adapters_as_the_trainers_own_loss(base, docs, tmp_path):
    """A PEFT LoRA model with gradient checkpointing: the fused path runs (through PeftModel's forward) and gives
    the adapters the gradients of the trainer's own loss, within 1e-6; the frozen weights do not move."""
    peft = pytest.importorskip("peft")
    runs = []
    for loss in ("densebatch", "hf"):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_pretrained(base, attn_implementation=densebatch.register_attention())
        lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
        trainer = _sgd_trainer(lora, tmp_path / loss, docs, 2, activation_checkpointing=True)
        densebatch.dense_batches(trainer, **PACKED, loss=loss)
        assert trainer.densebatch_loss.startswith("densebatch fused" if loss == "densebatch" else "Hugging Face")
        runs.append(_step_gradients(trainer))
        assert model.model.layers[0].self_attn.q_proj.base_layer.weight.requires_grad is False
    assert all("lora_" in k for k in runs[0][1]) and abs(runs[0][0] - runs[1][0]) <= 1e-6
    assert _close(runs[0][1], runs[1][1], 1e-6) >= 0 and max(float(g.abs().max()) for g in runs[0][1].values()) > 0


def test_what_cannot_be_exact_keeps_the_trainers_loss_and_says_why(base, docs, tmp_path):
    """An architecture outside the checked list (BLOOM), a Trainer subclass with its own compute_loss: the trainer's
    loss is kept and the line names the reason; a bad loss= is refused."""
    bloom = transformers.AutoModelForCausalLM.from_config(tiny_config("bloom", vocab_size=VOCAB))
    trainer = densebatch.dense_batches(_sgd_trainer(bloom, tmp_path / "b", docs), strategy="random", pad_id=0)
    assert trainer.densebatch_loss.startswith("Hugging Face loss (model_type 'bloom': its logits are not known")

    class Custom(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    custom = Custom(model=model, args=_sgd_trainer(model, tmp_path / "c", docs).args, train_dataset=docs)
    assert densebatch.dense_batches(custom, **PACKED).densebatch_loss == (
        "Hugging Face loss (Custom overrides compute_loss: its loss is kept)"
    )
    with pytest.raises(ValueError, match="loss: expected one of densebatch, hf"):
        densebatch.dense_batches(custom, **PACKED, loss="liger")


def test_the_step_is_normalised_by_its_loss_tokens_where_the_trainer_does_not_count_them(base, docs, tmp_path):
    """A model that takes no loss keywords gets no num_items_in_batch from the trainer (which then averages the
    micro-batches' means): the fused path counts the step's loss tokens itself, so two micro-batches a step give
    the gradient they give when the trainer counts them."""
    attn = densebatch.register_attention()
    runs = []
    for counts in (True, False):
        model = transformers.AutoModelForCausalLM.from_pretrained(base, attn_implementation=attn)
        trainer = _sgd_trainer(model, tmp_path / str(counts), docs, 2)
        trainer.model_accepts_loss_kwargs = counts
        runs.append(_step_gradients(densebatch.dense_batches(trainer, **PACKED)))
    assert abs(runs[0][0] - runs[1][0]) <= 1e-6
    _close(runs[0][1], runs[1][1], 1e-6)


@pytest.mark.parametrize("scale, cap, eps", [(0.5, None, 0.1), (1.0, 3.0, 0.0), (2.0, 3.0, 0.1)])
@pytest.mark.parametrize("weighted", [False, True])
def test_the_fused_head_scales_and_soft_caps_logits_as_the_architectures_do(scale, cap, eps, weighted):
    """head_token_losses with logit_scale / softcap: the losses and the gradients of h, the weight and the bias equal
    autograd through cap x tanh(scale x (h W^T + b) / cap), chunked (7 positions), with or without token weights
    downstream (the backward's recomputing path)."""
    from densebatch.model.loss_head import head_token_losses

    torch.manual_seed(0)
    h, w, b = (
        torch.randn(2, 50, 16, requires_grad=True),
        torch.randn(97, 16, requires_grad=True),
        torch.randn(97, requires_grad=True),
    )
    y = torch.randint(0, 97, (2, 50))
    y[0, :5] = -100
    g = torch.rand(2, 50) if weighted else torch.ones(2, 50)
    ours = head_token_losses(h, y, w, b, chunk_tokens=7, logit_scale=scale, softcap=cap, label_smoothing=eps)
    got = torch.autograd.grad((ours * g).sum() if weighted else ours.sum(), (h, w, b))
    z = torch.nn.functional.linear(h, w, b) * scale
    z = cap * torch.tanh(z / cap) if cap else z
    ref = torch.nn.functional.cross_entropy(z.reshape(-1, 97), y.reshape(-1), reduction="none", label_smoothing=eps)
    want = torch.autograd.grad((ref.reshape(2, 50) * g).sum(), (h, w, b))
    torch.testing.assert_close(ours, ref.reshape(2, 50), atol=1e-5, rtol=1e-5)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def mixture():
    """Two sources of very different lengths, interleaved: short answers and long threads."""
    rng = np.random.default_rng(7)
    lengths = [(int(rng.integers(4, 24)), "short") if i % 2 else (int(rng.integers(80, 250)), "long") for i in range(40)]
    ids = [rng.integers(3, VOCAB, n).tolist() for n, _ in lengths]
    labels = [[-100] * (n // 3) + t[n // 3 :] for (n, _), t in zip(lengths, ids)]  # a prompt without loss
    return datasets.Dataset.from_dict({"input_ids": ids, "labels": labels, "source": [s for _, s in lengths]})


def test_sources_weigh_the_loss_as_densebatch_loop_does(base, mixture, tmp_path, monkeypatch):
    """dense_batches(source_column=...): the factors are batch_balance's over a store of the same documents laid
    out source after source (what densebatch train computes for train.source_balance: batches), and the first
    step's loss and gradients (two packed micro-batches) equal densebatch's own weighted loss on the same batches
    (weighted_losses over the step's summed weights, train/per_source.py) within 1e-6 in fp32. The weights go into
    the fused head (token_weights), so its backward never projects the head again."""
    from densebatch.model import loss_head

    second_passes = []
    recompute = loss_head._weighted_head_grads
    monkeypatch.setattr(loss_head, "_weighted_head_grads", lambda *a, **k: second_passes.append(1) or recompute(*a, **k))
    from densebatch.data.plan.source_balance import batch_balance
    from densebatch.data.store.store import DocumentStore
    from densebatch.data.torch_loader import Documents
    from densebatch.integrations.sources import source_factors
    from densebatch.model.hf.adapter import HFCausalLM
    from densebatch.train.per_source import SourceWeights, step_loss_tokens, weighted_losses

    docs = Documents(mixture, source_column="source")
    factors = source_factors(docs, "packed", 5)
    assert docs.source_names == ["long", "short"] and factors[1] > 1.2 * factors[0]  # short answers weigh more
    order = np.argsort(docs.sources, kind="stable")
    spans = [(mixture[int(i)]["input_ids"], (np.asarray(mixture[int(i)]["labels"]) != -100).astype(np.uint8)) for i in order]
    store = DocumentStore.from_documents(spans, {"sources": docs.source_names}, docs.sources[order])
    assert factors == batch_balance(store, weights=None, seed=5, rows=8).tolist()

    attn = densebatch.register_attention()
    fused = _sgd_trainer(transformers.AutoModelForCausalLM.from_pretrained(base, attn_implementation=attn), tmp_path, mixture, 2)
    densebatch.dense_batches(fused, **PACKED, source_column="source")
    assert "sources weighted" in fused.densebatch_loss
    loss, grads = _step_gradients(fused)
    assert second_passes == []

    model = HFCausalLM(base, loss_head="fused").train()
    weights = SourceWeights(factors, getattr(model, "weighs_losses", False))
    batches = [
        b for _, b in zip(range(2), densebatch.dataloader(mixture, **PACKED, seed=5, format="batch", source_column="source"))
    ]
    assert all(b.source_ids is not None for b in batches)
    _, weight = step_loss_tokens(batches, weights)
    total = sum(weighted_losses(model.token_losses, b, weights)[0] for b in batches) / weight
    total.backward()
    ours = {"model." + k if not k.startswith(("model.", "lm_head.")) else k: v for k, v in model.hf.named_parameters()}
    assert abs(float(total.detach()) - loss) <= 1e-6
    _close(grads, {k: p.grad for k, p in ours.items()}, 1e-6)
    plain = sum(model.token_losses(b).sum() for b in batches) / sum(b.num_loss_tokens for b in batches)
    assert abs(float(plain) - loss) > 1e-4  # the weights moved the loss far past the tolerance (random weights: CE near ln V)


def test_sources_need_densebatch_loss_path(mixture, tmp_path):
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=VOCAB, max_position_embeddings=256))
    with pytest.raises(ValueError, match="source_column weighs sources in densebatch's loss path"):
        densebatch.dense_batches(_sgd_trainer(model, tmp_path, mixture), **PACKED, loss="hf", source_column="source")
    with pytest.raises(ValueError, match="no 'origin' column"):
        densebatch.dense_batches(_sgd_trainer(model, tmp_path, mixture), **PACKED, source_column="origin")

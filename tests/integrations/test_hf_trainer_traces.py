"""What ``dense_batches(trainer)`` leaves on the user's objects: a model that copies, pickles and saves as its own,
a trainer put back by ``undo_dense_batches``, and nothing changed by a call that is refused."""

from __future__ import annotations

import copy
import io
import pickle

import numpy as np
import pytest
import torch

import densebatch
from densebatch.testing.models import tiny_config

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

VOCAB = 259
PACKED = dict(strategy="packed", seq_len=256, max_tokens_per_batch=512, pad_id=0)
PROMPT = torch.tensor([[5, 17, 42, 7, 99, 3]])
OWN = ("get_train_dataloader", "compute_loss", "get_batch_samples", "loss_is_scaled_for_ga")


@pytest.fixture(scope="module")
def docs():
    rng = np.random.default_rng(3)
    return datasets.Dataset.from_dict({"input_ids": [rng.integers(3, VOCAB, int(n)).tolist() for n in rng.integers(5, 200, 40)]})


def _model(kind: str = "llama"):
    torch.manual_seed(0)
    config = tiny_config(
        kind, vocab_size=VOCAB, **({"tie_word_embeddings": False, "max_position_embeddings": 256} if kind == "llama" else {})
    )
    return transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=densebatch.register_attention() if kind == "llama" else "eager"
    )


def _trainer(model, out, dataset, steps: int = 1, callbacks=(), **kw):
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=steps, learning_rate=1e-2, report_to=[], save_strategy="no", use_cpu=True,
        disable_tqdm=True, logging_steps=1, seed=5, **kw,
    )  # fmt: skip
    return transformers.Trainer(model=model, args=args, train_dataset=dataset, callbacks=list(callbacks))


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=PROMPT).logits


def _independent(model) -> None:
    """A deep copy whose weights change computes with them, and the original keeps its outputs; pickle and
    torch.save give back a model with the original's outputs."""
    before = _logits(model)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.add_(torch.randn_like(p))
    fresh = _model()
    fresh.load_state_dict(twin.state_dict())
    assert not torch.allclose(_logits(twin), before) and torch.equal(_logits(twin), _logits(fresh))
    assert torch.equal(_logits(model), before)
    assert torch.equal(_logits(pickle.loads(pickle.dumps(model))), before)
    buf = io.BytesIO()
    torch.save(model, buf)
    assert torch.equal(_logits(torch.load(io.BytesIO(buf.getvalue()), weights_only=False)), before)


def test_the_model_copies_pickles_and_saves_as_its_own_before_and_after_training(docs, tmp_path):
    """The issue's check: after dense_batches, and after a training step on the fused path, a copy with changed
    weights gives its own outputs (not the original's), and pickle and torch.save of the model work."""
    model = _model()
    trainer = densebatch.dense_batches(_trainer(model, tmp_path, docs), **PACKED)
    assert trainer.densebatch_loss.startswith("densebatch fused head")
    _independent(model)
    model.train()
    trainer.train()
    _independent(model)


def test_a_reference_model_trl_copies_during_training_keeps_its_own_weights(docs, tmp_path):
    """TRL's create_reference_model (a deep copy, what its preference trainers make) taken from an SFTTrainer's
    model after its first fused step: the reference's per-token log-probabilities, through TRL's own fused head as
    its trainers ask for them, are those of the weights it was copied with, while the trainer's model trains on.
    (TRL 1.16's SFTTrainer sets a forward of its own on the model, whose plain path calls the model it was set
    on: a copy's plain logits are the original's, with or without densebatch; docs/python.md.)"""
    trl = pytest.importorskip("trl")
    from trl.experimental.utils import create_reference_model

    labels = PROMPT.clone()

    def log_probs(m):
        with torch.no_grad():
            return m.eval()(input_ids=PROMPT, labels=labels, fused_lm_head=True).log_probs

    copies = []

    class Snapshot(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            if not copies:
                copies.append((create_reference_model(model), {k: v.clone() for k, v in model.state_dict().items()}))
                model.train()

    args = trl.SFTConfig(
        output_dir=str(tmp_path), max_steps=3, learning_rate=1e-2, seed=5, report_to=[], use_cpu=True, save_strategy="no",
        disable_tqdm=True, packing=False, dataset_kwargs={"skip_prepare_dataset": True}, bf16=False,
    )  # fmt: skip
    model = _model()
    sft = trl.SFTTrainer(
        model=model, args=args, train_dataset=docs, processing_class=_tokenizer(tmp_path), callbacks=[Snapshot()]
    )
    densebatch.dense_batches(sft, **PACKED)
    sft.train()
    ((ref, weights),) = copies
    at_copy = copy.deepcopy(model)
    at_copy.load_state_dict(weights)
    assert torch.equal(log_probs(ref), log_probs(at_copy)) and not torch.allclose(log_probs(model), log_probs(at_copy))


def _tokenizer(tmp_path):
    from densebatch.data.prepare.tokenizers import load_tokenizer

    load_tokenizer("default").save(tmp_path / "tok")
    return transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")


def test_undo_puts_back_the_trainers_own_methods_and_says_which(docs, tmp_path):
    """undo_dense_batches returns the names it put back, each as it was (the class's method, or an instance
    attribute the user had set); a second dense_batches call undoes the first; then the trainer batches as its own."""
    model = _model()
    trainer = _trainer(model, tmp_path, docs)
    mine = trainer.get_batch_samples  # an instance attribute the user set before
    trainer.get_batch_samples = mine
    before = dict(vars(trainer))
    densebatch.dense_batches(trainer, **PACKED)
    densebatch.dense_batches(trainer, **PACKED, loss="hf")  # the second call undoes the first
    densebatch.dense_batches(trainer, **PACKED)
    assert {k for k in OWN if k in vars(trainer)} == set(OWN)
    assert densebatch.undo_dense_batches(trainer) == list(OWN)
    assert vars(trainer).keys() == before.keys() and all(vars(trainer)[k] is v for k, v in before.items())
    assert trainer.get_batch_samples is mine and trainer.loss_is_scaled_for_ga is None
    assert not isinstance(trainer.get_train_dataloader().batch_sampler, densebatch.DenseBatchSampler)
    assert densebatch.undo_dense_batches(trainer) == []
    refused = _trainer(_model("bloom"), tmp_path / "b", docs)
    densebatch.dense_batches(refused, strategy="random", pad_id=0)
    assert densebatch.undo_dense_batches(refused) == ["get_train_dataloader", "compute_loss"]


def test_a_refused_call_changes_nothing(docs, tmp_path):
    """A source_column the trainer cannot serve (a model the fused path refuses, loss='hf'), a column that is not
    there, a bad loss name: refused before anything on the trainer or the model changes."""
    mixture = docs.add_column("source", ["a", "b"] * (len(docs) // 2))
    for model, kw, match in (
        (
            _model("bloom"),
            dict(strategy="random", pad_id=0, source_column="source"),
            "source_column needs densebatch's loss path",
        ),
        (_model(), dict(PACKED, loss="hf", source_column="source"), "source_column weighs sources"),
        (_model(), dict(PACKED, source_column="origin"), "no 'origin' column"),
        (_model(), dict(PACKED, loss="liger"), "loss: expected one of densebatch, hf"),
    ):
        trainer = _trainer(model, tmp_path, mixture)
        before, own = dict(vars(trainer)), dict(vars(model))
        with pytest.raises(ValueError, match=match):
            densebatch.dense_batches(trainer, **kw)
        assert vars(trainer) == before and vars(model) == own


def test_the_fused_forward_runs_under_the_trainers_mixed_precision(docs, tmp_path):
    """bf16 on CPU: accelerate wraps the model's forward in autocast; the fused path's forward, which stands in for
    it during compute_loss, runs the layers under the same autocast (bf16 projections, as loss='hf' computes them),
    and accelerate's wrapper is the model's forward again afterwards."""
    seen = {}
    for loss in ("densebatch", "hf"):
        model = _model()
        trainer = densebatch.dense_batches(_trainer(model, tmp_path / loss, docs, bf16=True), **PACKED, loss=loss)
        proj = model.model.layers[0].self_attn.q_proj
        hook = proj.register_forward_hook(lambda m, a, out, loss=loss: seen.setdefault(loss, out.dtype) and None)
        trainer.train()
        hook.remove()
        wrapper = vars(model).get("forward")
        assert wrapper is not None and getattr(wrapper, "__func__", None).__module__.startswith("accelerate")
    assert seen == {"densebatch": torch.bfloat16, "hf": torch.bfloat16}

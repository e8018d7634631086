"""Token-weighted evaluation: independent of batching, equal to the plain per-token mean."""

from __future__ import annotations

import math

import pytest
import torch

from densebatch.errors import ConfigError
from densebatch.train.evaluate import evaluate, perplexity
from densebatch.train.precision import allow_tf32, autocast, check_precision, resolve_precision


def test_eval_loss_does_not_depend_on_batching(tiny):
    model = tiny.TinyLM()
    docs = tiny.make_docs(20, seed=3, min_len=2, max_len=50)
    one = evaluate(model, [tiny.collate(docs)])
    singles = evaluate(model, [tiny.collate([d]) for d in docs])
    uneven = evaluate(model, [tiny.collate(docs[:1]), tiny.collate(docs[1:15], seq_len=64), tiny.collate(docs[15:])])
    assert one.tokens == singles.tokens == uneven.tokens == sum(len(d) - 1 for d in docs)
    assert singles.loss == pytest.approx(one.loss, rel=1e-6)
    assert uneven.loss == pytest.approx(one.loss, rel=1e-6)
    # Negative control: a mean of per-batch means is a different number.
    means = [model.token_losses(tiny.collate([d])).sum().item() / (len(d) - 1) for d in docs]
    assert abs(sum(means) / len(means) - one.loss) > 1e-3


def test_eval_matches_manual_mean_and_counts(tiny):
    model = tiny.TinyLM()
    batch = tiny.collate(tiny.make_docs(6, seed=4))
    with torch.no_grad():
        losses = model.token_losses(batch)
    expected = losses[batch.labels != -100].double().mean().item()
    res = evaluate(model, [batch, batch], max_batches=1)
    assert res.batches == 1 and res.tokens == batch.num_loss_tokens and res.real_tokens == batch.num_real_tokens
    assert res.loss == pytest.approx(expected, rel=1e-9)
    assert res.ppl == pytest.approx(math.exp(expected))
    assert res.as_dict()["loss"] == res.loss


def test_eval_restores_mode_and_reduces(tiny):
    model = tiny.TinyLM().train()
    batch = tiny.collate(tiny.make_docs(3, seed=5))
    doubled = evaluate(model, [batch], all_reduce_sum=lambda t: t * 2)  # two identical ranks
    plain = evaluate(model, [batch])
    assert model.training
    assert doubled.tokens == 2 * plain.tokens and doubled.loss == pytest.approx(plain.loss)


def test_empty_eval_and_overflowing_perplexity(tiny):
    res = evaluate(tiny.TinyLM(), [])
    assert res.tokens == 0 and math.isnan(res.loss)
    assert perplexity(1000.0) == math.inf


def test_precision_checks():
    cpu = torch.device("cpu")
    check_precision(cpu, "bf16")
    check_precision(cpu, "fp32")
    with pytest.raises(ConfigError, match="CUDA"):
        check_precision(cpu, "fp16")
    with autocast(cpu, "bf16"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


def test_auto_precision_is_fp32_on_cpu_and_bf16_on_a_cuda_gpu_with_bf16(monkeypatch):
    cpu = torch.device("cpu")
    assert resolve_precision(cpu, "auto") == "fp32" and not allow_tf32(cpu)
    with autocast(cpu, "auto"):  # fp32 on CPU: autocast is not even entered
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    assert resolve_precision(cpu, "bf16") == "bf16"
    with pytest.raises(ConfigError, match="expected auto, fp32, bf16 or fp16"):
        resolve_precision(cpu, "fp8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_precision(torch.device("cuda"), "auto") == "bf16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_precision(torch.device("cuda"), "auto") == "fp32"

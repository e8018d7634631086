"""AdamW parameter groups (decay, lr multipliers, partition) and schedules as pure functions of the step."""

from __future__ import annotations

import math

import pytest
import torch

from densebatch.config import OptimizerConfig, TrainConfig
from densebatch.train.optim import build_optimizer, estimate_total_steps, lr_at, param_groups


def test_groups_partition_parameters_exactly_once(tiny):
    model = tiny.TinyLM()
    groups = param_groups(model, TrainConfig())
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids))
    assert set(ids) == {id(p) for p in model.parameters()}


def test_no_decay_on_vectors_and_embeddings_and_lr_mults(tiny):
    model = tiny.TinyLM()
    cfg = TrainConfig(optimizer=OptimizerConfig(weight_decay=0.1), lr_mult_embeddings=0.5, lr_mult_blocks=1.0, lr_mult_head=2.0)
    by_name = {g["name"]: g for g in param_groups(model, cfg)}
    assert by_name["embeddings.no_decay"]["params"] == [model.embed.weight]
    assert "embeddings.decay" not in by_name
    assert by_name["blocks.decay"]["params"] == [model.block.weight]
    assert {id(p) for p in by_name["blocks.no_decay"]["params"]} == {
        id(model.block.bias),
        id(model.norm.weight),
        id(model.norm.bias),
    }
    assert by_name["head.decay"]["params"] == [model.head.weight]
    assert by_name["blocks.decay"]["weight_decay"] == 0.1 and by_name["head.decay"]["weight_decay"] == 0.1
    assert by_name["blocks.no_decay"]["weight_decay"] == 0.0 and by_name["embeddings.no_decay"]["weight_decay"] == 0.0
    assert [by_name[n]["lr_mult"] for n in ("embeddings.no_decay", "blocks.decay", "head.decay")] == [0.5, 1.0, 2.0]


def test_decay_all_decays_everything(tiny):
    groups = param_groups(tiny.TinyLM(), TrainConfig(optimizer=OptimizerConfig(weight_decay=0.2, decay_all=True)))
    assert all(g["weight_decay"] == 0.2 for g in groups)


def test_bad_layer_groups_are_refused(tiny):
    model = tiny.TinyLM()
    model.layer_groups = lambda: {"embeddings": [model.embed.weight], "blocks": [model.embed.weight]}
    with pytest.raises(ValueError, match="twice"):
        param_groups(model, TrainConfig())
    model.layer_groups = lambda: {"embeddings": [model.embed.weight]}
    with pytest.raises(ValueError, match="no group"):
        param_groups(model, TrainConfig())


def test_build_optimizer_cpu_uses_fused_and_carries_groups(tiny):
    opt = build_optimizer(tiny.TinyLM(), TrainConfig(optimizer=OptimizerConfig(beta1=0.8, beta2=0.9)))
    assert isinstance(opt, torch.optim.AdamW)
    assert all(g["fused"] and not g["foreach"] for g in opt.param_groups)  # HF Trainer's default too
    assert all("lr_mult" in g for g in opt.param_groups)
    assert opt.param_groups[0]["betas"] == (0.8, 0.9)


def test_warmup_then_cosine():
    cfg = TrainConfig(lr=1.0, warmup_steps=4, min_lr_ratio=0.1, schedule="cosine")
    assert [lr_at(s, cfg, 14) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, cfg, 14) == pytest.approx(1.0)
    assert lr_at(9, cfg, 14) == pytest.approx(0.55)  # half way: the mean of lr and min_lr
    assert lr_at(14, cfg, 14) == pytest.approx(0.1)
    assert lr_at(100, cfg, 14) == pytest.approx(0.1)  # flat after the horizon
    values = [lr_at(s, cfg, 14) for s in range(4, 15)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_linear_and_constant():
    lin = TrainConfig(lr=2.0, warmup_steps=0, min_lr_ratio=0.0, schedule="linear")
    assert [lr_at(s, lin, 4) for s in range(6)] == [2.0, 1.5, 1.0, 0.5, 0.0, 0.0]
    const = TrainConfig(lr=2.0, warmup_steps=2, schedule="constant")
    assert [lr_at(s, const, 10) for s in range(4)] == [1.0, 2.0, 2.0, 2.0]


def test_schedule_is_pure_and_unknown_horizon_is_constant():
    cfg = TrainConfig(lr=1.0, warmup_steps=0, schedule="cosine", min_lr_ratio=0.1)
    # The cosine written out independently: min + (peak - min) * (1 + cos(pi * step / horizon)) / 2.
    expected = [0.1 + 0.9 * (1 + math.cos(math.pi * s / 20)) / 2 for s in range(21)]
    forward = [lr_at(s, cfg, 20) for s in range(21)]
    backward = [lr_at(s, cfg, 20) for s in reversed(range(21))][::-1]  # pure: call order changes nothing
    assert forward == pytest.approx(expected, abs=1e-12) and backward == forward
    assert lr_at(7, cfg, 20) == pytest.approx(0.1 + 0.45 * (1 + math.cos(0.35 * math.pi)))  # 0.5452...
    assert lr_at(50, cfg, None) == 1.0
    assert lr_at(0, cfg, 20) == 1.0  # first update at the peak when there is no warm-up


def test_estimate_total_steps():
    # (cfg, steps per epoch from the step planner, real tokens of the first step)
    assert estimate_total_steps(TrainConfig(max_steps=7), 100, 10) == 7
    assert estimate_total_steps(TrainConfig(max_epochs=2.5), 4, 10) == 10  # 2.5 epochs of 4 steps
    assert estimate_total_steps(TrainConfig(max_epochs=0.3), 10, 10) == 3
    assert estimate_total_steps(TrainConfig(), 5, 10) == 5  # no limit: one epoch
    assert estimate_total_steps(TrainConfig(max_tokens=95, max_steps=50), None, 10) == 10  # ceil(95 / 10)
    assert estimate_total_steps(TrainConfig(max_epochs=1.0), None, 10) is None
    assert math.isclose(lr_at(3, TrainConfig(lr=1.0), None), 1.0)

"""The written contracts hold: the data layer's loader and the trainer's own adapter are ``StepSource`` s,
the models map a ``Batch`` to per-token losses (``TokenLossModel``), and the trainer offers every member
of ``TrainerHost`` that the components it hosts use."""

from __future__ import annotations

import inspect

import numpy as np

from densebatch.config import ModelConfig, TrainConfig
from densebatch.data.load.collate import CausalCollator
from densebatch.data.load.loader import StepLoader
from densebatch.data.plan.planner import PlanSettings
from densebatch.model import build_model
from densebatch.train.batch_steps import BatchSteps
from densebatch.train.contracts import StepSource, TokenLossModel, TrainerHost
from densebatch.train.loop import Trainer


class _Store:
    """The smallest store a StepLoader plans from (lengths only: no batch is collated here)."""

    lengths = np.array([5, 9, 3, 12], dtype=np.int64)
    source_names = ["default"]

    def __len__(self):
        return len(self.lengths)

    def source_offsets(self):
        return np.array([0, len(self.lengths)])


def _members(protocol) -> set[str]:
    return {n for n in dir(protocol) if not n.startswith("_")} | set(getattr(protocol, "__annotations__", {}))


def test_the_loader_and_the_batch_adapter_are_step_sources():
    loader = StepLoader(
        _Store(),
        settings=PlanSettings(strategy="random", rows_per_batch=2),
        collator=CausalCollator(pad_id=0),
        seed=0,
        prefetch=0,
    )
    assert isinstance(loader, StepSource) and isinstance(BatchSteps([], TrainConfig()), StepSource)
    assert loader.step_fraction is None and loader.loss_tokens_per_step is None
    loader.set_step_fraction(lambda n: 0.5)
    assert loader.step_fraction(3) == 0.5


def test_a_plain_iterable_cannot_take_a_batch_size_schedule():
    steps = BatchSteps([], TrainConfig())
    steps.set_step_fraction(None)  # full size: fine
    try:
        steps.set_step_fraction(lambda n: 0.5)
    except ValueError as e:
        assert "StepLoader" in str(e)
    else:
        raise AssertionError("BatchSteps accepted a step fraction it cannot apply")


def test_the_reference_model_has_the_model_contract():
    model = build_model(ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=32), 64)
    methods = {n for n in dir(TokenLossModel) if not n.startswith("_")}
    for name in _members(TokenLossModel):
        assert hasattr(model, name), name
        assert callable(getattr(model, name)) == (name in methods), name
    assert model.task == "causal" and model.max_positions == 32 and model.weighs_losses
    assert set(model.layer_groups()) <= {"embeddings", "blocks", "head"}


def test_the_trainer_offers_what_its_hosted_components_use():
    missing = []
    init = inspect.getsource(Trainer.__init__)
    for name in _members(TrainerHost):
        if (
            not hasattr(Trainer, name)
            and f"self.{name} " not in init
            and f"self.{name}:" not in init
            and f"self.{name}," not in init
        ):
            missing.append(name)
    assert not missing, missing

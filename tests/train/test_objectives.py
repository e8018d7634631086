"""Preference objectives in the trainer: the same pairs in one batch, in k micro-batches, split by rows after an
out-of-memory error, or over 2 ranks give the same gradient and the same metrics; TRL's metric names in the
records; the live reference is the starting weights (a frozen copy, or the LoRA base with no copy) and the
precomputed one is the same numbers."""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from densebatch.config import TrainConfig
from densebatch.data.load.pair_collate import PairCollator
from densebatch.data.store.pair_layout import pair_document
from densebatch.data.store.store import DocumentStore
from densebatch.testing.models import tiny_gpt
from densebatch.train.distributed import Distributed, TokenLosses
from densebatch.train.loop import Trainer
from densebatch.train.objectives.losses import OBJECTIVES
from densebatch.train.objectives.reference import LiveReference, reference_table
from densebatch.train.objectives.steps import METRICS, PreferenceSteps
from densebatch.train.parts import Evaluation, Placement, StepParts

V = 50
N = 8  # pairs


def _store():
    rng = np.random.default_rng(0)
    docs = []
    for _ in range(N):
        p, c, r = (rng.integers(3, V, int(k)) for k in rng.integers(1, 7, 3))
        docs.append(pair_document(p, c, r, chosen_loss=np.ones(len(c)), rejected_loss=np.ones(len(r))))
    return DocumentStore.from_documents(docs, meta={"eos_id": 0, "pad_id": 0, "pairs": True})


def _model():
    m = tiny_gpt(V, attention="segmented")
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))  # away from the reference (tiny_gpt's own weights)
    return m


def _objective(name):
    return OBJECTIVES[name](beta=0.5, label_smoothing=0.0 if name == "orpo" else 0.1, cpo_alpha=0.5)


def _batches(store, objective, splits, reference=None):
    lengths = [int(x) for x in store.lengths]
    collator = PairCollator(0, prompt_targets=objective.prompt_targets, reference=reference)
    return [collator(store, [[(d, 0, lengths[d])] for d in part]) for part in splits]


def _grad(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _step(name, splits, forward=None, reference=None, dist=None):
    store, objective = _store(), _objective(name)
    model = _model()
    live = None if reference is not None else LiveReference(tiny_gpt(V, attention="segmented"))
    trainer = Trainer(
        model, [], TrainConfig(progress=False, device="cpu"), output_dir="unused",
        placement=Placement("cpu", dist, forward), parts=StepParts(objective=PreferenceSteps(objective, live)),
    )  # fmt: skip
    stats = trainer.forward_backward(_batches(store, objective, splits, reference))
    stats.read()
    return _grad(model), stats


@pytest.mark.parametrize("name", ["dpo", "simpo", "orpo"])
def test_one_batch_or_k_micro_batches_give_the_same_gradient_and_metrics(name):
    whole_grad, whole = _step(name, [list(range(N))])
    grad, split = _step(name, [[0, 1, 2], [3], [4, 5, 6, 7]])
    assert (grad - whole_grad).abs().max() <= 1e-6 * whole_grad.abs().max()
    for key in ("loss", *METRICS, "pairs"):
        assert split[key] == pytest.approx(whole[key], rel=1e-6, abs=1e-7), key
    assert whole["pairs"] == N and whole["record"]["pairs"] == N


def test_a_batch_split_by_rows_after_running_out_of_memory_keeps_its_gradient():
    from test_passes import ForwardOOM  # the out-of-memory injector of the passes' own tests

    whole_grad, whole = _step("dpo", [list(range(N))])
    model_forward = {}

    def oom_forward(model):
        model_forward["f"] = ForwardOOM(model, max_rows=3)
        return model_forward["f"]

    store, objective = _store(), _objective("dpo")
    model = _model()
    trainer = Trainer(
        model, [], TrainConfig(progress=False, device="cpu"), output_dir="unused",
        placement=Placement("cpu", None, oom_forward(model)),
        parts=StepParts(objective=PreferenceSteps(objective, LiveReference(tiny_gpt(V, attention="segmented")))),
    )  # fmt: skip
    stats = trainer.forward_backward(_batches(store, objective, [list(range(N))]))
    stats.read()
    assert model_forward["f"].refused >= 1 and stats["oom_splits"] >= 1
    assert (_grad(model) - whole_grad).abs().max() <= 1e-6 * whole_grad.abs().max()
    assert stats["loss"] == pytest.approx(whole["loss"], rel=1e-6)


def test_the_precomputed_reference_is_the_live_one_and_the_starting_weights():
    store, objective = _store(), _objective("dpo")
    start = tiny_gpt(V, attention="segmented")
    batches = _batches(store, objective, [[0, 1, 2, 3], [4, 5, 6, 7]])
    table = reference_table(start, batches, num_pairs=N, device=torch.device("cpu"))
    live = LiveReference(start)
    for b in batches:
        assert torch.allclose(torch.as_tensor(table[list(b.pairs.ids)]).float(), live.logps(b), atol=1e-5)
    live_grad, live_stats = _step("dpo", [list(range(N))])
    pre_grad, pre_stats = _step("dpo", [list(range(N))], reference=table)
    assert (pre_grad - live_grad).abs().max() <= 1e-5 * live_grad.abs().max()
    assert pre_stats["rewards/margins"] == pytest.approx(live_stats["rewards/margins"], rel=1e-5)
    assert live.model is not start and not any(p.requires_grad for p in live.model.parameters())


def test_under_lora_the_reference_is_the_base_with_the_adapters_off(tmp_path):
    pytest.importorskip("peft")
    import transformers

    from densebatch.config import LoraConfig
    from densebatch.model.hf.adapter import HFCausalLM
    from densebatch.model.hf.lora import apply_lora
    from densebatch.testing.models import two_layer_config

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(two_layer_config("llama", vocab_size=V)).save_pretrained(tmp_path / "m")
    base = HFCausalLM(tmp_path / "m").eval()
    model = HFCausalLM(tmp_path / "m")
    apply_lora(model, LoraConfig(r=4), [])
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.add_(0.1)  # the adapters moved: the model is no longer its base
    live = LiveReference(model)
    assert live.model is model  # no second copy
    store, objective = _store(), _objective("dpo")
    (batch,) = _batches(store, objective, [list(range(N))])
    from densebatch.train.objectives.pair_logps import pair_logps

    with torch.no_grad():
        want = pair_logps(base.token_losses(batch), batch).sums
        moved = pair_logps(model.eval().token_losses(batch), batch).sums
    assert torch.allclose(live.logps(batch), want, atol=1e-5) and not torch.allclose(moved, want, atol=1e-3)


def test_evaluation_reports_the_objectives_loss_and_trls_metrics():
    store, objective = _store(), _objective("dpo")
    batches = _batches(store, objective, [[0, 1, 2], [3, 4, 5, 6, 7]])
    trainer = Trainer(
        _model(), [], TrainConfig(progress=False, device="cpu"), output_dir="unused",
        evaluation=Evaluation(data=batches),
        parts=StepParts(objective=PreferenceSteps(objective, LiveReference(tiny_gpt(V, attention="segmented")))),
    )  # fmt: skip
    rec = trainer.evaluate_batches(batches).as_dict()
    assert set(METRICS) <= set(rec) and rec["pairs"] == N and 0.0 < rec["loss"] < 5.0
    _, stats = _step("dpo", [list(range(N))])
    assert rec["loss"] == pytest.approx(stats["loss"], rel=1e-5)  # eval mode, same weights: the step's loss


# ---------------------------------------------------------------------------------------- two ranks
def _rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as tdist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    tdist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        dist = Distributed(rank=rank, world_size=world)
        store, objective = _store(), _objective("dpo")
        start = tiny_gpt(V, attention="segmented")
        mine = [list(range(N))[rank::world]]  # this rank's pairs of the step
        table = reference_table(start, _batches(store, objective, mine), num_pairs=N, device=torch.device("cpu"), all_reduce_sum=dist.all_reduce_sum)  # fmt: skip
        model = _model()
        forward = torch.nn.parallel.DistributedDataParallel(TokenLosses(model))
        grad, stats = _step_with(model, forward, dist, mine, table)
        torch.save(
            {"grad": grad, "loss": stats["loss"], "margins": stats["rewards/margins"], "table": table}, f"{out}/rank{rank}.pt"
        )
    finally:
        tdist.destroy_process_group()


def _step_with(model, forward, dist, splits, table):
    store, objective = _store(), _objective("dpo")
    trainer = Trainer(
        model, [], TrainConfig(progress=False, device="cpu"), output_dir="unused",
        placement=Placement("cpu", dist, forward), parts=StepParts(objective=PreferenceSteps(objective, None)),
    )  # fmt: skip
    stats = trainer.forward_backward(_batches(store, objective, splits, table))
    stats.read()
    return _grad(model), stats


@pytest.mark.slow
def test_two_ranks_give_one_process_gradient(tmp_path):
    from support import free_port

    mp.spawn(_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    table = reference_table(tiny_gpt(V, attention="segmented"), _batches(_store(), _objective("dpo"), [list(range(N))]), num_pairs=N, device=torch.device("cpu"))  # fmt: skip
    grad, stats = _step_with(_model(), None, None, [list(range(N))], table)
    for got in ranks:
        assert np.allclose(got["table"], table, atol=1e-5)  # each rank scored its share; the sum is every pair
        assert (got["grad"] - grad).abs().max() <= 1e-5 * grad.abs().max()  # DDP's average: the whole step's
        assert got["loss"] == pytest.approx(stats["loss"], rel=1e-6)
        assert got["margins"] == pytest.approx(stats["rewards/margins"], rel=1e-5)  # a difference of sums of ~15
    assert copy.deepcopy(ranks[0]["loss"]) == ranks[1]["loss"]

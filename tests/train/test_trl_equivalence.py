"""Exact against TRL (fp32: TRL's configs default to bf16 autocast, set off here; one Hugging Face model and its weights, the same pairs as TRL tokenised them): each
pair's summed log-probabilities, and the loss (and gradient) of DPO (``DPOTrainer``), conservative DPO (TRL's
``aot`` at one pair a batch, whose form it is), SimPO (``CPOTrainer`` ``loss_type="simpo"``) and ORPO
(``ORPOTrainer``), within 1e-5; padded, packed and prompt-once layouts alike."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from densebatch.data.load.pair_collate import PairCollator, laid_lengths
from densebatch.data.store.pair_layout import pair_document, pair_spans
from densebatch.data.store.store import DocumentStore
from densebatch.testing.models import two_layer_config
from densebatch.train.objectives.losses import OBJECTIVES
from densebatch.train.objectives.pair_logps import chosen_sequence_nll, pair_logps

pytestmark = pytest.mark.slow
trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

# Answers of a few tokens: a sum of log-probabilities of ~50 in fp32 is exact to a few 1e-6, of ~120 only to ~1e-5.
PAIRS = [
    {"prompt": "What is 2+2?", "chosen": " 4", "rejected": " 5 or 6"},
    {"prompt": "Name a color:", "chosen": " blue", "rejected": " seven"},
    {"prompt": "Hi", "chosen": " hello", "rejected": " go"},
    {"prompt": "Write a very long prompt that takes many tokens before its short answers:", "chosen": " ok", "rejected": " no"},
]
BETA = 0.3


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    """A tiny Llama saved with a byte-level tokenizer; its weights moved a little from the saved (reference) ones."""
    from densebatch.data.prepare.tokenizer_files import byte_level_tokenizer

    d = tmp_path_factory.mktemp("trl")
    byte_level_tokenizer(["<|endoftext|>"], []).save(str(d / "tokenizer.json"))
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(d / "tokenizer.json"), eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(two_layer_config("llama")).save_pretrained(d / "m")
    tok.save_pretrained(d / "m")
    ref = transformers.AutoModelForCausalLM.from_pretrained(d / "m")
    policy = copy.deepcopy(ref)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return SimpleNamespace(dir=d, tok=tok, ref=ref, policy=policy)


def _hf(setting, weights):
    from densebatch.model.hf.adapter import HFCausalLM

    model = HFCausalLM(setting.dir / "m").eval()
    model.hf.load_state_dict(weights.state_dict())
    return model


def _store(rows: list[tuple[list[int], list[int], list[int]]]) -> DocumentStore:
    docs = [pair_document(np.array(p), np.array(c), np.array(r), chosen_loss=np.ones(len(c)), rejected_loss=np.ones(len(r))) for p, c, r in rows]  # fmt: skip
    return DocumentStore.from_documents(docs, meta={"eos_id": 256, "pad_id": 256, "pairs": True})


def _batches(store: DocumentStore, prompt_targets: bool = False):
    """The pairs in three layouts: one a row (padded), packed two a row, packed with the prompt laid twice."""
    prefixes = pair_spans(np.asarray(store.loss_mask), store.lengths)[:, 0]
    out = {}
    for name, shared, per_row in (("padded", True, 1), ("packed", True, 2), ("packed, prompt twice", False, 2)):
        n = laid_lengths(store.lengths, prefixes, shared)
        rows = [[(d, 0, int(n[d])) for d in range(k, min(len(store), k + per_row))] for k in range(0, len(store), per_row)]
        out[name] = PairCollator(256, shared=shared, prompt_targets=prompt_targets)(store, rows)
    return out


def _dpo_trainer(setting, **kw):
    args = trl.DPOConfig(
        output_dir=str(setting.dir / "out"), per_device_train_batch_size=len(PAIRS), beta=BETA, report_to=[], use_cpu=True,
        max_length=None, save_strategy="no", bf16=False, **kw,
    )  # fmt: skip
    return trl.DPOTrainer(
        model=copy.deepcopy(setting.policy), ref_model=copy.deepcopy(setting.ref), args=args,
        train_dataset=datasets.Dataset.from_list(PAIRS), processing_class=setting.tok,
    )  # fmt: skip


def test_pair_logps_and_the_dpo_loss_and_gradient_equal_trls(setting):
    tr = _dpo_trainer(setting)
    rows = [(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in tr.train_dataset]
    inputs = tr.data_collator(list(tr.train_dataset))
    trl_c, trl_r = tr.compute_ref_log_probs(tr.model, inputs)  # TRL's per-pair sums, on the model it is given
    loss = tr.compute_loss(tr.model, inputs)
    loss.backward()
    trl_grad = {n: p.grad.clone() for n, p in tr.model.named_parameters()}
    policy, ref = _hf(setting, setting.policy), _hf(setting, setting.ref)
    dpo = OBJECTIVES["dpo"](beta=BETA)
    for name, batch in _batches(_store(rows)).items():
        with torch.no_grad():
            ref_sums = pair_logps(ref.token_losses(batch), batch).sums
        policy.zero_grad()
        sums = pair_logps(policy.token_losses(batch), batch)
        assert (sums.chosen - trl_c).abs().max() < 1e-5 and (sums.rejected - trl_r).abs().max() < 1e-5, name
        ours = dpo.pair_losses(sums, ref_sums).losses.mean()
        assert abs(float(ours) - float(loss)) < 1e-5, name
        ours.backward()
        for n, p in policy.hf.named_parameters():
            assert (p.grad - trl_grad[n]).abs().max() < 1e-5, (name, n)


def test_conservative_dpo_equals_trls_form_of_it(setting):
    """TRL 1.x's DPO sigmoid loss no longer reads label_smoothing; its ``aot`` loss keeps conservative DPO's
    form, and at one pair a batch (nothing to sort) it is conservative DPO itself."""
    tr = _dpo_trainer(setting, loss_type=["aot"], label_smoothing=0.2)
    policy, ref = _hf(setting, setting.policy), _hf(setting, setting.ref)
    cdpo = OBJECTIVES["dpo"](beta=BETA, label_smoothing=0.2)
    for row in tr.train_dataset:
        want = tr.compute_loss(tr.model, tr.data_collator([row]))
        batch = PairCollator(256)(_store([(row["prompt_ids"], row["chosen_ids"], row["rejected_ids"])]), [[(0, 0, len(row["prompt_ids"]) + len(row["chosen_ids"]) + len(row["rejected_ids"]) + 1)]])  # fmt: skip
        with torch.no_grad():
            got = cdpo.pair_losses(pair_logps(policy.token_losses(batch), batch), pair_logps(ref.token_losses(batch), batch).sums)
        assert abs(float(got.losses.mean()) - float(want)) < 1e-5


def _experimental(setting, kind: str):
    """TRL's CPO (loss_type simpo) or ORPO trainer on PAIRS, its collated batch, and the pairs' tokens in it."""
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    common = dict(output_dir=str(setting.dir / kind), per_device_train_batch_size=len(PAIRS), beta=BETA, report_to=[], use_cpu=True, save_strategy="no", remove_unused_columns=False, bf16=False)  # fmt: skip
    if kind == "simpo":
        args, cls = CPOConfig(loss_type="simpo", cpo_alpha=0.7, simpo_gamma=0.4, label_smoothing=0.1, **common), CPOTrainer
    else:
        args, cls = ORPOConfig(**common), ORPOTrainer
    tr = cls(model=copy.deepcopy(setting.policy), args=args, train_dataset=datasets.Dataset.from_list(PAIRS), processing_class=setting.tok)  # fmt: skip
    batch = tr.data_collator(list(tr.train_dataset))
    rows = []
    for i in range(len(PAIRS)):
        seqs = []
        for side in ("chosen", "rejected"):
            ids = batch[f"{side}_input_ids"][i][batch[f"{side}_attention_mask"][i].bool()].tolist()
            labels = batch[f"{side}_labels"][i][: len(ids)].tolist()
            cut = next(j for j, x in enumerate(labels) if x != -100)
            seqs.append((ids[:cut], ids[cut:]))
        assert seqs[0][0] == seqs[1][0], "TRL laid the same prompt before both answers"
        rows.append((seqs[0][0], seqs[0][1], seqs[1][1]))
    return tr, batch, rows


@pytest.mark.parametrize("kind", ["simpo", "orpo"])
def test_simpo_and_orpo_losses_and_gradients_equal_trls(setting, kind):
    tr, batch, rows = _experimental(setting, kind)
    want, metrics = tr.get_batch_loss_metrics(tr.model, batch)
    want.backward()
    trl_grad = {n: p.grad.clone() for n, p in tr.model.named_parameters()}
    objective = OBJECTIVES[kind](beta=BETA, label_smoothing=0.1 if kind == "simpo" else 0.0, simpo_gamma=0.4, cpo_alpha=0.7)
    policy = _hf(setting, setting.policy)
    for name, b in _batches(_store(rows), prompt_targets=objective.prompt_targets).items():
        policy.zero_grad()
        losses = policy.token_losses(b)
        pl = objective.pair_losses(pair_logps(losses, b), None)
        targets = int(((b.pairs.answer >= 0) & (b.pairs.answer % 2 == 0)).sum()) + (int((b.pairs.prompt >= 0).sum()) if b.pairs.prompt is not None else 0)  # fmt: skip
        ours = pl.losses.mean() + objective.nll_weight * chosen_sequence_nll(losses, b) / targets
        assert abs(float(ours) - float(want)) < 1e-5, name
        assert abs(float(pl.chosen_rewards.mean()) - metrics["rewards/chosen"]) < 1e-5
        ours.backward()
        for n, p in policy.hf.named_parameters():
            assert (p.grad - trl_grad[n]).abs().max() < 1e-5, (name, n)

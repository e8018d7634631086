"""The baselines of the throughput benchmark: Hugging Face ``Trainer`` and the dense ceiling."""

from __future__ import annotations

import tempfile
import warnings

import numpy as np
import torch

from benchmarks.throughput.comparison import Run, Setup, build_hf_model
from benchmarks.throughput.interleave import StepTimer


class CountingCollator:
    """DataCollatorForSeq2Seq that remembers (real, slots, loss tokens) of every batch it builds, in order."""

    def __init__(self, inner):
        self.inner, self.log = inner, []

    def __call__(self, features):
        batch = self.inner(features)
        am, lab = batch["attention_mask"], batch["labels"]
        self.log.append((int(am.sum()), int(am.numel()), int((lab[:, 1:] != -100).sum())))
        return batch


def hf_features(store) -> list[dict]:
    """The store's documents as HF features: labels = token where it carries loss (HF shifts inside)."""
    feats = []
    for i in range(len(store)):
        tokens, loss_mask = store.document(i)
        ids = np.asarray(tokens, np.int64)
        labels = np.where(np.asarray(loss_mask) != 0, ids, -100)
        feats.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return feats


def build_hf_trainer(setup: Setup, strategy: str, features: list[dict], out: str, callbacks=(), trainer_cls=None):
    """(transformers.Trainer, its CountingCollator) as a user would set it up: default optimizer
    (``adamw_torch_fused``), ``DataCollatorForSeq2Seq`` right padding, ``train_sampling_strategy``."""
    from transformers import DataCollatorForSeq2Seq, GPT2TokenizerFast, Trainer, TrainingArguments

    tok = GPT2TokenizerFast(vocab_file=str(setup.gpt2_dir / "vocab.json"), merges_file=str(setup.gpt2_dir / "merges.txt"))
    tok.pad_token = tok.eos_token
    collator = CountingCollator(DataCollatorForSeq2Seq(tok, padding=True, label_pad_token_id=-100, return_tensors="pt"))
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=setup.hf_rows,
        max_steps=setup.warmup + setup.steps,
        learning_rate=setup.lr,
        weight_decay=0.1,
        adam_beta2=0.95,
        max_grad_norm=1.0,
        train_sampling_strategy=strategy,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_pin_memory=False,
        remove_unused_columns=False,
        seed=setup.seed,
        data_seed=setup.seed,
    )
    cls = trainer_cls or Trainer
    trainer = cls(
        model=build_hf_model(setup), args=args, train_dataset=features, data_collator=collator, callbacks=list(callbacks)
    )
    return trainer, collator


def run_hf(setup: Setup, strategy: str, features: list[dict], timer: StepTimer) -> Run:
    from transformers import TrainerCallback

    class Timer(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            timer.step_end()

    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer, collator = build_hf_trainer(setup, strategy, features, out, [Timer()])
        trainer.train()
    w = setup.warmup
    wall, cpu = timer.seconds(w)
    m = collator.log[w : w + setup.steps]  # batch k is step k (gradient_accumulation_steps = 1)
    return Run(f"hf_{strategy}", wall, [a for a, _, _ in m], [b for _, b, _ in m], [c for _, _, c in m], cpu)


def dense_rows(setup: Setup) -> tuple[torch.Tensor, torch.Tensor]:
    """Full rows of real tokens (the documents concatenated) and the data's loss mask, (steps, rows, T)."""
    rows, T = setup.plain_rows, setup.plain_len
    need = (setup.warmup + setup.steps) * rows * T
    toks = np.asarray(setup.store.tokens, np.int64)
    mask = np.asarray(setup.store.loss_mask, np.int64)
    reps = -(-need // len(toks))
    toks, mask = np.tile(toks, reps)[:need], np.tile(mask, reps)[:need]
    shape = (setup.warmup + setup.steps, rows, T)
    return torch.from_numpy(toks.reshape(shape)), torch.from_numpy(mask.reshape(shape))


def run_ceiling(setup: Setup, timer: StepTimer, loss_only: bool = False, fused: bool = False) -> Run:
    """Forward + backward + AdamW + clip of full rows (documents back to back, one causal sequence
    per row, no padding, no mask). ``fused``: AdamW's fused CPU kernel, HF Trainer's default
    optimizer (``adamw_torch_fused``); otherwise multi-tensor (foreach). ``loss_only``: through
    densebatch's ``HFCausalLM.token_losses`` with the data's loss mask instead of the HF model call."""
    from densebatch.batch import IGNORE_INDEX, Batch

    ids, mask = dense_rows(setup)
    steps, rows, T = ids.shape
    if loss_only:
        from densebatch.model import HFCausalLM

        torch.manual_seed(setup.seed)
        model = HFCausalLM(setup.model_dir)
    else:
        model = build_hf_model(setup)
    model.train()
    impl = {"fused": True} if fused else {"foreach": True}
    opt = torch.optim.AdamW(model.parameters(), lr=setup.lr, betas=(0.9, 0.95), weight_decay=0.1, **impl)
    positions = torch.arange(T).expand(rows, T)
    losstoks = []
    for s in range(steps):
        x = ids[s]
        if loss_only:
            labels = torch.full_like(x, IGNORE_INDEX)
            keep = mask[s][:, 1:] != 0
            labels[:, :-1] = torch.where(keep, x[:, 1:], labels[:, :-1])
            batch = Batch(x, labels, positions, int((labels != IGNORE_INDEX).sum()), x.numel())
            losses = model.token_losses(batch)
            (losses.sum() / max(1, batch.num_loss_tokens)).backward()
            losstoks.append(batch.num_loss_tokens)
        else:
            model(input_ids=x, labels=x, use_cache=False).loss.backward()
            losstoks.append(rows * (T - 1))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        timer.step_end()
    w = setup.warmup
    secs, cpu = timer.seconds(w)
    n = rows * T
    return Run(
        "ceiling_lossonly" if loss_only else "plain_fused" if fused else "ceiling",
        secs,
        [n] * setup.steps,
        [n] * setup.steps,
        losstoks[w:],
        cpu,
    )


def hf_window(setup: Setup, strategy: str, features: list[dict]) -> list[tuple[int, int, int]]:
    """(real, slots, loss tokens) of the batches HF Trainer's timed steps will see, without training:
    the Trainer's own dataloader, drawn right after construction as ``train()`` draws it."""
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer, collator = build_hf_trainer(setup, strategy, features, out)
        for i, _ in enumerate(trainer.get_train_dataloader()):
            if i + 1 >= setup.warmup + setup.steps:
                break
    return collator.log[setup.warmup : setup.warmup + setup.steps]


def hf_epoch_fill(lengths, rows: int, seed: int = 0) -> float:
    """Fill of a whole epoch of HF ``group_by_length`` batches of ``rows`` documents (its own grouping:
    mega-batches of 50 batches sorted by length), as opposed to the fill of a short timed window."""
    from transformers.trainer_pt_utils import get_length_grouped_indices

    lengths = np.asarray(lengths, np.int64)
    order = np.asarray(get_length_grouped_indices(lengths.tolist(), rows, generator=torch.Generator().manual_seed(seed)))
    batches = [lengths[order[i : i + rows]] for i in range(0, len(order), rows)]
    return float(sum(b.sum() for b in batches) / sum(len(b) * b.max() for b in batches))

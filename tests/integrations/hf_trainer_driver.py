"""``python hf_trainer_driver.py OUT BASE ACCUM [local]``: 3 steps of Hugging Face ``Trainer`` with ``densebatch.dense_batches``
on a tiny model, ``ACCUM`` batches a step; run by tests/integrations/test_hf_trainer.py alone and under torchrun (2 processes).
Writes ``OUT/rank-N.json`` per process (not stdout, where two ranks' lines can interleave): its rank, the world
size, the logged losses and the trained weights' sums. ``local``: ``average_tokens_across_devices=False`` (the
trainer then counts each rank's loss tokens alone; densebatch's loss path counts the step's over all ranks)."""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import transformers

import densebatch

if __name__ == "__main__":
    out, base, accum, local = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:] == ["local"]
    model = transformers.AutoModelForCausalLM.from_pretrained(base, attn_implementation=densebatch.register_attention())
    rng = np.random.default_rng(1)
    ds = [rng.integers(3, 259, int(n)).tolist() for n in rng.integers(5, 300, 60)]
    args = transformers.TrainingArguments(
        output_dir=out, max_steps=3, learning_rate=1e-3, seed=5, report_to=[], use_cpu=True, save_strategy="no",
        logging_steps=1, disable_tqdm=True, lr_scheduler_type="constant", gradient_accumulation_steps=accum,
        average_tokens_across_devices=not local,
    )  # fmt: skip
    trainer = transformers.Trainer(model=model, args=args, train_dataset=ds)
    densebatch.dense_batches(trainer, strategy="packed", seq_len=256, max_tokens_per_batch=512, pad_id=0)
    trainer.train()
    sums = [float(p.detach().double().sum()) for p in model.parameters()]
    logs = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    rank = int(os.environ.get("RANK", 0))
    record = {"rank": rank, "world": args.world_size, "logs": logs, "sums": sums}
    (Path(out) / f"rank-{rank}.json").write_text(json.dumps(record), encoding="utf-8")
    # Trainer leaves its process group (made through accelerate) open, and the DDP model it wrapped holds it: at
    # exit a gloo worker thread can then free a finished all-gather's tensors while the interpreter is going down,
    # and that rank aborts ("terminate called without an active exception": 2 in 20 runs of plain Trainer here,
    # pytorch/pytorch#190489). Free the trainer and close the group while Python is alive: its threads are joined.
    del trainer, model
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()

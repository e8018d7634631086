"""``torchrun ... shard_driver.py MODE[,MODE...] DIR``: a sharded checkpoint of an FSDP2 model written on N ranks, read on M.

Run by tests/train/checkpoint/test_sharded_checkpoint.py (and, with one process, in the test process itself):

- ``save DIR``: the reference GPT (seed 0) sharded with ``fully_shard`` over the ranks, two AdamW steps
  on seeded data, each followed by ``save_checkpoint`` (every rank writes its shards) into
  ``DIR/checkpoints``; then the whole model and optimizer state of step 2, gathered, into
  ``DIR/expected.safetensors`` (rank 0).
- ``load DIR``: the same model sharded over this run's ranks, the checkpoint read back (each rank only
  its rows), then the whole state gathered into ``DIR/loaded-<ranks>.safetensors`` (rank 0).
- ``build DIR``: the same model built on the meta device, sharded, then materialised rank by rank
  (``train/meta_init.py``); its whole weights gathered into ``DIR/built-<ranks>.safetensors`` (rank 0),
  with each rank's count of materialised parameter elements in ``DIR/built-<ranks>-rank<r>.json``.
- ``build-hf DIR``: each Hugging Face model ``DIR/hf-*`` (3 tokens added to its vocabulary), without and
  with LoRA adapters, built empty by ``run.build.hf_on_meta``, sharded, each rank reading its rows from
  the safetensors files and replaying the adapters' initialisation; gathered into
  ``DIR/built-hf-*[-lora].safetensors`` (rank 0), with 3 numbers drawn after it in ``...-draws.json``;
  the LoRA model's adapter saved as a final model is, in ``DIR/adapter-hf-*``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from densebatch.testing.models import tiny_gpt
from densebatch.train.checkpoint.manager import latest_valid, load_checkpoint, save_checkpoint
from densebatch.train.checkpoint.portable import load_model_state, load_optimizer_state, model_state, optimizer_state
from densebatch.train.distributed import Distributed, repeated_blocks
from densebatch.train.session import keyed

VOCAB = 101


def build(dist: Distributed):
    model = tiny_gpt(VOCAB)
    if dist.enabled:
        from torch.distributed.fsdp import fully_shard

        for block in repeated_blocks(model):
            fully_shard(block)
        fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def whole(state) -> dict[str, torch.Tensor]:
    """Every tensor of ``state`` whole (a collective for DTensors), by checkpoint key, on the CPU."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone() for k, v in keyed(state).items()}


def build_on_meta(root: Path, dist: Distributed) -> None:
    from torch.distributed.fsdp import fully_shard

    from densebatch.train.meta_init import materialise, record_init

    model, record = record_init(lambda: tiny_gpt(VOCAB))  # tiny_gpt seeds the generator itself
    assert all(p.is_meta for p in model.parameters())
    for block in repeated_blocks(model):
        fully_shard(block)
    fully_shard(model)
    torch.manual_seed(0)
    materialise(model, record, "cpu")
    local = sum(p.to_local().numel() for p in model.parameters())
    (root / f"built-{dist.world_size}-rank{dist.rank}.json").write_text(json.dumps({"local_numel": local}))
    state = whole(model_state(model))
    if dist.is_main:
        save_file({k: v.contiguous() for k, v in state.items()}, str(root / f"built-{dist.world_size}.safetensors"))


SEED = 5


def hf_model(path: Path, lora: int = 0, empty_weights: bool = False, after_load=None):
    """The Hugging Face model in ``path`` with 3 tokens added to its vocabulary (rows: the mean), LoRA
    adapters of rank ``lora`` when not 0, built after seeding with ``SEED``."""
    from densebatch.config import LoraConfig, ModelConfig
    from densebatch.model import build_model

    cfg = ModelConfig(kind="hf", path=str(path), lora=LoraConfig(r=lora))
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    torch.manual_seed(SEED)
    return build_model(cfg, vocab + 3, vocab, empty_weights=empty_weights, after_load=after_load)


def build_hf_from_files(root: Path, dist: Distributed) -> None:
    from torch.distributed.fsdp import fully_shard

    from densebatch.run.build import hf_on_meta
    from densebatch.run.final import gathered_adapter
    from densebatch.train.meta_init import materialise

    for path in sorted(root.glob("hf-*")):
        for lora in (0, 4):
            model, record, why = hf_on_meta(str(path), lambda lora=lora, path=path, **kw: hf_model(path, lora, **kw))
            assert why is None and all(p.is_meta for p in model.parameters()), why
            for block in repeated_blocks(model):
                fully_shard(block)
            fully_shard(model)
            torch.manual_seed(SEED)
            materialise(model, record, "cpu")
            draws = torch.rand(3).tolist()  # the generator where the whole build leaves it
            state = whole(model_state(model))
            if dist.is_main:
                name = f"built-{path.name}" + ("-lora" if lora else "")
                save_file({k: v.contiguous() for k, v in state.items()}, str(root / f"{name}.safetensors"))
                (root / f"{name}-draws.json").write_text(json.dumps(draws))
            if lora:  # its final form: PEFT's adapter, only the adapter gathered
                adapter = gathered_adapter(model)
                if dist.is_main:
                    model.save(root / f"adapter-{path.name}", adapter=adapter)


def main(mode: str, root: Path, dist: Distributed) -> None:
    if mode == "build":
        return build_on_meta(root, dist)
    if mode == "build-hf":
        return build_hf_from_files(root, dist)
    model, optim = build(dist)
    if mode == "save":
        g = torch.Generator().manual_seed(1)
        for step in (1, 2):
            ids = torch.randint(0, VOCAB, (4, 16), generator=g)
            positions = torch.arange(16).expand(4, 16)
            model(ids, positions).float().pow(2).mean().backward()  # any loss: the point is non-trivial optimizer state
            optim.step()
            optim.zero_grad()
            states = (model_state(model), optimizer_state(model, optim))
            save_checkpoint(
                root / "checkpoints",
                step=step,
                model_state=states[0],
                optimizer_state=states[1],
                extra_state={"note": "shard driver"},
                dist=dist,
            )
        out = root / "expected.safetensors"
    else:
        path = latest_valid(root / "checkpoints", dist=dist)
        targets = {"model": keyed(model_state(model)), "optimizer": keyed(optimizer_state(model, optim))}
        ck = load_checkpoint(path, targets=targets if dist.enabled else None, verified=True)
        load_model_state(model, ck.model_state)
        load_optimizer_state(model, optim, ck.optimizer_state)
        states = (model_state(model), optimizer_state(model, optim))
        out = root / f"loaded-{dist.world_size}.safetensors"
    tensors = {f"model.{k}": v for k, v in whole(states[0]).items()} | {f"optimizer.{k}": v for k, v in whole(states[1]).items()}
    if dist.is_main:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out))


if __name__ == "__main__":
    torch.set_num_threads(1)
    d = Distributed.from_environment("cpu")
    try:
        for mode in sys.argv[1].split(","):  # several modes in one launch: interpreter start-up is most of a test's time
            main(mode, Path(sys.argv[2]), d)
    finally:
        d.close()

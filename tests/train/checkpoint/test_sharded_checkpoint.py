"""Sharded checkpoints (FSDP2 on gloo, CPU): every rank writes its own rows, no pickle anywhere, and a
checkpoint written on 2 ranks reads back on 1 and on 3 equal tensor by tensor (tests/shard_driver.py)."""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support import subprocess_env, torchrun

from densebatch.train.checkpoint.dirs import sha256_file
from densebatch.train.checkpoint.manager import CheckpointWarning, latest_valid, load_checkpoint, verify

pytestmark = pytest.mark.slow
DRIVER = Path(__file__).resolve().parents[2] / "shard_driver.py"


def drive(mode: str, root: Path, nproc: int) -> None:
    if nproc == 1:  # one process needs no launcher: in this process
        import shard_driver

        from densebatch.train.distributed import Distributed

        shard_driver.main(mode, root, Distributed())
        return
    r = subprocess.run(
        torchrun([mode, str(root)], nproc, script=DRIVER), env=subprocess_env(), capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]


HF_KINDS = ("llama", "gpt2")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """One 2-process launch: the sharded checkpoint, the meta build and the Hugging Face builds."""
    root = tmp_path_factory.mktemp("shards")
    modes = "save,build"
    try:
        import transformers

        from densebatch.testing.models import two_layer_config

        for kind in HF_KINDS:
            torch.manual_seed(0)
            transformers.AutoModelForCausalLM.from_config(two_layer_config(kind)).save_pretrained(root / f"hf-{kind}")
        modes += ",build-hf"
    except ImportError:
        pass
    drive(modes, root, 2)
    return root


def test_each_rank_writes_its_own_rows_and_rank_0_the_index(saved):
    ck = saved / "checkpoints" / "step-000002"
    names = sorted(p.name for p in ck.iterdir())
    assert names == [
        "manifest.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "optimizer-00001-of-00002.safetensors", "optimizer-00002-of-00002.safetensors", "state.json",
    ]  # fmt: skip
    state = json.loads((ck / "state.json").read_text())
    assert state["format_version"] == 2 and state["writers"] == 2
    wte = state["parts"]["model"]["tensors"]["wte.weight"]
    assert wte["shape"] == [101, 32] and [(s["start"], s["rows"]) for s in wte["shards"]] == [(0, 51), (51, 50)]
    assert state["parts"]["model"]["aliases"] == {"lm_head.weight": "wte.weight"}  # tied: stored once
    whole = load_file(str(saved / "expected.safetensors"))
    model_bytes = sum(
        t.numel() * t.element_size() for k, t in whole.items() if k.startswith("model.") and k != "model.lm_head.weight"
    )
    for rank in (1, 2):  # each file about half the model: no rank wrote the whole
        size = (ck / f"model-0000{rank}-of-00002.safetensors").stat().st_size
        assert 0.45 * model_bytes < size < 0.55 * model_bytes + 8192, (size, model_bytes)
    manifest = json.loads((ck / "manifest.json").read_text())["files"]
    assert sorted(manifest) == [n for n in names if n != "manifest.json"]
    assert all(sha256_file(ck / n) == e["sha256"] for n, e in manifest.items())  # hashed while written


@pytest.mark.parametrize("nproc", [1, 3])
def test_a_checkpoint_of_two_ranks_loads_on_one_and_on_three_equal_tensor_by_tensor(saved, nproc):
    drive("load", saved, nproc)
    expected, loaded = load_file(str(saved / "expected.safetensors")), load_file(str(saved / f"loaded-{nproc}.safetensors"))
    assert expected.keys() == loaded.keys() and len(expected) > 100
    assert [k for k in expected if not torch.equal(expected[k], loaded[k])] == []


def test_a_missing_or_corrupt_shard_falls_back_to_the_previous_checkpoint(saved, tmp_path):
    for damage in ("missing", "flipped"):
        root = tmp_path / damage
        shutil.copytree(saved / "checkpoints", root)
        shard = root / "step-000002" / "optimizer-00002-of-00002.safetensors"
        if damage == "missing":
            shard.unlink()
        else:
            data = bytearray(shard.read_bytes())
            data[-5] ^= 0x01
            shard.write_bytes(bytes(data))
        why = "missing" if damage == "missing" else "SHA-256 mismatch"
        with pytest.warns(CheckpointWarning, match=f"step-000002: optimizer-00002-of-00002.safetensors {why}"):
            assert latest_valid(root) == root / "step-000001"


class Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "code ran"))


def test_a_planted_pickle_shard_is_refused_without_running(saved, tmp_path):
    root = tmp_path / "run"
    shutil.copytree(saved / "checkpoints", root)
    ck, marker = root / "step-000002", tmp_path / "marker"
    shard = ck / "model-00002-of-00002.safetensors"
    shard.write_bytes(pickle.dumps(Payload(marker)))
    manifest = json.loads((ck / "manifest.json").read_text())
    manifest["files"][shard.name] = {"size": shard.stat().st_size, "sha256": sha256_file(shard)}  # hashes that match
    (ck / "manifest.json").write_text(json.dumps(manifest))
    ok, why = verify(ck)
    assert not ok and why.startswith("model-00002-of-00002.safetensors: not a safetensors file"), why
    with pytest.raises(Exception, match="not a valid checkpoint"):
        load_checkpoint(ck)
    with pytest.warns(CheckpointWarning):
        assert latest_valid(root) == root / "step-000001"
    assert not marker.exists()


def test_a_model_built_on_meta_and_materialised_per_rank_is_bit_identical_to_the_whole_build(saved):
    """Two ranks materialise only their rows of the reference GPT (the meta build's record replayed on
    the CPU generator from the same seed): gathered, the weights equal a one-process build bit for bit."""
    tmp_path = saved
    from densebatch.testing.models import tiny_gpt

    built = load_file(str(tmp_path / "built-2.safetensors"))
    whole = tiny_gpt(101).state_dict()
    assert built.keys() == whole.keys()
    assert [k for k in whole if not torch.equal(whole[k], built[k])] == []
    total = sum(p.numel() for p in tiny_gpt(101).parameters())
    held = [json.loads((tmp_path / f"built-2-rank{r}.json").read_text())["local_numel"] for r in (0, 1)]
    assert sum(held) == total and max(held) < 0.55 * total  # each rank holds its half, no rank the model


def test_a_hugging_face_model_read_in_slices_per_rank_equals_from_pretrained(saved):
    """Two ranks each read only their rows of a Hugging Face model's safetensors weights (3 added tokens:
    their rows the mean of the others, computed from the file): gathered, equal to the one-process build
    (``from_pretrained`` and ``resize_vocab``) bit for bit; Llama with an untied head, GPT-2 tied. With
    LoRA adapters too: the adapters' initialisation replayed from the seed, PEFT's trainable rows of the
    added tokens filled, and the generator left where the whole build leaves it."""
    pytest.importorskip("peft")
    import shard_driver

    tmp_path = saved
    for kind in HF_KINDS:
        vocab = json.loads((tmp_path / f"hf-{kind}" / "config.json").read_text())["vocab_size"]
        for lora, suffix in ((0, ""), (4, "-lora")):
            model = shard_driver.hf_model(tmp_path / f"hf-{kind}", lora)
            draws = torch.rand(3).tolist()
            expected = model.state_dict()
            built = load_file(str(tmp_path / f"built-hf-{kind}{suffix}.safetensors"))
            assert built.keys() <= expected.keys() and len(built) > 10
            assert [k for k in built if not torch.equal(expected[k], built[k])] == []
            assert json.loads((tmp_path / f"built-hf-{kind}{suffix}-draws.json").read_text()) == draws
            emb = next(
                v for k, v in built.items() if ("embed_tokens" in k or "wte" in k) and "lora" not in k and "delta" not in k
            )
            assert emb.shape[0] == vocab + 3 and torch.equal(emb[-1], emb[:vocab].float().mean(0))
            if lora:
                adapters = {k: v for k, v in built.items() if "lora_A" in k or "trainable_tokens_delta" in k}
                assert len(adapters) >= 3 and all(v.abs().sum() > 0 for v in adapters.values())
                model.save(tmp_path / f"whole-adapter-{kind}")
                want = load_file(str(tmp_path / f"whole-adapter-{kind}" / "adapter_model.safetensors"))
                got = load_file(str(tmp_path / f"adapter-hf-{kind}" / "adapter_model.safetensors"))
                assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)

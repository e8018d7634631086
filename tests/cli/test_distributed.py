"""torchrun on CPU (gloo, 2 processes): the same steps and losses as one process, FSDP = DDP, a killed
worker ends the job and resumes bit for bit, a 2-process checkpoint continues on 1 process, two nodes
simulated on localhost.

Every run is the real CLI. Launches cost interpreter start-up (~5-15 s on two loaded cores), so the
runs are shared by the tests of this module through module-scoped fixtures.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from support import free_port, subprocess_env, torchrun, torchrun_node

from densebatch.cli import main

pytestmark = pytest.mark.slow
CONFIG = {
    "seed": 0,
    # 200 generated records -> ~81 short training documents; packed rows of 256, 2 rows a batch:
    # ~20 batches an epoch, so 16 steps of 2 batches cross into the next epoch.
    "data": {"default": {"num_records": 200}, "max_seq_len": 256, "chunk_records": 32},  # 7 chunks: both ranks prepare
    "batching": {"strategy": "packed", "max_tokens_per_batch": 512, "seq_len": 256},
    "model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 256},
    "train": {"max_steps": 16, "lr": 3e-3, "warmup_steps": 2, "progress": False, "device": "cpu"},
    "eval": {"accuracy_samples": 0, "max_batches": 1},  # a global cap: 2 processes score the batch 1 scores
    "checkpoint": {"every_steps": 4, "keep_last": 4},
}


def _config(tmp: Path, **sections) -> Path:
    cfg = json.loads(json.dumps(CONFIG))
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    cfg["data"]["cache_dir"] = str(tmp / "cache")
    path = tmp / f"cfg-{len(list(tmp.glob('cfg-*')))}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def launch(args: list[str], nproc: int = 2, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(torchrun(args, nproc), env=subprocess_env(), capture_output=True, text=True, timeout=timeout)


def why(r: subprocess.CompletedProcess) -> str:
    """A failed launch's story: every rank's own traceback lines first (torchrun prefixes them with
    ``[rankN]``; the rank that crashed first is often cut off the tail), then the tail."""
    ranks = [x for x in r.stderr.splitlines() if x.startswith("[rank") and "Traceback" not in x]
    # a worker that aborts (SIGABRT) prints its threads' Python stacks (PYTHONFAULTHANDLER): keep them whole
    marks = [i for m in ("Fatal Python error", "terminate called") if (i := r.stderr.find(m)) >= 0]
    fault = r.stderr[min(marks) : min(marks) + 8000] + "\n...\n" if marks else ""
    return "\n".join(ranks[:40]) + "\n...\n" + fault + r.stderr[-2000:]


def losses(out: Path) -> list[tuple[int, float]]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if r["kind"] == "train"]


def records(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def close(a, b, rel=1e-5) -> bool:
    return [s for s, _ in a] == [s for s, _ in b] and all(abs(x - y) <= rel * abs(y) for (_, x), (_, y) in zip(a, b))


def in_process(args: list[str]) -> int:
    """One-process runs in the test process (same thread count as the workers)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return main(args)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dist")


@pytest.fixture(scope="module")
def ddp(tmp) -> Path:
    r = launch(["train", str(_config(tmp)), f"--output_dir={tmp / 'ddp'}"])
    assert r.returncode == 0, why(r)
    return tmp / "ddp"


def test_ddp_equals_one_process_with_doubled_accumulation(tmp, ddp):
    assert in_process(["train", str(_config(tmp)), f"--output_dir={tmp / 'one'}", "--train.grad_accum_batches=2"]) == 0
    one, two = losses(tmp / "one"), losses(ddp)
    assert len(two) == 16 and close(two, one)
    # rank 0 alone writes metrics, with tokens over all ranks
    assert [r["real_tokens"] for r in records(ddp) if r["kind"] == "train"] == [
        r["real_tokens"] for r in records(tmp / "one") if r["kind"] == "train"
    ]
    assert (ddp / "final" / "model.safetensors").is_file()
    evals = [[r for r in records(d) if r["kind"] == "eval"] for d in (ddp, tmp / "one")]
    assert [(r["tokens"], r["batches"]) for r in evals[0]] == [(r["tokens"], 1) for r in evals[1]]  # eval.max_batches 1
    assert all(abs(a["loss"] - b["loss"]) <= 1e-5 * b["loss"] for a, b in zip(*evals)) and evals[0]


def test_fsdp_equals_ddp_and_holds_half_the_state_per_rank(tmp, ddp):
    r = launch(["train", str(_config(tmp)), f"--output_dir={tmp / 'fsdp'}", "--train.distributed=fsdp"])
    assert r.returncode == 0, why(r)
    # FSDP2 warns when the sharded module returns a view (an in-place op on it would skip the all-gather):
    # the loss head returns a tensor of its own
    assert "returned a view tensor" not in r.stderr, r.stderr[-3000:]
    assert close(losses(tmp / "fsdp"), losses(ddp))
    first = {d: next(x for x in records(d) if x["kind"] == "train") for d in (ddp, tmp / "fsdp")}
    ratio = first[tmp / "fsdp"]["rank_state_gb"] / first[ddp]["rank_state_gb"]
    assert 0.4 < ratio < 0.65, ratio  # parameters, gradients and AdamW state: about 1/N per rank
    # the final model is whole: the same file layout as a one-process run's
    from safetensors.torch import load_file

    a, b = load_file(str(ddp / "final" / "model.safetensors")), load_file(str(tmp / "fsdp" / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in a)


def test_fsdp_accumulation_reduces_once_a_step_and_bf16_shards_train_like_one_process(tmp):
    """Under FSDP2 with 2 micro-batches a step, each FSDP unit (2 blocks and the root) reduce-scatters its
    gradients once a step, not after every micro-batch; with train.precision bf16 the shards are
    all-gathered in bf16 (MixedPrecisionPolicy) and the losses stay within bf16 rounding of one process
    with the same 4 batches a step in fp32."""
    import sys

    from support import BIN

    steps, counts = 4, tmp / "counts"
    cfg = _config(tmp, train={"max_steps": steps, "grad_accum_batches": 2})
    driver = Path(__file__).parent / "collective_driver.py"
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", "--no-python", sys.executable, str(driver)]
    args = ["train", str(cfg), f"--output_dir={tmp / 'fsdp-bf16'}", "--train.distributed=fsdp", "--train.precision=bf16"]
    env = subprocess_env() | {"DENSEBATCH_COUNTS": str(counts)}
    r = subprocess.run([*cmd, *args], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, why(r)
    for rank in (0, 1):
        assert json.loads((counts / f"rank{rank}.json").read_text())["foreach_reduce"] == steps * 3
    one = ["train", str(cfg), f"--output_dir={tmp / 'one-accum4'}", "--train.grad_accum_batches=4"]
    assert in_process(one) == 0
    got, ref = losses(tmp / "fsdp-bf16"), losses(tmp / "one-accum4")
    assert [s for s, _ in got] == [s for s, _ in ref] == list(range(1, steps + 1))
    assert all(abs(x - y) <= 2e-2 * abs(y) for (_, x), (_, y) in zip(got, ref)), (got, ref)
    assert "bf16" in (tmp / "fsdp-bf16" / "config.yaml").read_text()


def test_token_driven_steps_and_idle_ranks_match_one_process(tmp):
    """loss_tokens_per_step decided globally: both ranks take the same steps as one process would,
    including epoch tails where one rank's share is a null batch (max_epochs 2, odd batch counts)."""
    cfg = _config(tmp, train={"max_steps": None, "max_epochs": 2.0, "loss_tokens_per_step": 60})
    r = launch(["train", str(cfg), f"--output_dir={tmp / 'tok2'}"])
    assert r.returncode == 0, why(r)
    assert in_process(["train", str(cfg), f"--output_dir={tmp / 'tok1'}"]) == 0
    two, one = losses(tmp / "tok2"), losses(tmp / "tok1")
    assert len(two) > 10 and close(two, one)
    batches = [r["batches"] for r in records(tmp / "tok2") if r["kind"] == "train"]
    assert any(b % 2 for b in batches), "no step with an odd number of batches: no rank was idle"


def _rank1_worker(p: subprocess.Popen) -> int:
    kids = [int(x) for x in Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()]
    for pid in kids:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if b"RANK=1" in env:
            return pid
    raise AssertionError(f"no rank-1 worker among {kids}")


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the rank-1 worker through /proc")
def test_a_killed_worker_ends_the_job_and_resume_is_bit_exact(tmp):
    cfg = _config(tmp, model={"dropout": 0.1})  # dropout draws from each rank's own RNG stream
    r = launch(["train", str(cfg), f"--output_dir={tmp / 'reference'}"])
    assert r.returncode == 0, why(r)
    out = tmp / "killed"
    p = subprocess.Popen(
        torchrun(["train", str(cfg), f"--output_dir={out}"]), env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 240
    while not ((out / "metrics.jsonl").exists() and len(losses(out)) >= 10):
        assert p.poll() is None and time.monotonic() < deadline, "the run ended before step 10"
        time.sleep(0.01)
    os.kill(_rank1_worker(p), signal.SIGKILL)
    t = time.monotonic()
    p.communicate(timeout=120)
    assert time.monotonic() - t < 30, "the job hung after a worker died"
    assert p.returncode != 0 and len(losses(out)) < 16
    r = launch(["train", str(cfg), f"--output_dir={out}", "--resume"])
    assert r.returncode == 0, why(r)
    assert losses(out) == losses(tmp / "reference")  # bit for bit, dropout included: every rank's RNG was saved


def test_a_two_process_checkpoint_continues_on_one_process_within_1e5(tmp, ddp):
    out = tmp / "elastic"
    shutil.copytree(ddp, out)
    for step in ("step-000012", "step-000016"):
        shutil.rmtree(out / "checkpoints" / step)
    shutil.rmtree(out / "final")
    assert in_process(["train", str(_config(tmp)), f"--output_dir={out}", "--resume"]) == 0
    resumed, reference = losses(out), losses(ddp)
    assert resumed[:8] == reference[:8]  # kept from before the checkpoint of step 8
    assert close(resumed, reference)  # steps 9-16 on one process with doubled accumulation
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["train"]["grad_accum_batches"] == 2


def test_two_nodes_on_localhost_equal_ddp(tmp, ddp):
    """Two torchrun commands with --nnodes=2 (c10d rendezvous on localhost), one process each."""
    out = tmp / "nodes"
    cmd = torchrun_node(free_port(), "densebatch-test", ["train", str(_config(tmp)), f"--output_dir={out}"])
    nodes = [
        subprocess.Popen(cmd, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)
    ]
    results = [n.communicate(timeout=300) for n in nodes]
    assert all(n.returncode == 0 for n in nodes), results[0][1][-2000:] + results[1][1][-2000:]
    assert close(losses(out), losses(ddp))


def test_an_fsdp_run_saves_shards_and_resumes_on_three_processes_within_1e5(tmp):
    """FSDP on 2 processes, 3 batches each a step (6 a step: 3 processes split them evenly), checkpoints
    written in the background; they hold each rank's shards and no pickle; the continuation from step 2
    on 3 processes equals the 2-process run's within 1e-5, step by step. (On 1 process:
    tests/train/checkpoint/test_sharded_checkpoint.py loads the same kind of checkpoint tensor by tensor, and
    test_a_two_process_checkpoint_continues_on_one_process_within_1e5 continues one through the CLI.)"""
    cfg = _config(tmp, train={"max_steps": 4, "grad_accum_batches": 3}, checkpoint={"every_steps": 2})
    ref = tmp / "fsdp-shards"
    r = launch(["train", str(cfg), f"--output_dir={ref}", "--train.distributed=fsdp", "--checkpoint.async=true"])
    assert r.returncode == 0, why(r)
    ck = ref / "checkpoints" / "step-000002"
    names = sorted(p.name for p in ck.iterdir())
    assert {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "state.json", "manifest.json"} <= set(names)
    assert all(n.endswith((".safetensors", ".json")) for n in names)
    out = tmp / "fsdp-on-3"
    shutil.copytree(ref, out)
    shutil.rmtree(out / "checkpoints" / "step-000004")
    shutil.rmtree(out / "final")
    r = launch(["train", str(cfg), f"--output_dir={out}", "--resume"], nproc=3)
    assert r.returncode == 0, why(r)
    assert "3 processes" in r.stdout, r.stdout[-2000:]  # the accumulation changed to keep the global batch
    resumed, reference = losses(out), losses(ref)
    assert resumed[:2] == reference[:2] and close(resumed, reference), (resumed, reference)


def test_an_fsdp_hugging_face_run_reads_its_weights_in_slices_and_from_pretrained_loads_its_final(tmp):
    """A Hugging Face Llama (safetensors, 2 added tokens) trained under FSDP on 2 processes: each rank
    read only its rows of the weights (the run says so), the final model is streamed to final/ (no rank
    gathers it whole) in the sharded layout of save_pretrained (files of 40 kB here, an index), and
    ``from_pretrained(final)`` gives the logits of the last checkpoint's weights. Its token budget is
    ``auto``: found after sharding, on the sharded model, both ranks probing and agreeing."""
    transformers = pytest.importorskip("transformers")
    import torch

    from densebatch.model.hf.adapter import HFCausalLM
    from densebatch.testing.models import tiny_config
    from densebatch.train.checkpoint.manager import load_checkpoint

    torch.manual_seed(0)
    config = tiny_config("llama", vocab_size=259, tie_word_embeddings=False, max_position_embeddings=256)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp / "hf-base")
    out = tmp / "hf-fsdp"
    args = [
        "train", str(_config(tmp, train={"max_steps": 4})), f"--output_dir={out}", "--train.distributed=fsdp",
        "--model.kind=hf", f"--model.path={tmp / 'hf-base'}", "--data.tokenizer=default", "--data.add_special_tokens=<|user|>,<|bot|>",
        "--batching.max_tokens_per_batch=auto", "--train.memory_limit_gb=4", "--finder.max_probes=3",
    ]  # fmt: skip
    import sys

    from support import BIN

    driver = Path(__file__).parent / "final_driver.py"  # final/ in files of at most 40 kB, as for a large model
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", "--no-python", sys.executable, str(driver)]
    r = subprocess.run([*cmd, *args], env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, why(r)
    built = r.stdout.index("model: built on the meta device; each of 2 ranks materialised only its shards")
    assert r.stdout.index("finding the token budget") > built and "limit per rank 3.600, 3.600 GB" in r.stdout, r.stdout
    budget = yaml.safe_load((out / "config.yaml").read_text())["batching"]["max_tokens_per_batch"]
    assert isinstance(budget, int) and budget >= 512 and f"auto → {budget}" in r.stdout
    final = out / "final"
    index = json.loads((final / "model.safetensors.index.json").read_text())
    files = sorted({*index["weight_map"].values()})
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors" and (final / "config.json").is_file()
    assert not (final / "model.safetensors").exists()
    saved = json.loads((final / "config.json").read_text())
    assert saved["architectures"] == ["LlamaForCausalLM"] and saved["dtype"] == "float32" and saved["vocab_size"] == 261
    loaded = transformers.AutoModelForCausalLM.from_pretrained(final).eval()
    trained = HFCausalLM(final).eval()  # the same architecture, weights then replaced by the checkpoint's
    trained.load_state_dict(load_checkpoint(out / "checkpoints" / "step-000004", parts=("model",)).model_state)
    ids = torch.randint(0, 261, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = trained.hf(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
    assert got.shape == want.shape and (got - want).abs().max().item() <= 1e-5


def test_fsdp_with_compiled_blocks_trains_like_ddp(tmp, ddp):
    """train.compile under FSDP2: the blocks are sharded, then compiled in place (``module.compile``: their
    whole ``__call__``, FSDP2's hooks included); the run compiles graphs, and its losses equal the eager
    DDP run's step by step (fp32, 1e-5)."""
    out = tmp / "fsdp-compiled"
    r = launch(["train", str(_config(tmp)), f"--output_dir={out}", "--train.distributed=fsdp", "--train.compile=true"])
    assert r.returncode == 0, why(r)
    m = re.search(r"compile: (\d+) graphs", r.stdout)
    assert m and int(m.group(1)) > 0, r.stdout[-2000:]
    assert close(losses(out), losses(ddp)), (losses(out), losses(ddp))


def test_bad_input_ends_every_rank_in_its_own_line(tmp):
    """A malformed line only rank 0's whole pass reports, and train.device cuda on a torch without it: each
    rank ends with densebatch's one line, exit code 2; before, the other rank died in a gloo barrier
    ("Connection closed by peer") or in torch.cuda.set_device, traceback and all."""
    from densebatch.data.prepare.default_dataset import generate_records

    lines = [json.dumps({k: r[k] for k in ("instruction", "input", "output")}) for r in generate_records(300)]
    lines[251] = "{broken"
    bad = tmp / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    import torch

    cases = [f"--data.path={bad}"] + ([] if torch.cuda.is_available() else ["--train.device=cuda"])
    for i, case in enumerate(cases):
        r = launch(["train", str(_config(tmp)), f"--output_dir={tmp / f'bad-{i}'}", case], timeout=180)
        assert r.returncode != 0 and "exitcode  : 2" in r.stderr, why(r)
        assert "densebatch: error: " in r.stderr, why(r)
        for crash in ("Connection closed by peer", "_cuda_setDevice", "[rank0]: Traceback", "[rank1]: Traceback"):
            assert crash not in r.stderr, why(r)

"""The misuse suite: ordinary mistakes a new user makes, each answered by exit code 2 and one line on
stderr (no traceback), with nothing on disk changed that the mistake should not change.

Every case runs ``densebatch.cli.main`` in process. Before it, the case's directory is snapshotted
(every file's bytes); afterwards the snapshot must be equal, except for the paths the case lists as
allowed to appear (none for most: a refused model must not even prepare data). The cases cover the
issue that asked for this suite (#20) and the README's promise that a mistake names the key and exits 2.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from cli_args import TINY, tiny
from support import shared_data_dir

from densebatch.cli import main


@dataclass
class Case:
    name: str
    args: Callable[[Path], list[str]]  # the command line, given the case's directory
    says: str  # a piece of the one line that must be printed
    setup: Callable[[Path], None] = lambda d: None  # files the user made before the mistake
    may_create: tuple[str, ...] = ()  # paths (relative to the directory) the refused command may leave
    needs: tuple[str, ...] = field(default=())  # "transformers", "shared"


def _run_args(d: Path, **leave_out: bool) -> list[str]:
    """``cli_args.tiny(**leave_out)``, into ``d``: a key set where it has no effect would add a note line."""
    return [*tiny(**leave_out), f"--output_dir={d / 'run'}", f"--data.cache_dir={d / 'cache'}"]


def _write(rel: str, text: str) -> Callable[[Path], None]:
    def make(d: Path) -> None:
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(text, encoding="utf-8")

    return make


def _hf_model(kind: str) -> Callable[[Path], None]:
    def make(d: Path) -> None:
        import transformers

        from densebatch.testing.models import tiny_config

        if kind == "bert":  # AutoModelForCausalLM would load it as BertLMHeadModel, which reads the future
            config = transformers.BertConfig(
                vocab_size=300, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
            )
            transformers.BertForMaskedLM(config).save_pretrained(d / kind)
        elif kind == "t5":
            config = transformers.T5Config(vocab_size=300, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
            transformers.T5ForConditionalGeneration(config).save_pretrained(d / kind)
        else:  # a causal LM with 100 embedding rows, fewer than the default tokenizer's 259 ids
            (d / kind).mkdir()
            (d / kind / "config.json").write_text(tiny_config("llama", vocab_size=100).to_json_string())

    return make


def _finished_run(d: Path) -> None:
    shutil.copytree(FINISHED, d / "run")


FINISHED: Path  # set by the module fixture: a 2-step run, trained once for every case that needs one
INSTRUCTIONS = "instruction-data.json"

CASES = [
    # -- the configuration (README: "a mistake names the key and exits with code 2")
    Case("unknown key", lambda d: ["train", "--train.max_stpes=3", *_run_args(d)], "did you mean 'train.max_steps'"),
    Case("wrong type", lambda d: ["train", "--train.max_steps=abc", *_run_args(d)], "train.max_steps"),
    Case("override without a value", lambda d: ["train", *_run_args(d), "--train.max_steps"], "has no value"),
    Case("missing config file", lambda d: ["train", str(d / "nope.yaml"), *_run_args(d)], "not found"),
    Case("invalid choice", lambda d: ["train", "--batching.strategy=dense", *_run_args(d)], "batching.strategy"),
    # -- the data
    Case("missing data file", lambda d: ["prepare", f"--data.path={d / 'none.jsonl'}", f"--data.cache_dir={d}/c"], "none.jsonl"),
    Case(
        "an empty JSON array",
        lambda d: ["prepare", f"--data.path={d / 'empty.json'}", f"--data.cache_dir={d}/c"],
        "empty.json",
        setup=_write("empty.json", "[]"),
    ),
    Case(
        "a CSV with other columns",
        lambda d: ["prepare", f"--data.path={d / 'data.csv'}", f"--data.cache_dir={d}/c"],
        "data.csv",
        setup=_write("data.csv", "question,answer\nWhat is 2+2?,4\nName a colour.,Red\n"),
    ),
    Case(
        "a malformed JSONL line",
        lambda d: ["prepare", f"--data.path={d / 'bad.jsonl'}", f"--data.cache_dir={d}/c"],
        "bad.jsonl:2",
        setup=_write("bad.jsonl", '{"instruction": "a", "input": "", "output": "b"}\n{not json\n'),
    ),
    # -- plans that leave nothing (or little) to learn from, and budget rules
    Case(
        "truncation that cuts every answer",
        lambda d: ["train", *_run_args(d), "--batching.long_docs=truncate", "--batching.seq_len=16"],
        "batching.long_docs: truncate would cut",
        may_create=("cache",),  # the documents must exist to count what is cut
    ),
    Case(
        "a token budget below the longest document, truncated",
        lambda d: [
            "train",
            *_run_args(d, packed=False),
            "--batching.strategy=token_budget",
            "--batching.long_docs=truncate",
            "--batching.max_tokens_per_batch=16",
        ],
        "batching.long_docs: truncate would cut",
        may_create=("cache",),
    ),
    Case(
        "analyze: a packed budget below one row",
        lambda d: ["analyze", *_run_args(d), "--batching.max_tokens_per_batch=128"],
        "batching.max_tokens_per_batch",
    ),
    Case(
        "train: a packed budget below one row",
        lambda d: ["train", *_run_args(d), "--batching.max_tokens_per_batch=128"],
        "batching.max_tokens_per_batch",
    ),
    Case(
        "truncation of the instruction data to 64 tokens",
        lambda d: [
            "train",
            *_run_args(d, default_data=False),
            f"--data.path={shared_data_dir() / INSTRUCTIONS}",
            "--batching.long_docs=truncate",
            "--batching.seq_len=64",
            "--batching.max_tokens_per_batch=256",
        ],
        "batching.long_docs: truncate would cut",
        may_create=("cache",),
        needs=("shared",),
    ),
    # -- models: refused before any data is prepared
    Case(
        "a BERT directory",
        lambda d: ["train", *_run_args(d, gpt=False), "--model.kind=hf", f"--model.path={d / 'bert'}"],
        "BertForMaskedLM",
        setup=_hf_model("bert"),
        needs=("transformers",),
    ),
    Case(
        "a T5 directory",
        lambda d: ["train", *_run_args(d, gpt=False), "--model.kind=hf", f"--model.path={d / 't5'}"],
        "encoder-decoder",
        setup=_hf_model("t5"),
        needs=("transformers",),
    ),
    Case(
        "a model directory that does not exist",
        lambda d: ["train", *_run_args(d, gpt=False), "--model.kind=hf", f"--model.path={d / 'nowhere'}"],
        "nowhere",
    ),
    Case(
        "a tokenizer larger than the model's vocabulary",
        lambda d: [
            "train",
            *_run_args(d, gpt=False),
            "--model.kind=hf",
            f"--model.path={d / 'small'}",
            "--data.tokenizer=default",
        ],
        "embedding rows",
        setup=_hf_model("small"),
        may_create=("cache",),  # checked when the model is built: after the documents, before the first step
        needs=("transformers",),
    ),
    # -- the file system
    Case(
        "an output_dir whose parent is a file",
        lambda d: ["train", *TINY, f"--output_dir={d / 'blocker' / 'run'}", f"--data.cache_dir={d / 'cache'}"],
        "cannot be created",
        setup=_write("blocker", "a user's file"),
    ),
    Case(
        "an output_dir that is a file",
        lambda d: ["train", *TINY, f"--output_dir={d / 'blocker'}", f"--data.cache_dir={d / 'cache'}"],
        "cannot be created",
        setup=_write("blocker", "a user's file"),
    ),
    Case(
        "export into a directory that is not empty",
        lambda d: ["export", str(d / "run"), str(d / "mine")],
        "not empty",
        setup=lambda d: (_finished_run(d), _write("mine/notes.txt", "keep me")(d)),
    ),
    # -- runs
    Case(
        "train into a finished run without --resume or --overwrite",
        lambda d: ["train", *_run_args(d)],
        "--resume",
        setup=_finished_run,
    ),
    Case(
        "--resume and --overwrite together",
        lambda d: ["train", *_run_args(d), "--resume", "--overwrite"],
        "--overwrite",
        setup=_finished_run,
    ),
    Case("eval of a directory that does not exist", lambda d: ["eval", "--checkpoint", str(d / "gone")], "no such directory"),
    Case(
        "generate from a directory that is not a run",
        lambda d: ["generate", "--checkpoint", str(d), "--prompt", "hi"],
        "neither a saved model",
    ),
    Case(
        "generate zero tokens",
        lambda d: ["generate", "--checkpoint", str(d / "run"), "--prompt", "hi", "--max-new-tokens", "0"],
        "--max-new-tokens",
        setup=_finished_run,
    ),
    Case("plot of a directory without metrics", lambda d: ["plot", str(d)], "metrics.jsonl"),
]


@pytest.fixture(scope="module", autouse=True)
def finished_run(tmp_path_factory):
    global FINISHED
    root = tmp_path_factory.mktemp("finished")
    args = ["train", *TINY, f"--output_dir={root / 'run'}", f"--data.cache_dir={root / 'cache'}", "--train.max_steps=2"]
    assert main(args) == 0
    FINISHED = root / "run"
    return FINISHED


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_mistake_is_one_line_exit_2_and_changes_nothing(case: Case, tmp_path, capsys):
    if "transformers" in case.needs:
        pytest.importorskip("transformers")
    if "shared" in case.needs and (shared_data_dir() is None or not (shared_data_dir() / INSTRUCTIONS).is_file()):
        pytest.skip("../shared/data is absent")
    case.setup(tmp_path)
    before = _snapshot(tmp_path)
    capsys.readouterr()  # what the setup printed (transformers' save progress)
    code = main(case.args(tmp_path))
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("densebatch: error: ") and case.says in err, err
    after = {k: v for k, v in _snapshot(tmp_path).items() if not any(k == p or k.startswith(p + "/") for p in case.may_create)}
    assert after == before, sorted(set(after) ^ set(before))
    assert json.dumps(sorted(after)) == json.dumps(sorted(before))

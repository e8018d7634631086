"""`eval` and `generate` use the run's own tokenizer, template and settings (run/owned.py).

- eval: with no CONFIG it scores exactly as with the run's own config.yaml; a CONFIG (or an override)
  that sets a run-owned key (tokenizer, template, model, ...) gets one note per key on stderr and the
  run's value is used, so the loss is the run's; CONFIG still chooses which data is scored.
- generate: --prompt goes through the run's template (alpaca, chatml, chat_template, custom with one
  field or a JSON object of several); the ids the model receives are checked exactly, and the greedy
  output equals Hugging Face's `generate` on the same templated prompt from the exported model.
(tests/cli/test_generate_cli.py checks the alpaca template against greedy decoding of the saved model.)
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from cli_args import TINY

import densebatch.run.commands as commands
from densebatch.cli import main
from densebatch.config import RunConfig, SourceConfig, load_config
from densebatch.data.prepare.pipeline import prepare
from densebatch.data.prepare.tokenizer_files import byte_level_tokenizer
from densebatch.data.prepare.tokenizers import load_tokenizer
from densebatch.errors import UserError
from densebatch.run.owned import eval_view, prompt_for

CHAT_TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "prepare" / "chat_templates"
PROMPT = "What is 7 plus 5?"
CHATML_PROMPT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def _train(tmp: Path, name: str, *args: str) -> Path:
    out = tmp / name
    assert main(["train", f"--output_dir={out}", f"--data.cache_dir={tmp / 'cache'}", "--train.max_steps=2", *TINY, *args]) == 0
    return out


def _chats(path, n: int = 60):
    rows = []
    for i in range(n):
        a, b = i % 9 + 1, i // 9 + 2
        messages = [{"role": "user", "content": f"What is {a} plus {b}?"}, {"role": "assistant", "content": str(a + b)}]
        rows.append(json.dumps({"messages": messages}) + "\n")
    path.write_text("".join(rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("owned")


@pytest.fixture(scope="module")
def alpaca_run(tmp):
    """The embedded default data (alpaca template, a bpe:1024 tokenizer learned from it)."""
    return _train(tmp, "alpaca")


@pytest.fixture(scope="module")
def chatml_run(tmp):
    """Chat messages with the chatml template on the byte-level tokenizer: its markers are added ids. Six
    steps at 3e-3 teach it to answer with a digit and <|im_end|>s (two steps only end the text at once)."""
    chats = _chats(tmp / "chats.jsonl")
    return _train(tmp, "chatml", f"--data.path={chats}", "--data.template=chatml", "--train.lr=3e-3", "--train.max_steps=6")


@pytest.fixture(scope="module")
def chat_template_run(tmp):
    """The same messages rendered by a tokenizer's own Jinja template (Qwen2's ChatML, tests/data/prepare/chat_templates)."""
    pytest.importorskip("transformers")
    d = tmp / "chat-tokenizer"
    d.mkdir()
    shutil.copy(CHAT_TEMPLATES / "chatml" / "tokenizer_config.json", d)
    byte_level_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], []).save(str(d / "tokenizer.json"))
    chats = _chats(tmp / "chats-t.jsonl")
    return _train(tmp, "chat-template", f"--data.path={chats}", "--data.template=chat_template", f"--data.tokenizer={d}"), d


def _eval(capsys, *args: str) -> tuple[dict, str]:
    capsys.readouterr()
    assert main(["eval", *args, "--json"]) == 0
    cap = capsys.readouterr()
    return json.loads(cap.out.strip().splitlines()[-1]), cap.err


def _config_like(run, path, **changes) -> str:
    """The run's config.yaml with some keys changed (``section__key=value``)."""
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    for key, value in changes.items():
        section, name = key.split("__")
        cfg[section][name] = value
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


# ------------------------------------------------------------------------------------------ eval
def test_eval_without_config_scores_as_the_runs_own_config(alpaca_run, capsys):
    alone, err = _eval(capsys, "--checkpoint", str(alpaca_run))
    own, err_own = _eval(capsys, str(alpaca_run / "config.yaml"), "--checkpoint", str(alpaca_run))
    assert err == err_own == ""  # nothing to report: the run's own keys
    assert alone == own and alone["tokens"] > 0
    last = [json.loads(x) for x in (alpaca_run / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in last if r["kind"] == "eval"][-1]
    assert alone["tokens"] == last["tokens"] and alone["loss"] == pytest.approx(last["loss"], abs=1e-5)


def test_a_config_naming_another_tokenizer_gets_the_runs_loss_and_a_note_per_key(alpaca_run, tmp, capsys):
    own, _ = _eval(capsys, "--checkpoint", str(alpaca_run))
    other = _config_like(alpaca_run, tmp / "other.yaml", data__tokenizer="default", data__template="chatml", model__n_layer=3)
    got, err = _eval(capsys, other, "--checkpoint", str(alpaca_run))
    assert got["loss"] == own["loss"] and got["tokens"] == own["tokens"]
    assert err.splitlines() == [
        "densebatch: note: CONFIG sets data.tokenizer='default' but the run used 'bpe:1024': using the run's",
        "densebatch: note: CONFIG sets data.template='chatml' but the run used 'alpaca': using the run's",
        "densebatch: note: CONFIG sets model.n_layer=3 but the run used 1: using the run's",
    ]
    # The control: that tokenizer makes other documents of the same records (what eval scored before).
    run_data = load_config(alpaca_run / "config.yaml", saved=True).data
    ours, theirs = prepare(run_data).eval, prepare(dataclasses.replace(run_data, tokenizer="default")).eval
    assert int(np.sum(theirs.lengths)) != int(np.sum(ours.lengths))
    # An override without CONFIG is a run-owned key too.
    got, err = _eval(capsys, "--checkpoint", str(alpaca_run), "--data.tokenizer=default", "--eval.max_batches=1")
    assert got["loss"] == own["loss"] and err.splitlines() == [
        "densebatch: note: an override sets data.tokenizer='default' but the run used 'bpe:1024': using the run's"
    ]


def test_a_config_chooses_which_data_is_scored_with_the_runs_learned_tokenizer(alpaca_run, tmp, capsys):
    own, _ = _eval(capsys, "--checkpoint", str(alpaca_run))
    more = _config_like(alpaca_run, tmp / "more.yaml", data__eval_fraction=0.2)
    got, err = _eval(capsys, more, "--checkpoint", str(alpaca_run))
    assert err == "" and got["tokens"] > own["tokens"]
    # Other records: a bpe:N tokenizer learned from them would be another one; the run's is used.
    default = yaml.safe_load((alpaca_run / "config.yaml").read_text())["data"]["default"]
    other = _config_like(alpaca_run, tmp / "other-data.yaml", data__default={**default, "seed": 99})
    got, err = _eval(capsys, other, "--checkpoint", str(alpaca_run))
    assert err == "" and got["tokens"] > 0 and got["loss"] != own["loss"]


def test_eval_view_takes_the_runs_keys_and_lists_the_others():
    run = RunConfig()
    run.data.sources = [
        SourceConfig(path="a.json", name="a", template="alpaca"),
        SourceConfig(path="chats.jsonl", name="chats", template="chatml"),
    ]
    run.data.add_tokens = ["<tool>"]
    given = RunConfig()
    given.data.path = "chats-2.jsonl"  # one file: matches no source by name, and not the run's two by position
    with pytest.raises(UserError, match="different templates .*a: alpaca, chats: chatml"):
        eval_view(given, run)
    given.data.path, given.data.tokenizer = None, "bpe:512"
    given.data.sources = [SourceConfig(path="other-chats.jsonl", name="chats", template="alpaca")]  # by name
    cfg, diffs = eval_view(given, run)
    assert [s.template for s in cfg.data.sources] == ["chatml"] and cfg.data.sources[0].path == "other-chats.jsonl"
    assert ("data.sources[0].template", "alpaca", "chatml") in diffs and ("data.tokenizer", "bpe:512", "auto") in diffs
    assert ("data.add_tokens", [], ["<tool>"]) in diffs
    # the run's added ids, in its order, whatever the given data's templates
    assert cfg.data.add_special_tokens == ["<|im_start|>", "<|im_end|>"] and cfg.data.add_tokens == ["<tool>"]
    given.data.sources = [SourceConfig(path="x.json", name="x"), SourceConfig(path="y.jsonl", name="y")]  # by position
    cfg, _ = eval_view(given, run)
    assert [s.template for s in cfg.data.sources] == ["alpaca", "chatml"]


# -------------------------------------------------------------------------------------- generate
@pytest.fixture
def sent(monkeypatch):
    """The prompt ids each `generate` hands the model."""
    calls: list[list[int]] = []
    real = commands.generate_ids

    def spy(model, ids, *args, **kwargs):
        calls.append(list(ids))
        return real(model, ids, *args, **kwargs)

    monkeypatch.setattr(commands, "generate_ids", spy)
    return calls


def _generate(capsys, run, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["generate", "--checkpoint", str(run), "--max-new-tokens", "12", *args])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_generate_sends_the_chatml_prompt_with_the_runs_added_markers(chatml_run, capsys, sent):
    tok = load_tokenizer(chatml_run / "final")
    start, end = tok.encode("<|im_start|>"), tok.encode("<|im_end|>")
    assert len(start) == len(end) == 1 and min(start + end) >= tok.base_vocab_size  # ids the run added
    rc, out, err = _generate(capsys, chatml_run, "--prompt", PROMPT)
    assert rc == 0 and err == ""
    assert sent[-1] == tok.encode(CHATML_PROMPT.format(PROMPT)) and sent[-1].count(start[0]) == 2
    rc, spelled, _ = _generate(capsys, chatml_run, "--prompt", CHATML_PROMPT.format(PROMPT), "--raw")
    assert spelled == out and sent[-1] == sent[-2]
    # a step checkpoint: the same tokenizer (rebuilt from the run's configuration) and prompt
    ckpt = sorted((chatml_run / "checkpoints").iterdir())[-1]
    assert _generate(capsys, ckpt, "--prompt", PROMPT)[1] == out and sent[-1] == sent[-3]


def test_greedy_generate_equals_hugging_face_generate_on_the_templated_prompt(chatml_run, tmp, capsys, sent):
    transformers = pytest.importorskip("transformers")
    exported = tmp / "chatml-hf"
    assert main(["export", str(chatml_run), str(exported)]) == 0
    tok = load_tokenizer(chatml_run / "final")
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    for prompt in (PROMPT, "What is 3 plus 4?"):
        rc, out, _ = _generate(capsys, chatml_run, "--prompt", prompt)
        ids = torch.tensor([tok.encode(CHATML_PROMPT.format(prompt))])
        assert sent[-1] == ids[0].tolist()
        with torch.no_grad():
            full = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12)
        new = [i for i in full[0, ids.shape[1] :].tolist() if i != tok.eos_id]
        assert rc == 0 and out == tok.decode(new) + "\n"
        assert len(new) == 12 and tok.encode("<|im_end|>")[0] in new  # a real continuation, through an added id


def test_generate_renders_the_tokenizers_chat_template_with_the_generation_prompt(chat_template_run, capsys, sent):
    transformers = pytest.importorskip("transformers")
    run, tokenizer_dir = chat_template_run
    rc, out, err = _generate(capsys, run, "--prompt", PROMPT)
    assert rc == 0 and err == ""
    auto = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    text = auto.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and "You are a helpful assistant." in text  # the template's own
    tok = load_tokenizer(run / "final")
    assert sent[-1] == tok.encode(text)
    assert _generate(capsys, run, "--prompt", text, "--raw")[1] == out


def _with_config(final: Path, dest: Path, **data) -> Path:
    """A copy of a final model whose config.yaml has other data.* values (the template is all generate reads)."""
    shutil.copytree(final, dest)
    cfg = yaml.safe_load((dest / "config.yaml").read_text())
    cfg["data"].update(data)
    (dest / "config.yaml").write_text(yaml.safe_dump(cfg))
    return dest


def test_generate_puts_the_prompt_in_a_custom_templates_fields(alpaca_run, tmp_path, capsys, sent):
    final = alpaca_run / "final"
    tok = load_tokenizer(final)
    one = _with_config(final, tmp_path / "one", template="custom", prompt_format="Q: {question}\nA: ")
    rc, out, err = _generate(capsys, one, "--prompt", PROMPT)
    assert rc == 0 and err == "" and sent[-1] == tok.encode(f"Q: {PROMPT}\nA: ")
    assert _generate(capsys, one, "--prompt", f"Q: {PROMPT}\nA: ", "--raw")[1] == out
    two = _with_config(final, tmp_path / "two", template="custom", prompt_format="Context: {context}\nQ: {question}\nA: ")
    rc, _, err = _generate(capsys, two, "--prompt", json.dumps({"question": PROMPT, "context": "sums"}))
    assert rc == 0 and sent[-1] == tok.encode(f"Context: sums\nQ: {PROMPT}\nA: ")
    for bad in (PROMPT, json.dumps({"question": PROMPT}), json.dumps({"question": "q", "context": "c", "extra": "x"})):
        n = len(sent)
        rc, _, err = _generate(capsys, two, "--prompt", bad)
        assert rc == 2 and len(sent) == n and len(err.splitlines()) == 1 and "Traceback" not in err
        assert "context, question" in err


def test_generate_with_mixed_templates_uses_the_first_sources_and_says_so(chatml_run, tmp_path, capsys, sent):
    sources = [{"path": "chats.jsonl", "name": "chats", "template": "chatml"}, {"path": "data.json", "name": "instr"}]
    mixed = _with_config(chatml_run / "final", tmp_path / "mixed", path=None, sources=sources, template="alpaca")
    rc, _, err = _generate(capsys, mixed, "--prompt", PROMPT)
    assert rc == 0 and sent[-1] == load_tokenizer(mixed).encode(CHATML_PROMPT.format(PROMPT))
    assert err.splitlines() == [
        "densebatch: note: the run's sources use different templates (chats: chatml, instr: alpaca); the prompt goes "
        "through the first source's (chats: chatml); --raw sends it verbatim"
    ]


def test_prompt_for_applies_the_runs_cleaning_and_refuses_an_empty_prompt():
    cfg = RunConfig().data
    cfg.clean.collapse_whitespace = True
    text, note = prompt_for("  Name   a colour.  ", cfg, None)
    assert note is None and "### Instruction:\nName a colour.\n\n### Response:\n" in text
    with pytest.raises(UserError, match="--prompt: field 'instruction' is empty"):
        prompt_for("   ", cfg, None)


def test_eval_of_an_eval_path_that_kept_nothing_says_so(chatml_run, tmp, capsys):
    """Every record of the eval file skipped: the message names that, not "set data.eval_path" (it is set)."""
    bad = tmp / "bad-eval.jsonl"
    bad.write_text("not json\n{also not\n")
    capsys.readouterr()
    args = ["--checkpoint", str(chatml_run), f"--data.eval_path={bad}", "--data.on_bad_record=skip"]
    assert main(["eval", *args]) == 2
    err = capsys.readouterr().err
    assert "no document of its eval_path was kept" in err and "set data.eval_path" not in err

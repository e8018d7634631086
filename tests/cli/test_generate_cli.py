"""`densebatch generate` prints what the model generates: the command's text equals greedy decoding with
``densebatch.model.generate`` of the same prompt (templated as the run's template, or verbatim with
--raw), from the saved model and tokenizer. (tests/cli/test_cli.py checks exit codes and messages.)"""

from __future__ import annotations

import pytest
import torch
from cli_args import TINY as BASE_TINY

from densebatch.cli import main
from densebatch.data.prepare.tokenizers import load_tokenizer
from densebatch.model import generate, load_model

TINY = [*BASE_TINY, "--train.lr=3e-3"]
PROMPT = "What is 7 plus 5?"
# The alpaca template (data/prepare/templates.py), written out: what the model sees without --raw.
ALPACA = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request."
    "\n\n### Instruction:\n{}\n\n### Response:\n"
)


@pytest.fixture(scope="module")
def final_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gen")
    args = ["train", f"--output_dir={tmp / 'out'}", f"--data.cache_dir={tmp / 'cache'}", "--train.max_steps=6", *TINY]
    assert main(args) == 0
    return tmp / "out" / "final"


def _expected(final_dir, prompt: str, n: int) -> str:
    model, tok = load_model(final_dir).eval(), load_tokenizer(final_dir)
    with torch.no_grad():
        new = generate(model, tok.encode(prompt), n, eos_id=tok.eos_id)
    return tok.decode(new)


@pytest.mark.slow
def test_generate_prints_greedy_decoding_of_the_templated_prompt_and_raw_differs(final_dir, capsys):
    run = lambda *extra: (
        main(["generate", "--checkpoint", str(final_dir), "--max-new-tokens", "16", *extra]),
        capsys.readouterr(),
    )  # noqa: E731
    rc, templated = run("--prompt", PROMPT)
    assert rc == 0 and templated.err == ""
    assert templated.out == _expected(final_dir, ALPACA.format(PROMPT), 16) + "\n"
    rc, again = run("--prompt", PROMPT)
    assert again.out == templated.out  # greedy: deterministic
    rc, raw = run("--prompt", PROMPT, "--raw")
    assert rc == 0 and raw.out == _expected(final_dir, PROMPT, 16) + "\n"
    assert raw.out != templated.out  # --raw really sends another prompt
    rc, spelled_out = run("--prompt", ALPACA.format(PROMPT), "--raw")  # the template by hand, sent verbatim
    assert spelled_out.out == templated.out
    rc, other = run("--prompt", "Name a colour.")
    assert other.out == _expected(final_dir, ALPACA.format("Name a colour."), 16) + "\n"
    assert _expected(final_dir, ALPACA.format(PROMPT), 16) != _expected(final_dir, ALPACA.format("Name a colour."), 16)

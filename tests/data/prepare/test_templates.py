"""Templates: alpaca byte for byte, chatml turns, raw, custom; segment flags; field errors."""

from __future__ import annotations

import pytest

from densebatch.config import DataConfig, FieldsConfig
from densebatch.data.prepare.templates import RecordError, prompt_text, render, render_text
from densebatch.errors import ConfigError

PREAMBLE = "Below is an instruction that describes a task. Write a response that appropriately completes the request."


def test_alpaca_record_0_of_the_book_byte_for_byte(book_records):
    rec = book_records[0]  # ../shared/data/instruction-data.json, or tests/fixtures/book/records.jsonl
    # The book's format_input (ch. 7) + "\n\n### Response:\n" + output, written out.
    expected = (
        f"{PREAMBLE}\n\n### Instruction:\n{rec['instruction']}"
        + (f"\n\n### Input:\n{rec['input']}" if rec["input"] else "")
        + f"\n\n### Response:\n{rec['output']}"
    )
    assert render_text(rec, DataConfig()) == expected
    assert render_text(rec, DataConfig()).startswith(
        "Below is an instruction that describes a task. Write a response that appropriately completes the request."
        "\n\n### Instruction:\nEvaluate the following phrase by transforming it into the spelling given."
    )


def test_alpaca_segments_and_optional_input():
    rec = {"instruction": "Do it.", "input": "", "output": "done"}
    assert render(rec, DataConfig()) == [(f"{PREAMBLE}\n\n### Instruction:\nDo it.\n\n### Response:\n", False), ("done", True)]
    rec2 = {"instruction": "Do it.", "input": "now", "output": "done"}
    assert render(rec2, DataConfig())[0][0].endswith("### Instruction:\nDo it.\n\n### Input:\nnow\n\n### Response:\n")
    assert render({"instruction": "Do it.", "output": "done"}, DataConfig()) == render(rec, DataConfig())  # absent input
    assert render({**rec, "input": None}, DataConfig()) == render(rec, DataConfig())  # null input = none
    assert render(rec, DataConfig(loss_on="all")) == [(f"{PREAMBLE}\n\n### Instruction:\nDo it.\n\n### Response:\ndone", True)]
    assert prompt_text(rec, DataConfig()) == render(rec, DataConfig())[0][0]


@pytest.mark.parametrize(
    "rec,reason",
    [
        ({"input": "", "output": "x"}, "missing_field"),
        ({"instruction": None, "output": "x"}, "null_field"),
        ({"instruction": "  ", "output": "x"}, "empty_field"),
        ({"instruction": 3, "output": "x"}, "wrong_type"),
        ({"instruction": "a", "input": ["x"], "output": "x"}, "wrong_type"),
        ({"instruction": "a", "output": ""}, "empty_field"),
    ],
)
def test_alpaca_field_errors(rec, reason):
    with pytest.raises(RecordError) as e:
        render(rec, DataConfig())
    assert e.value.reason == reason


def test_field_mapping():
    cfg = DataConfig(fields=FieldsConfig(instruction="q", output="a"))
    assert render({"q": "Why?", "a": "Because."}, cfg)[1] == ("Because.", True)


def test_chatml_layout_and_assistant_only_loss():
    rec = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye"},
            {"role": "assistant", "content": "Bye!"},
        ]
    }
    segs = render(rec, DataConfig(template="chatml"))
    assert "".join(t for t, _ in segs) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\nBye!<|im_end|>\n"
    )
    assert [t for t, f in segs if f] == ["Hello!<|im_end|>", "Bye!<|im_end|>"]
    assert all(f for _, f in render(rec, DataConfig(template="chatml", loss_on="all")))


@pytest.mark.parametrize(
    "rec,reason",
    [
        ({}, "missing_field"),
        ({"messages": None}, "null_field"),
        ({"messages": "hi"}, "wrong_type"),
        ({"messages": []}, "empty_field"),
        ({"messages": ["hi"]}, "wrong_type"),
        ({"messages": [{"role": "user"}]}, "missing_field"),
        ({"messages": [{"role": "user", "content": "only a question"}]}, "no_response"),
    ],
)
def test_chatml_errors(rec, reason):
    with pytest.raises(RecordError) as e:
        render(rec, DataConfig(template="chatml"))
    assert e.value.reason == reason


def test_raw_and_custom():
    assert render({"text": "hello"}, DataConfig(template="raw")) == [("hello", True)]
    cfg = DataConfig(template="custom", prompt_format="Q: {question} ({level})\nA: ")
    assert render({"question": "2+2?", "level": 1, "output": "4"}, cfg) == [("Q: 2+2? (1)\nA: ", False), ("4", True)]
    with pytest.raises(RecordError, match="question"):
        render({"output": "4", "level": 1}, cfg)
    with pytest.raises(ConfigError, match="prompt_format"):
        render({"output": "4"}, DataConfig(template="custom", prompt_format="Q: {}"))
    with pytest.raises(ConfigError, match="prompt_format"):
        render({"output": "4"}, DataConfig(template="custom", prompt_format="Q: {oops"))


def test_transform_applies_to_field_values_only():
    segs = render({"instruction": "a", "output": "b"}, DataConfig(), transform=str.upper)
    assert segs[0][0].startswith(PREAMBLE) and segs[0][0].endswith("### Instruction:\nA\n\n### Response:\n")
    assert segs[1] == ("B", True)

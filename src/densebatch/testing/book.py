"""The book's reference pieces (../shared/data/README.md): its prompt text, its tokenizer and its collate.

The collate equivalence test (tests/data/load/test_collate.py), the fixtures it falls back on
(tests/fixtures/make_fixtures.py) and the collate benchmark (benchmarks/planning/collate_bench.py)
compare densebatch with these.
"""

from __future__ import annotations

from pathlib import Path

ALPACA_HEAD = "Below is an instruction that describes a task. Write a response that appropriately completes the request."


def alpaca_text(rec: dict) -> str:
    """The book's prompt (format_input) followed by its response."""
    text = f"{ALPACA_HEAD}\n\n### Instruction:\n{rec['instruction']}"
    if rec.get("input"):
        text += f"\n\n### Input:\n{rec['input']}"
    return text + f"\n\n### Response:\n{rec['output']}"


def gpt2_tokenizer(gpt2_dir: Path):
    """GPT-2's byte-level BPE from ``gpt2_dir`` (vocab.json, merges.txt), no special tokens added: the
    ids the book's tiktoken encoding gives its texts."""
    from tokenizers import ByteLevelBPETokenizer

    return ByteLevelBPETokenizer(str(Path(gpt2_dir) / "vocab.json"), str(Path(gpt2_dir) / "merges.txt"))


def book_collate(batch, pad_token_id=50256, ignore_index=-100):
    """The book's custom_collate_fn (ch. 7), verbatim in behaviour: masks padding targets by *value*."""
    import torch

    batch_max_length = max(len(item) + 1 for item in batch)
    inputs_lst, targets_lst = [], []
    for item in batch:
        new_item = item.copy() + [pad_token_id]
        padded = new_item + [pad_token_id] * (batch_max_length - len(new_item))
        inputs, targets = torch.tensor(padded[:-1]), torch.tensor(padded[1:])
        indices = torch.nonzero(targets == pad_token_id).squeeze()
        if indices.numel() > 1:
            targets[indices[1:]] = ignore_index
        inputs_lst.append(inputs)
        targets_lst.append(targets)
    return torch.stack(inputs_lst), torch.stack(targets_lst)

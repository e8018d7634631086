"""GPT-2 token lengths of the ../shared/data sets, computed here (not via data/prepare/pipeline.py) and cached;
plus the book's reference collate, shared by the collate benchmark and the equivalence test.

Each length counts one appended end-of-text, as prepare stores documents. Cached as
``benchmarks/.cache/<name>.npy``. ``python benchmarks/shared_lengths.py`` prints a summary.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
CACHE = HERE / ".cache"
ALPACA_HEAD = "Below is an instruction that describes a task. Write a response that appropriately completes the request."


def shared_data_dir() -> Path | None:
    env = os.environ.get("DENSEBATCH_SHARED")
    for cand in ([Path(env) / "data"] if env else []) + [HERE.parents[1] / "shared" / "data"]:
        if (cand / "README.md").is_file():
            return cand
    return None


def gpt2_tokenizer(shared: Path):
    from tokenizers import ByteLevelBPETokenizer

    return ByteLevelBPETokenizer(str(shared / "gpt2" / "vocab.json"), str(shared / "gpt2" / "merges.txt"))


def alpaca_text(rec: dict) -> str:
    """The book's prompt (format_input) followed by its response."""
    text = f"{ALPACA_HEAD}\n\n### Instruction:\n{rec['instruction']}"
    if rec.get("input"):
        text += f"\n\n### Input:\n{rec['input']}"
    return text + f"\n\n### Response:\n{rec['output']}"


def chatml_text(rec: dict) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in rec["messages"])


def texts(name: str, shared: Path) -> list[str]:
    if name == "instruction":
        return [alpaca_text(r) for r in json.loads((shared / "instruction-data.json").read_text(encoding="utf-8"))]
    if name == "oasst":
        lines = (shared / "oasst-threads.jsonl").read_text(encoding="utf-8").splitlines()
        return [chatml_text(json.loads(line)) for line in lines if line.strip()]
    if name == "shakespeare":
        raw = (shared / "tinyshakespeare.txt").read_text(encoding="utf-8")
        return [p for p in raw.split("\n\n") if p.strip()]
    raise ValueError(f"unknown shared set {name!r}; expected instruction, oasst or shakespeare")


def shared_lengths(name: str) -> np.ndarray:
    """int64 lengths (end-of-text included) of one shared set: instruction, oasst or shakespeare."""
    path = CACHE / f"{name}.npy"
    if path.is_file():
        return np.load(path)
    shared = shared_data_dir()
    if shared is None:
        raise FileNotFoundError("../shared/data is absent (set DENSEBATCH_SHARED)")
    tok = gpt2_tokenizer(shared)
    lengths = np.array([len(e.ids) + 1 for e in tok.encode_batch(texts(name, shared))], dtype=np.int64)
    CACHE.mkdir(exist_ok=True)
    np.save(path, lengths)
    return lengths


if __name__ == "__main__":
    for n in ("instruction", "oasst", "shakespeare"):
        x = shared_lengths(n)
        print(
            f"{n:12s} n={len(x):6d} total={x.sum():8d} p50={np.percentile(x, 50):.0f} "
            f"p90={np.percentile(x, 90):.0f} max={x.max()}"
        )


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

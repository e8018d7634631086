"""Exact-match accuracy of generated answers to held-out prompts of the embedded default dataset.

Lives beside ``default_dataset.check_answer``; the data layer cannot import models, so the caller
hands in ``generate(prompts: list[list[int]]) -> list[list[int]]`` (new token ids per prompt,
greedy), which ``run`` builds from ``model.generate_batch``.
"""

from __future__ import annotations

from collections.abc import Callable

from densebatch.data.prepare.default_dataset import check_answer
from densebatch.data.prepare.templates import prompt_text

Generate = Callable[[list[list[int]]], list[list[int]]]


class AccuracyCheck:
    """``check(generate) -> {"accuracy", "accuracy_samples", "accuracy_<task>"...}`` over the first
    ``samples`` held-out records; ``show()`` prints accuracy by task and a few answers."""

    def __init__(self, records: list[dict], data_cfg, tokenizer, samples: int, chunk: int = 64):
        self.records = records[:samples]
        self.prompts = [tokenizer.encode(prompt_text(r, data_cfg)) for r in self.records]
        self.tokenizer, self.chunk = tokenizer, chunk
        self.samples: list[tuple[dict, str]] = []

    def __call__(self, generate: Generate) -> dict:
        if not self.records:
            return {}
        answers: list[str] = []
        eos = self.tokenizer.eos_id
        for i in range(0, len(self.prompts), self.chunk):
            new = generate(self.prompts[i : i + self.chunk])
            answers += [self.tokenizer.decode([t for t in ids if t != eos]) for ids in new]
        self.samples = list(zip(self.records, answers))
        out = {"accuracy": self._share(self.samples), "accuracy_samples": len(self.samples)}
        for task, pairs in sorted(self.by_task().items()):
            out[f"accuracy_{task}"] = self._share(pairs)
        return out

    @staticmethod
    def _share(pairs: list[tuple[dict, str]]) -> float:
        return sum(check_answer(r, a) for r, a in pairs) / max(1, len(pairs))

    def by_task(self) -> dict[str, list[tuple[dict, str]]]:
        out: dict[str, list[tuple[dict, str]]] = {}
        for record, answer in self.samples:
            out.setdefault(record.get("task", "all"), []).append((record, answer))
        return out

    def show(self, n: int = 4) -> str:
        tasks = self.by_task()
        lines = ["  by task: " + ", ".join(f"{k} {self._share(v):.2f} ({len(v)})" for k, v in sorted(tasks.items()))]
        for record, answer in self.samples[:n]:
            ok = "ok " if check_answer(record, answer) else "BAD"
            shown = record["input"] if len(record["input"]) <= 50 else "…" + record["input"][-47:]
            said = answer.strip() if len(answer.strip()) <= 40 else answer.strip()[:37] + "…"
            lines.append(f"  [{ok}] {record['instruction']} {shown!r} → {said!r} (expected {record['output']!r})")
        return "\n".join(lines)

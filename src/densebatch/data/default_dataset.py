"""The embedded default dataset: small instruction tasks with exact-match answers, from a seed.

``generate_records(num_records, seed)`` returns Alpaca records (``instruction``, ``input``,
``output``, plus ``task``) with no files and no network; the same arguments always give the same
list (``random.Random`` is stable across Python 3 versions). Every record's prompt (instruction +
input) is unique, so *any* split of the list into train and eval is disjoint by prompt.

The tasks are chosen so that a tiny GPT learns them within the default run's budget (about 800
steps, under 5 minutes on 2 CPU cores), and every answer is one short word checked by exact match
(``check_answer``). Measured while choosing them (4-layer width-128 GPT, ``bpe:1024``, 4,096-token
packed steps): the content-search tasks (``key``, ``color``) and ``upper`` reach 1.0 in 300-450
steps; ``parity`` in 400-800; copy tasks (reverse, first item, uppercase a word) and two-number
comparisons stayed near 0 after 900 steps on bytes and 700 on BPE, so they are not in the mix.

==========  ==============================================  ==========================
task        example (instruction / input)                   output
==========  ==============================================  ==========================
key         Does the text contain the word KEY? / passage   ``yes`` / ``no`` (half each)
color       Which color is named in the text? / passage     ``red`` ... ``white`` (6)
upper       Is the word written in capital letters? / word  ``yes`` / ``no``
parity      Is 4817 even or odd?                            ``odd``
==========  ==============================================  ==========================

Lengths are long-tailed: ``upper`` and ``parity`` records are short (165-190 bytes rendered); ``key``
and ``color`` carry passages of pseudo-words whose length is drawn from a log-normal (median ~250
bytes, up to 780), so rendered records run from ~165 bytes to ~1,000 (p50 ~330, p99 ~900).
"""

from __future__ import annotations

import math
import random

from densebatch.errors import ConfigError

VERSION = "tasks-v2"  # part of the prepare cache key: change it whenever the generated records change
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_COLORS = ("red", "green", "blue", "yellow", "black", "white")
MAX_PASSAGE_BYTES = 780


def _word(rng: random.Random, min_len: int = 3, max_len: int = 7) -> str:
    """A pronounceable pseudo-word: alternating consonants and vowels."""
    n = rng.randint(min_len, max_len)
    start = rng.random() < 0.8  # most words start with a consonant
    return "".join(rng.choice(_CONSONANTS if (i % 2 == 0) == start else _VOWELS) for i in range(n))


def _passage(rng: random.Random) -> list[str]:
    # Log-normal target length: a long tail of long passages over a bulk of short ones.
    target = min(MAX_PASSAGE_BYTES, max(150, int(math.exp(rng.gauss(math.log(250), 0.55)))))
    words, size = [], 0
    while True:
        w = _word(rng, 2, 7)
        if w in _COLORS:  # a pseudo-word can spell "red": it would make the color task ambiguous
            continue
        if size + len(w) + 1 > target:
            return words
        words.append(w)
        size += len(w) + 1


def _key(rng):
    words = _passage(rng)
    present = rng.random() < 0.5
    if present:
        words.insert(rng.randint(0, len(words)), "KEY")
    return "Does the text contain the word KEY?", " ".join(words), "yes" if present else "no"


def _color(rng):
    words, color = _passage(rng), rng.choice(_COLORS)
    words.insert(rng.randint(0, len(words)), color)
    return "Which color is named in the text?", " ".join(words), color


def _upper(rng):
    w = _word(rng, 3, 8)
    upper = rng.random() < 0.5
    return "Is the word written in capital letters?", w.upper() if upper else w, "yes" if upper else "no"


def _parity(rng):
    n = rng.randint(1000, 9999)
    phrase = rng.choice(("Is {} even or odd?", "Say whether {} is even or odd."))
    return phrase.format(n), "", "even" if n % 2 == 0 else "odd"


TASKS = {"key": (_key, 1.0), "upper": (_upper, 1.0), "color": (_color, 0.8), "parity": (_parity, 0.5)}


def generate_records(num_records: int = 6000, seed: int = 1234) -> list[dict]:
    """``num_records`` Alpaca records with unique prompts, the same for the same arguments."""
    rng = random.Random(seed)
    names = list(TASKS)
    weights = [TASKS[n][1] for n in names]
    seen: set[tuple[str, str]] = set()
    misses = {n: 0 for n in names}
    records: list[dict] = []
    while len(records) < num_records:
        if not names:
            raise ConfigError(
                f"data.default.num_records: the default tasks hold fewer than {num_records} unique prompts; ask for fewer records"
            )
        name = rng.choices(names, weights)[0]
        instruction, inp, output = TASKS[name][0](rng)
        if (instruction, inp) in seen:
            misses[name] += 1
            if misses[name] > 200:  # a small task (the opposites table) has run out of new prompts
                i = names.index(name)
                del names[i], weights[i]
            continue
        seen.add((instruction, inp))
        records.append({"instruction": instruction, "input": inp, "output": output, "task": name})
    return records


def check_answer(record: dict, generated_text: str) -> bool:
    """Exact match of the generated answer (up to an end-of-text marker, whitespace stripped)."""
    answer = generated_text.split("<|endoftext|>", 1)[0]
    return answer.strip() == str(record["output"]).strip()

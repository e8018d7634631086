"""The embedded default dataset: small instruction tasks with exact-match answers, from a seed.

``generate_records(num_records, seed)`` returns Alpaca records (``instruction``, ``input``,
``output``, plus ``task``) with no files and no network; the same arguments always give the same
list (``random.Random`` is stable across Python 3 versions). Every record's prompt (instruction +
input) is unique, so *any* split of the list into train and eval is disjoint by prompt.

The tasks are chosen so that a tiny GPT on the byte-level tokenizer learns them in a few hundred
steps, and every answer is short (at most 12 bytes) and checked by exact match (``check_answer``):

==========  ==============================================  ==========================
task        example input                                   output
==========  ==============================================  ==========================
upper       ``vomek``                                       ``VOMEK``
reverse     ``tiru``  (3-5 letters)                         ``urit``
repeat      ``kal``                                         ``kal kal``
first       ``dorat, pim, sule, bek``                       ``dorat``
last        ``dorat, pim, sule, bek``                       ``bek``
key         a passage of 150-780 bytes with ``KEY: lomi``   ``lomi``
tail        a passage of 150-780 bytes                      its last word
opposite    ``hot`` (a table of 30 pairs, 4 phrasings)      ``cold``
==========  ==============================================  ==========================

Lengths are long-tailed: most records are 190-260 bytes rendered; ``key`` and ``tail`` records carry
passages whose length is drawn from a log-normal (median ~250 bytes, up to 780), so the whole
rendered record stays under 1024 tokens of the byte-level tokenizer.
"""

from __future__ import annotations

import math
import random

from densebatch.errors import ConfigError

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_OPPOSITES = [
    ("hot", "cold"), ("big", "small"), ("fast", "slow"), ("up", "down"), ("left", "right"), ("open", "closed"),
    ("light", "dark"), ("happy", "sad"), ("early", "late"), ("full", "empty"), ("hard", "soft"), ("high", "low"),
    ("old", "new"), ("rich", "poor"), ("strong", "weak"), ("wet", "dry"), ("loud", "quiet"), ("thick", "thin"),
    ("near", "far"), ("long", "short"), ("clean", "dirty"), ("sharp", "dull"), ("in", "out"), ("win", "lose"),
    ("buy", "sell"), ("push", "pull"), ("give", "take"), ("first", "last"), ("true", "false"), ("day", "night"),
]
_OPPOSITE_OF = {a: b for a, b in _OPPOSITES} | {b: a for a, b in _OPPOSITES if b not in dict(_OPPOSITES)}
_OPPOSITE_PHRASES = (
    "What is the opposite of the word?", "Give the antonym of the word.",
    "Write the word that means the opposite.", "Name the opposite of this word.",
)
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
        if size + len(w) + 1 > target:
            return words
        words.append(w)
        size += len(w) + 1


def _upper(rng):
    w = _word(rng, 3, 8)
    return rng.choice(("Convert the word to uppercase.", "Write the word in capital letters.")), w, w.upper()


def _reverse(rng):
    w = _word(rng, 3, 5)
    return "Reverse the letters of the word.", w, w[::-1]


def _repeat(rng):
    w = _word(rng, 2, 5)
    return "Repeat the word twice, separated by a space.", w, f"{w} {w}"


def _items(rng):
    return [_word(rng, 2, 6) for _ in range(rng.randint(3, 6))]


def _first(rng):
    items = _items(rng)
    return "What is the first item in the list?", ", ".join(items), items[0]


def _last(rng):
    items = _items(rng)
    return "What is the last item in the list?", ", ".join(items), items[-1]


def _key(rng):
    words, answer = _passage(rng), _word(rng, 3, 7)
    words.insert(rng.randint(0, len(words)), f"KEY: {answer}")
    return "Find the word that follows KEY: in the text.", " ".join(words), answer


def _tail(rng):
    words = _passage(rng)
    return "What is the last word of the text?", " ".join(words), words[-1]


def _opposite(rng):
    word = rng.choice(sorted(_OPPOSITE_OF))
    return rng.choice(_OPPOSITE_PHRASES), word, _OPPOSITE_OF[word]


TASKS = {"upper": (_upper, 2.0), "reverse": (_reverse, 1.0), "repeat": (_repeat, 1.5), "first": (_first, 1.5),
         "last": (_last, 1.5), "key": (_key, 1.2), "tail": (_tail, 1.0), "opposite": (_opposite, 0.8)}


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
            raise ConfigError(f"data.default.num_records: the default tasks hold fewer than {num_records} unique prompts; "
                              f"ask for fewer records")
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

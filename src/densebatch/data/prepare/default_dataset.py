"""The embedded default dataset: small instruction tasks with exact-match answers, from a seed.

``generate_records(num_records, seed)`` returns Alpaca records (``instruction``, ``input``,
``output``, plus ``task``) with no files and no network; the same arguments always give the same
list (``random.Random`` is stable across Python 3 versions). Every record's prompt (instruction +
input) is unique, so *any* split of the list into train and eval is disjoint by prompt.

==========  =================================================  ======================================
task        example (instruction / input)                      output
==========  =================================================  ======================================
key         Does the text contain the word KEY? / passage      ``yes`` / ``no`` (half each)
color       Which color is named in the text? / passage        ``red`` ``green`` ``blue`` ``yellow``
upper       Is the word written in capital letters? / word     ``yes`` / ``no``
parity      Is the number in the text even or odd? / passage   ``even`` / ``odd`` (one digit)
==========  =================================================  ======================================

Every answer is one word, checked by exact match (``check_answer``). Lengths are long-tailed:
``upper`` records are short (about 175-200 bytes rendered); the others carry passages of
pseudo-words whose length is log-normal (median 70 bytes, up to 780), so rendered records run from
~175 bytes to ~1,000 (p50 ~245, p99 ~700): most short, a few long, and packing has work to do.

Why the tasks look like this (``tasks-v3``). The demo must teach a 4-layer GPT of width 128 every
task within about 3 minutes on 2 CPU cores. With ``tasks-v2`` (passages of median 250 bytes, six
colors, "Is 4817 even or odd?", 6,000 records, peak learning rate 3e-3, 800 steps) the color task
stayed near chance (0.37 on seed 0). What was found, one run each on seed 0 unless said
(``bpe:1024``, 4,096-slot packed steps, held-out accuracy by task):

- *color was memorised, not learned*: with color passages cut to a median of 80 bytes and 6,000
  records (each seen 5+ times), key, parity and upper reached 0.99-1.0 but color fell to 0.20,
  answering yellow / black / red whatever the passage while its training loss went to ~0.1: with
  the signal split over six answers and diluted over the passage, memorising each training
  passage's answer was the easier descent. Now 20,000 records, each seen ~1.3 times in 500 steps.
- *learning rate*: at 3e-3 with 30,000 records, early steps spiked (loss 1 → 3.5) and every task
  sat at chance for 550 steps; at 1e-3 (warm-up 50) key and upper reached 1.0 by step 200 and color
  by step 500 (``run/demo.py`` holds the schedule).
- *color, the last errors*: one color of six was never told apart (black answered "white", 67
  prompts of 300 wrong), and a color that came first in the input is a different BPE token
  (``green``, not `` green``): 5 of 20 such prompts right. Now four colors, never first.
- *parity by position never became reliable*: the answer hangs on one digit among several, found
  only by its position, a pattern the model found late or never (seed 0: at chance to step 800
  with the number in the instruction; 0.81-0.91 with the number as the input; with five digits,
  1.0 by step 500 on one data order and chance to step 650 on another; 0.85 on seed 1). Now the
  one number of the passage is a single digit, found by content like the color word; every task
  then reached 1.0 by step 300 (seed 0, eval loss 0.002).
- *running out of prompts* used to drop a task from the mix after 200 duplicate draws in total,
  which at 20,000+ records silently removed ``upper`` and ``parity`` half-way through the list; a
  task is now dropped only after 1,000 duplicates in a row (it really has no new prompts left).
- *pseudo-words starting with a color* ("redo") were tokenized by the learned BPE as `` red`` +
  ``o``, so ~3% of color passages named two colors to the model: such words are not generated.
- Shorter passages (median 70 bytes instead of 250) cost less compute per record: a step holds
  ~48 records instead of ~36.
- Copy tasks (reverse a word, first item, uppercase a word) and two-number comparisons stayed near
  0 after 900 steps on bytes and 700 on BPE with ``tasks-v1``: not in the mix.

The final settings' time and accuracy over several seeds are in the README.
"""

from __future__ import annotations

import math
import random

from densebatch.errors import ConfigError

VERSION = "tasks-v3"  # part of the prepare cache key: change it whenever the generated records change
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_COLORS = ("red", "green", "blue", "yellow")
MEDIAN_PASSAGE_BYTES = 70
MIN_PASSAGE_BYTES = 20
MAX_PASSAGE_BYTES = 780
_MAX_MISSES_IN_A_ROW = 1000  # duplicate prompts drawn in a row before a task counts as exhausted


def _word(rng: random.Random, min_len: int = 3, max_len: int = 7) -> str:
    """A pronounceable pseudo-word: alternating consonants and vowels."""
    n = rng.randint(min_len, max_len)
    start = rng.random() < 0.8  # most words start with a consonant
    return "".join(rng.choice(_CONSONANTS if (i % 2 == 0) == start else _VOWELS) for i in range(n))


def _passage(rng: random.Random) -> list[str]:
    # Log-normal target length: a long tail of long passages over a bulk of short ones.
    target = min(MAX_PASSAGE_BYTES, max(MIN_PASSAGE_BYTES, int(math.exp(rng.gauss(math.log(MEDIAN_PASSAGE_BYTES), 0.9)))))
    words, size = [], 0
    while True:
        w = _word(rng, 2, 7)
        # A word that is or starts with a color ("red", "redo") shows the model a color token.
        if w.startswith(_COLORS):
            continue
        if size + len(w) + 1 > target and words:
            return words
        words.append(w)
        size += len(w) + 1


def _key(rng):
    words = _passage(rng)
    present = rng.random() < 0.5
    if present:
        words.insert(rng.randint(1, len(words)), "KEY")  # never first: always the token " KEY"
    return "Does the text contain the word KEY?", " ".join(words), "yes" if present else "no"


def _color(rng):
    words, color = _passage(rng), rng.choice(_COLORS)
    # Never first: after a space the BPE token is always " green"; first in the input it would be
    # "green", a second token per color to learn (measured: 5 of 20 such prompts answered right).
    words.insert(rng.randint(1, len(words)), color)
    return "Which color is named in the text?", " ".join(words), color


def _upper(rng):
    w = _word(rng, 3, 8)
    upper = rng.random() < 0.5
    return "Is the word written in capital letters?", w.upper() if upper else w, "yes" if upper else "no"


def _parity(rng):
    words, digit = _passage(rng), rng.randint(0, 9)
    words.insert(rng.randint(1, len(words)), str(digit))  # never first: always the token " 7"
    return "Is the number in the text even or odd?", " ".join(words), "even" if digit % 2 == 0 else "odd"


# task -> (generator, weight in the mix)
TASKS = {"key": (_key, 0.8), "color": (_color, 1.2), "upper": (_upper, 0.8), "parity": (_parity, 1.0)}


def generate_records(num_records: int = 6000, seed: int = 1234) -> list[dict]:
    """``num_records`` Alpaca records with unique prompts, the same for the same arguments."""
    rng = random.Random(seed)
    names = list(TASKS)
    weights = [TASKS[n][1] for n in names]
    seen: set[tuple[str, str]] = set()
    misses = dict.fromkeys(names, 0)
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
            if misses[name] > _MAX_MISSES_IN_A_ROW:  # this task has no new prompts left
                i = names.index(name)
                del names[i], weights[i]
            continue
        misses[name] = 0
        seen.add((instruction, inp))
        records.append({"instruction": instruction, "input": inp, "output": output, "task": name})
    return records


_ANSWERS = {"key": ("yes", "no"), "color": _COLORS, "upper": ("yes", "no"), "parity": ("even", "odd")}


def as_pair(record: dict, index: int, seed: int) -> dict:
    """``record`` as a preference pair (``data.pairs``): its answer chosen, a wrong answer of its task rejected
    (the other one, or another color drawn from (seed, index)); instruction and input stay the prompt."""
    wrong = [a for a in _ANSWERS[record["task"]] if a != record["output"]]
    rejected = wrong[0] if len(wrong) == 1 else random.Random(f"{seed}:{index}").choice(wrong)
    return {**record, "chosen": record["output"], "rejected": rejected}


def check_answer(record: dict, generated_text: str) -> bool:
    """Exact match of the generated answer (up to an end-of-text marker, whitespace stripped)."""
    answer = generated_text.split("<|endoftext|>", 1)[0]
    return answer.strip() == str(record["output"]).strip()

"""Cleaning steps: each does what it says, is opt-in, and counts the records it changed or dropped."""

from __future__ import annotations

import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from densebatch.config import CleanConfig
from densebatch.data.prepare.clean import Cleaner, collapse_whitespace, remove_control_chars, strip_html


def test_strip_html():
    assert strip_html("<p>Hello <b>world</b> &amp; friends&nbsp;!</p>") == "\nHello world & friends\xa0!\n"
    assert strip_html("a<br>b<script>var x = 1;</script>c") == "a\nbc"
    assert strip_html("3 < 4 and 5 > 2") == "3 < 4 and 5 > 2"  # not a tag: unchanged
    assert strip_html("plain") == "plain"


def test_control_chars_and_whitespace():
    assert remove_control_chars("a\x00b\x1bc\r\nd\te") == "abc\nd\te"
    assert collapse_whitespace("  a \t b  \n\n\n\n c  ") == "a b\n\nc"


@given(st.text())
@settings(max_examples=200, deadline=None, derandomize=True)
def test_properties_of_text_steps(text):
    cleaned = remove_control_chars(text)
    assert all(c in "\n\t" or unicodedata.category(c) != "Cc" for c in cleaned)
    once = collapse_whitespace(text)
    assert collapse_whitespace(once) == once  # idempotent
    assert "\n\n\n" not in once and "  " not in once


def test_steps_are_opt_in_and_counted():
    off = Cleaner(CleanConfig())
    assert not off.active and off.transform(" <b>x</b> ") == " <b>x</b> "
    c = Cleaner(CleanConfig(strip_html=True, nfkc=True, collapse_whitespace=True))
    outs = []
    for value in ["<i>a</i>", "ﬁne", "a  b", "same"]:
        c.start_record()
        outs.append(c.transform(value))
        c.finish_record()
    assert outs == ["a", "fine", "a b", "same"]
    assert c.changed == {"strip_html": 1, "nfkc": 1, "collapse_whitespace": 1}


def test_filters_count_drops():
    """Length filters per record; dedupe needs every record and is judged later (tests/data/prepare/test_dedupe.py)."""
    c = Cleaner(CleanConfig(dedupe=True, min_chars=3, max_chars=6))
    kept = [t for t in ["ab", "abcd", "abcd", "abcdefgh", "xyz"] if c.keep(t)]
    assert kept == ["abcd", "abcd", "xyz"]
    assert c.dropped == {"min_chars": 1, "max_chars": 1}


def test_a_terms_dictionary_is_read_strictly(tmp_path):
    """Line and JSON forms give the same table; a duplicate with the same replacement is fine; an empty side,
    a term given two replacements, or a JSON that is not an object is one line naming the place."""
    from densebatch.data.prepare.clean import read_terms
    from densebatch.errors import ConfigError

    def read(name: str, text: str) -> dict:
        (tmp_path / name).write_text(text, encoding="utf-8")
        return read_terms(str(tmp_path / name))

    want = {"JS": "JavaScript", "k8s": "Kubernetes", "colour": "color"}
    assert read("a.txt", "# names\nJS -> JavaScript\nk8s → Kubernetes\ncolour\tcolor\nJS->JavaScript\n") == want
    assert read("a.json", '{"JS": "JavaScript", "k8s": "Kubernetes", "colour": "color"}') == want
    bad = {
        "empty.txt": ("JS -> JavaScript\nk8s -> \n", r"empty.txt:2: expected 'from -> to', both sides non-empty"),
        "twice.txt": ("JS -> JavaScript\n\nJS -> ECMAScript\n", r"twice.txt:3: 'JS' -> 'ECMAScript', but .*twice.txt:1 gave"),
        "twice.json": ('{"JS": "JavaScript", "JS": "ECMAScript"}', r"twice.json: key 'JS': 'JS' -> 'ECMAScript'"),
        "list.json": ('[["JS", "JavaScript"]]', r"list.json: expected a JSON object of terms"),
        "empty.json": ('{"JS": ""}', r"empty.json: expected a JSON object of non-empty strings to non-empty"),
    }
    for name, (text, match) in bad.items():
        with pytest.raises(ConfigError, match=match) as e:
            read(name, text)
        assert "\n" not in str(e.value)

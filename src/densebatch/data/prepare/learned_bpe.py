"""A byte-level BPE learned from the records (``data.tokenizer: bpe:N``): trained from their rendered text.

``tokenizers.load_tokenizer("bpe:N")`` gives a ``PendingBPE`` (its size and identity, for the cache key);
``prepare`` then learns the tokenizer from every source's rendered training text as it is read
(``learn_bpe``, through ``train_bpe``), and stores it with the prepared documents.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from densebatch.config import DataConfig
from densebatch.data.prepare.pairs import pair_text
from densebatch.data.prepare.templates import EmptiedByCleaning, RecordError, render
from densebatch.data.prepare.tokenizers import HFTokenizer, PendingBPE, Tokenizer
from densebatch.data.prepare.vocab import Added, utf8
from densebatch.errors import DataError

BPE_SPECIALS = ("<|endoftext|>", "<|mask|>")


def train_bpe(texts, *, vocab_size: int, pad_id: int | None = None, name: str | None = None, added: Added = ()) -> HFTokenizer:
    """A byte-level BPE with ``vocab_size`` ids learned from ``texts`` (deterministic for the same
    texts in the same order): every byte stays encodable, frequent strings become single ids;
    ``added`` tokens come after them."""
    from tokenizers import Tokenizer as _Tok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = _Tok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(BPE_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((utf8(t).decode("utf-8", "replace") for t in texts), trainer=trainer)  # as encode_batch reads them
    return HFTokenizer(
        tok, name=name or f"bpe:{vocab_size}", eos_token=BPE_SPECIALS[0], mask_token=BPE_SPECIALS[1], pad_id=pad_id, added=added
    )


def learn_bpe(sources: Iterable[tuple[Iterable[tuple[str, dict]], DataConfig]], pending: PendingBPE) -> Tokenizer:
    """Learn ``bpe:N`` from the rendered text of every source's training records, in source order
    (held-out ones included: the split is drawn from token contents afterwards; no label is involved).
    The records are read as they come (a list, or a reader's stream): the trainer keeps its counts, not
    the text. Pre-tokenised records are refused (``refuse_ids_for_a_new_bpe``)."""
    rendered = 0

    def texts() -> Iterator[str]:
        nonlocal rendered
        for items, cfg in sources:
            first = None
            found = 0
            n = 0
            for where, rec in items:
                n += 1
                if cfg.fields.input_ids in rec:
                    first = first or where
                    found += 1
                elif first is None:  # once one is found, the rest is only counted for the message
                    try:
                        text = pair_text(rec, cfg) if cfg.pairs is True else "".join(t for t, _ in render(rec, cfg))
                    except (RecordError, EmptiedByCleaning):
                        continue  # reported when the documents are built
                    rendered += 1
                    yield text
            if first is not None:
                refuse_ids_for_a_new_bpe(first, found=found, n=n, cfg=cfg, pending=pending)

    tok = train_bpe(
        texts(), vocab_size=pending.vocab_size, pad_id=pending.requested_pad_id, name=pending.name, added=pending.requested
    )
    if not rendered:
        raise DataError(f"data.tokenizer {pending.name}: no readable text to learn a tokenizer from")
    return tok


def refuse_ids_for_a_new_bpe(first: str, *, found: int, n: int, cfg: DataConfig, pending: PendingBPE) -> None:
    """Pre-tokenised records (``found`` of ``n``, the first at ``first``) hold ids of a tokenizer that
    already exists: learning a new one from text (``bpe:N``) cannot give their ids a meaning, and there
    may be no text at all to learn from."""
    every = "every record is" if found == n else f"{found} of {n} records are"
    raise DataError(
        f"data.tokenizer {pending.name} learns a new tokenizer from text, but {every} pre-tokenised (field "
        f"'{cfg.fields.input_ids}', first at {first}): set data.tokenizer to the tokenizer that made the ids "
        "(a tokenizer.json or model directory; or auto with model.kind hf)"
    )

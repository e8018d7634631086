"""A foreign corpus's per-document loss tokens (the counts that steer loss_tokens_per_step, source balance and the
summary) equal what the collator serves: the targets its labels keep, document by document.

datatrove is the format whose writer keeps a loss mask (``.ds.loss``); its shards are written here byte for byte
(``data/store/formats/datatrove.py``'s layout), so the property runs without datatrove installed. The formats
without a mask (megatron, litdata, MDS) check the same equality in their own test modules
(``support.served_loss_tokens``).
"""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st
from support import served_loss_tokens

from densebatch.config import DataConfig
from densebatch.data.prepare.pipeline import prepare
from densebatch.errors import DataError

_cases = itertools.count()

document = st.integers(1, 40).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(0, 258), min_size=n, max_size=n),
        st.one_of(
            st.lists(st.integers(0, 1), min_size=n, max_size=n),  # any mask
            st.integers(0, n).map(lambda k: [0] * k + [1] * (n - k)),  # a prompt without loss, then the answer
        ),
    )
)


def _write_shard(path, docs, width: int) -> np.ndarray:
    """One datatrove shard of ``docs`` ((ids, mask) pairs) at ``path`` (ids of ``width`` bytes); its loss mask."""
    np.concatenate([np.asarray(ids, f"<u{width}") for ids, _ in docs]).tofile(path)
    np.cumsum([len(ids) for ids, _ in docs]).astype("<u8").tofile(f"{path}.index")
    mask = np.concatenate([np.asarray(m, np.uint8) for _, m in docs])
    mask.tofile(f"{path}.loss")
    if width == 4:
        (path.parent / f"{path.name}.metadata").write_text("gpt2|4\n", encoding="utf-8")
    return mask


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    files=st.lists(st.lists(document, min_size=1, max_size=12), min_size=1, max_size=2),
    width=st.sampled_from([2, 4]),
    max_seq_len=st.integers(2, 45),
    overlong=st.sampled_from(["truncate", "drop"]),
    eval_fraction=st.sampled_from([0.0, 0.3]),
)
def test_datatrove_loss_tokens_are_the_served_masks_sum(tmp_path_factory, files, width, max_seq_len, overlong, eval_fraction):
    """Documents of any length and mask, cut at max_seq_len or dropped, split between train and eval: each kept
    document's loss tokens are the targets the collator serves for it, and the writer's mask over its targets
    (every token but its first, up to the cut); the summary's totals are their sums."""
    folder = tmp_path_factory.mktemp(f"dt{next(_cases)}")
    files = [[([5, 6, 7, 8], [0, 1, 1, 1]), ([9, 10, 11], [1, 0, 1])] + files[0], *files[1:]]  # two that carry loss
    masks = [_write_shard(folder / f"part{i}.ds", docs, width) for i, docs in enumerate(files)]
    written = np.concatenate(masks)
    cfg = DataConfig(
        path=str(folder), format="datatrove", tokenizer="default", cache_dir=str(folder / "cache"),
        max_seq_len=max_seq_len, overlong=overlong, eval_fraction=eval_fraction,
    )  # fmt: skip
    try:
        p = prepare(cfg)
    except DataError as e:  # every document held out or dropped: nothing to count (rare: two are trainable)
        assert "no document of 2 tokens or more to train on" in str(e)
        reject()
    for store, total in ((p.train, p.summary.train_loss_tokens), (p.eval, p.summary.eval_loss_tokens)):
        if store is None or not len(store):
            continue
        counted = np.asarray(store.doc_loss_tokens, np.int64)
        starts, lengths = store.doc_spans(np.arange(len(store)))
        by_writer = [int(written[a + 1 : a + n].sum()) for a, n in zip(starts, lengths)]
        assert counted.tolist() == served_loss_tokens(store).tolist() == by_writer
        assert (counted > 0).all() and int(counted.sum()) == total == store.meta["num_loss_tokens"]

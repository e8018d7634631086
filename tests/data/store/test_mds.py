"""data.format mds: MosaicML streaming's MDS shards written by its own MDSWriter, read in place, token for token."""

from __future__ import annotations

import importlib.util
import json
import sys
import types

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import documents_of, served_loss_tokens

from densebatch.cli import main
from densebatch.config import DataConfig, FieldsConfig
from densebatch.data.prepare.foreign import held_out
from densebatch.data.prepare.pipeline import prepare
from densebatch.data.store import store_io
from densebatch.data.store.store_io import read_ranges


def mds_writer():
    """streaming's ``MDSWriter``, imported without running ``streaming/__init__.py``.

    That ``__init__`` imports ``streaming.vision``, hence torchvision, whose PyPI build cannot load beside
    our CPU torch (and mosaicml-streaming 0.13.0 pins numpy<2.2 and transformers<5, so it is installed
    with ``--no-deps``: see the Makefile). The writer itself needs neither: ``streaming`` is registered as
    a bare package (its folder, no ``__init__`` run) and the writer's module imported from it."""
    if "streaming" not in sys.modules:
        spec = importlib.util.find_spec("streaming")
        if spec is None:
            pytest.skip("mosaicml-streaming (the MDS writer) absent")
        bare = types.ModuleType("streaming")
        bare.__path__ = list(spec.submodule_search_locations)
        sys.modules["streaming"] = bare
    from streaming.base.format.mds.writer import MDSWriter

    return MDSWriter


@pytest.fixture(scope="module")
def writer():
    return mds_writer()


def documents(n=60, seed=0, vocab=256, longest=40):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(2, longest))).tolist() for _ in range(n)]


def write(writer, folder, docs, *, encoding="ndarray:int32", column="tokens", size_limit=600, as_array=None, **kw):
    """``docs`` through MDSWriter, with a text column beside the ids (ignored) and small shards (several)."""
    dtype = kw.pop("dtype", None) or (encoding.split(":")[1] if ":" in encoding else "int64")
    with writer(columns={column: encoding, "text": "str"}, out=str(folder), size_limit=size_limit, **kw) as w:
        for i, d in enumerate(docs):
            ids = np.asarray(d, dtype)
            w.write({column: ids.tobytes() if encoding == "bytes" else ids, "text": f"document {i}"})
    return folder


def masks_right(store):
    """Every document's loss mask is ``0, 1, 1, ...`` (its first token no target), whatever order its starts lie in."""
    starts, lengths = store.doc_spans(np.arange(len(store)))
    got = read_ranges(store.loss_mask, starts, starts + lengths)
    return got.tolist() == [x for n in lengths for x in [0] + [1] * (int(n) - 1)]


def cfg(path, tmp_path, **kw):
    return DataConfig(path=str(path), format="mds", tokenizer="default", cache_dir=str(tmp_path / "cache"), **kw)


def snapshot(folder):
    return sorted((p.relative_to(folder).as_posix(), p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*"))


@pytest.mark.parametrize(
    "encoding,dtype,extra",
    [
        ("ndarray:int32", "int32", {}),
        ("ndarray:uint16", "uint16", {}),
        ("ndarray:int64", "int64", {}),  # 8-byte ids after odd headers: off their alignment
        ("ndarray:uint8", "uint8", {}),
        ("ndarray:uint64", "uint64", {}),
        ("ndarray", "int16", {}),  # the dtype a byte in each sample
        ("ndarray", "uint32", {}),
        ("bytes", "int64", {"bytes_dtype": "int64"}),  # llm-foundry's tokens column
        ("bytes", "uint16", {"bytes_dtype": "uint16"}),
    ],
)
def test_every_encoding_and_dtype_token_for_token_across_shards(writer, tmp_path, encoding, dtype, extra):
    docs = documents(seed=len(encoding) + len(dtype))
    folder = write(writer, tmp_path / "ds", docs, encoding=encoding, dtype=dtype)
    assert len(list(folder.glob("shard.*.mds"))) > 1
    before = snapshot(folder)
    p = prepare(cfg(folder, tmp_path, eval_fraction=0, **extra))
    assert documents_of(p.train) == docs and masks_right(p.train)
    assert np.asarray(p.train.doc_loss_tokens).tolist() == served_loss_tokens(p.train).tolist()  # counts: what is served
    mappings = getattr(p.train.tokens, "parts", [p.train.tokens])  # each read by positioned reads, nothing left resident
    assert all(store_io._file_of(m) is not None for m in mappings)
    assert snapshot(folder) == before  # nothing written beside the corpus


def test_fixed_shape_arrays_another_column_name_a_pattern_of_folders_and_a_merged_index(writer, tmp_path):
    from streaming.base.util import merge_index

    docs = [list(range(i, i + 16)) for i in range(30)]
    for part, chunk in (("a", docs[:12]), ("b", docs[12:])):
        write(writer, tmp_path / "corpus" / part, chunk, encoding="ndarray:uint16:16", column="ids")
    ids = FieldsConfig(input_ids="ids")
    (tmp_path / "corpus" / "logs").mkdir()  # a pattern's matches without an index are not datasets
    p = prepare(cfg(tmp_path / "corpus" / "*", tmp_path, eval_fraction=0, fields=ids))
    assert documents_of(p.train) == docs
    merge_index([str(tmp_path / "corpus" / x / "index.json") for x in "ab"], str(tmp_path / "corpus"))
    assert json.loads((tmp_path / "corpus" / "index.json").read_text())["shards"][0]["raw_data"]["basename"].startswith("a/")
    p = prepare(cfg(tmp_path / "corpus", tmp_path, eval_fraction=0, fields=ids))
    assert documents_of(p.train) == docs


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=25),
    encoding=st.sampled_from(["ndarray:int64", "ndarray:uint16", "ndarray", "ndarray:int8"]),
    size_limit=st.sampled_from([None, 300, 2000]),
)
def test_any_lengths_read_back_as_written(writer, tmp_path_factory, lengths, encoding, size_limit):
    """Shape headers of 1, 2 (lengths of 256 and more) bytes, any alignment, shards of one sample or all."""
    tmp = tmp_path_factory.mktemp("h")
    rng = np.random.default_rng(sum(lengths))
    docs = [rng.integers(0, 100, n).tolist() for n in lengths]
    folder = write(
        writer, tmp / "ds", docs, encoding=encoding, dtype="int64" if encoding == "ndarray" else None, size_limit=size_limit
    )
    kept = [d for d in docs if len(d) >= 2]  # a single id predicts nothing: dropped and counted
    if not kept:
        return
    p = prepare(cfg(folder, tmp, eval_fraction=0, max_seq_len=400))
    assert documents_of(p.train) == kept and masks_right(p.train)
    assert p.summary.dropped_no_target == len(docs) - len(kept)


def test_eval_split_is_each_shards_own_index_hash_or_eval_path(writer, tmp_path):
    docs = documents(90, seed=5)
    folder = write(writer, tmp_path / "ds", docs, size_limit=None)  # one shard: document i is sample i
    p = prepare(cfg(folder, tmp_path, eval_fraction=0.1))
    ev = held_out(len(docs), 0.1)
    assert documents_of(p.eval) == [d for d, e in zip(docs, ev) if e] and ev.any()
    assert documents_of(p.train) == [d for d, e in zip(docs, ev) if not e]
    held = write(writer, tmp_path / "held", docs[:7])  # data.eval_path in the same format: the eval split whole
    p = prepare(cfg(folder, tmp_path, eval_path=str(held)))
    assert documents_of(p.eval) == docs[:7] and documents_of(p.train) == docs


def test_trains_on_packed_rows_and_inspect_shows_the_writers_documents(writer, tmp_path, capsys):
    docs = [list(f"document {i}: {'ab ' * (i % 17 + 1)}".encode()) + [256] for i in range(120)]
    folder = write(writer, tmp_path / "ds", docs, encoding="ndarray:uint16", size_limit=2000)
    args = [f"--data.path={folder}", "--data.format=mds", "--data.tokenizer=default", "--data.eval_fraction=0"]
    args += [f"--data.cache_dir={tmp_path / 'cache'}"]
    small = ["--model.n_layer=1", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=64", "--batching.seq_len=64"]
    small += ["--batching.strategy=packed", "--batching.max_tokens_per_batch=256", "--train.max_steps=3"]
    small += ["--train.progress=false", "--train.plots=false"]
    run = tmp_path / "run"
    assert main(["train", *args, *small, f"--output_dir={run}"]) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r.get("kind") == "train"]
    assert len(train) == 3 and all(np.isfinite(r["loss"]) for r in train)
    assert np.mean([r["fill_rate"] for r in train if "fill_rate" in r]) > 0.8  # packed rows
    capsys.readouterr()
    assert main(["inspect", *args, "--num", "2"]) == 0
    shown = capsys.readouterr().out
    for i in (0, 1):
        assert f"--- document {i}: {len(docs[i])} tokens, {len(docs[i]) - 1} carry loss ---" in shown
        assert bytes(docs[i][1:-1]).decode() in shown


def _line(capsys, path, tmp_path, *extra):
    args = ["prepare", f"--data.path={path}", "--data.format=mds", "--data.tokenizer=default", *extra]
    assert main([*args, f"--data.cache_dir={tmp_path / 'cache'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_bad_datasets_are_one_line_naming_the_file(writer, tmp_path, capsys):
    docs = documents(30, seed=4)

    a = write(writer, tmp_path / "a", docs)
    shard = sorted(a.glob("shard.*.mds"))[1]
    shard.unlink()
    assert f"{shard}: missing" in _line(capsys, a, tmp_path)

    b = write(writer, tmp_path / "b", docs)
    shard = sorted(b.glob("shard.*.mds"))[0]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 3)
    assert f"{shard}:" in (line := _line(capsys, b, tmp_path)) and "cut short" in line

    c = write(writer, tmp_path / "c", docs)  # offsets that disagree with the file, its size as the index says
    shard = sorted(c.glob("shard.*.mds"))[0]
    raw = bytearray(shard.read_bytes())
    n = int(np.frombuffer(bytes(raw[:4]), "<u4")[0])
    raw[4 * (n + 1) : 4 * (n + 2)] = np.uint32(len(raw) + 8).tobytes()
    shard.write_bytes(bytes(raw))
    assert f"{shard}:" in (line := _line(capsys, c, tmp_path)) and "offsets disagree with its size" in line

    d = write(writer, tmp_path / "d", docs, compression="zstd")
    assert f"{d / 'shard.00000.mds.zstd'}: compressed (zstd)" in (line := _line(capsys, d, tmp_path))
    assert "compression=None" in line

    e = write(writer, tmp_path / "e", [[0.5, 1.5]], encoding="ndarray:float32")
    assert f"{e / 'index.json'}:" in (line := _line(capsys, e, tmp_path)) and "not integer token ids" in line
    f = write(writer, tmp_path / "f", [[0.5, 1.5]], encoding="ndarray", dtype="float16")
    assert f"{f / 'shard.00000.mds'}:" in (line := _line(capsys, f, tmp_path)) and "float16" in line

    g = write(writer, tmp_path / "g", docs, column="ids")
    assert "no column input_ids or tokens (its columns: ids, text): set data.fields.input_ids" in _line(capsys, g, tmp_path)

    h = write(writer, tmp_path / "h", docs, encoding="bytes")
    assert "set data.bytes_dtype" in _line(capsys, h, tmp_path)
    j = write(writer, tmp_path / "j", [[1, 2, 3]], encoding="bytes", dtype="uint8")  # 3 bytes read as 2-byte ids
    assert f"{j / 'shard.00000.mds'}: sample 0's 3 bytes" in _line(capsys, j, tmp_path, "--data.bytes_dtype=int16")

    k = write(writer, tmp_path / "k", [np.array([[1, 2], [3, 4]])])
    assert f"{k / 'shard.00000.mds'}: sample 0 holds a 2-D array" in _line(capsys, k, tmp_path)

    m = write(writer, tmp_path / "m", docs)  # the index claims int64 ids, the shards' own header int32
    index = json.loads((m / "index.json").read_text())
    for entry in index["shards"]:
        entry["column_encodings"][entry["column_names"].index("tokens")] = "ndarray:int64"
    (m / "index.json").write_text(json.dumps(index))
    assert "the columns its header records disagree with its index.json entry" in _line(capsys, m, tmp_path)

    i = write(writer, tmp_path / "i", [[1, 2, 300]])
    assert "token id 300 at token 2" in _line(capsys, i, tmp_path)
    assert "data.bytes_dtype" in _line(capsys, h, tmp_path, "--data.bytes_dtype=float32")


def test_more_mappings_than_open_files_allowed_is_one_line(writer, tmp_path, capsys, monkeypatch):
    """Each shard's mappings (and their positioned readers) hold open files: the soft limit is raised as our
    stores' is, and a corpus that needs more than the hard limit is one line, not "Too many open files" mid-run."""
    import resource

    folder = write(writer, tmp_path / "ds", documents(40, seed=8))
    monkeypatch.setattr(resource, "getrlimit", lambda what: (16, 16))
    line = _line(capsys, folder, tmp_path)
    assert "open files" in line and "write the corpus in fewer, larger files" in line

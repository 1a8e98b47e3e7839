"""Columnar inputs of ``prepare`` (``meshtrain/data/columnar.py``): parquet, Arrow IPC files (file
and stream format) and ``datasets``' ``save_to_disk`` directories prepare the same bytes as the same
texts given as jsonl; the column is read record batch by record batch; a missing or non-string
column is one line naming ``--text-field``; null cells are skipped with a count; --out is never
touched by a refused input.

The documents: 41 lines over a small word list with non-ASCII words, one literal
``<|endoftext|>`` and one empty string (skipped in every format).
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.ipc
import pyarrow.parquet as pq
import pytest

from meshtrain.data import columnar
from meshtrain.data.__main__ import main
from meshtrain.data.corpus import DocumentReader, input_files, prepare
from meshtrain.data.prepared import INCOMPLETE_MARKER, PreparedCorpus
from meshtrain.data.sft import prepare_sft
from meshtrain.data.tokenizer import load_tokenizer, train_bpe
from meshtrain.errors import ConfigError

WORDS = ["the", "cat", "sat", "on", "a", "mat", "déjà", "vu", "日本語", "naïve", "über", "\n", "emoji 🙂"]
BATCH_ROWS = 6  # rows per record batch / row group written: 7 batches of the 41 rows


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """The texts, the same as jsonl, a BPE of 300 ids trained on them and the jsonl's prepared directory."""
    root = tmp_path_factory.mktemp("columnar")
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, rng.integers(1, 60))) for _ in range(41)]
    texts[5] = "a literal <|endoftext|> in the text"
    texts[9] = ""
    jsonl = root / "texts.jsonl"
    _write_jsonl(jsonl, texts)
    tokenizer = str(train_bpe(texts, 300, root / "tokenizer"))
    reference = root / "reference"
    prepare([str(jsonl)], tokenizer, str(reference), shard_tokens=400, progress=False)
    return {"root": root, "texts": texts, "jsonl": jsonl, "tokenizer": tokenizer, "reference": reference}


def _write_jsonl(path: pathlib.Path, texts: list[str]) -> None:
    path.write_text("".join(json.dumps({"text": text}, ensure_ascii=False) + "\n" for text in texts), encoding="utf-8")


def _table(texts: list) -> pa.Table:
    return pa.table({"id": list(range(len(texts))), "text": pa.array(texts, pa.string())})


def _write(kind: str, path: pathlib.Path, table: pa.Table) -> pathlib.Path:
    """``table`` written as ``kind`` in batches (row groups) of BATCH_ROWS; the path to give --input."""
    if kind == "parquet":
        pq.write_table(table, path.with_suffix(".parquet"), row_group_size=BATCH_ROWS)
        return path.with_suffix(".parquet")
    if kind == "save_to_disk":
        datasets.Dataset(table).save_to_disk(str(path), num_shards=2)
        return path
    writer = pa.ipc.new_file if kind == "arrow-file" else pa.ipc.new_stream
    with writer(path.with_suffix(".arrow"), table.schema) as sink:
        for batch in table.to_batches(max_chunksize=BATCH_ROWS):
            sink.write_batch(batch)
    return path.with_suffix(".arrow")


def _files(directory: pathlib.Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def _expected_ids(corpus: dict, texts: list[str]) -> np.ndarray:
    tokenizer = load_tokenizer(corpus["tokenizer"], "test")
    tokenizer.encode_special_tokens = True
    eos = tokenizer.token_to_id("<|endoftext|>")
    return np.array([i for text in texts if text for i in tokenizer.encode(text, add_special_tokens=False).ids + [eos]])


KINDS = ["parquet", "arrow-file", "arrow-stream", "save_to_disk"]


@pytest.mark.parametrize("kind", KINDS)
def test_each_format_prepares_the_bytes_of_the_same_jsonl(corpus, tmp_path, capsys, kind):
    source = _write(kind, tmp_path / "input", _table(corpus["texts"]))
    capsys.readouterr()  # save_to_disk's progress bar
    out = tmp_path / "out"
    argv = ["prepare", "--tokenizer", corpus["tokenizer"], "--input", str(source), "--out", str(out),
            "--shard-tokens", "400", "--no-progress"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and f"{out} train: 40 documents, " in captured.out
    split = PreparedCorpus.open(str(out)).split("train")
    np.testing.assert_array_equal(split.tokens(0, split.num_tokens), _expected_ids(corpus, corpus["texts"]))
    assert _files(out) == _files(corpus["reference"])  # index.json and shards, byte for byte


def test_saved_dataset_globs_and_dataset_dicts(corpus, tmp_path, capsys):
    saved = _write("save_to_disk", tmp_path / "saved", _table(corpus["texts"]))
    arrow_files = sorted(saved.glob("*.arrow"))
    assert len(arrow_files) == 2
    assert input_files([str(saved)], "--input") == arrow_files
    assert input_files([f"{saved}/*", f"{tmp_path}/**"], "--input") == arrow_files  # no state.json document
    datasets.DatasetDict({"train": datasets.Dataset(_table(corpus["texts"]))}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(ConfigError, match=r"--val-input: .*'.*dict' matches no file; .*dict is a DatasetDict saved "
                       r"by save_to_disk: give one of its splits \(.*dict/train\)"):
        input_files([str(tmp_path / "dict")], "--val-input")
    (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": "../elsewhere.arrow"}]}))
    with pytest.raises(ConfigError, match=r"--input: .*state.json lists '../elsewhere.arrow' among its _data_files, "
                       r"which is not an .arrow file in "):
        input_files([str(saved)], "--input")
    # Issue 53, item 10: a state.json nested past the JSON bound (RecursionError before), or not JSON.
    for text, problem in [("[" * 100_000 + "]" * 100_000, "nested more than"), ("not json", "Expecting value"),
                          ("[1, 2]", "it holds no _data_files list")]:
        (saved / "state.json").write_text(text)
        with pytest.raises(ConfigError, match=rf"--input: .*state.json is not the state.json datasets' save_to_disk "
                           rf"writes \(.*{problem}"):
            input_files([str(saved)], "--input")


def test_mixed_formats_and_val_input(corpus, tmp_path):
    """Globs over jsonl, parquet (a dictionary-encoded column) and Arrow files: each file in sorted
    path order, as before; the val split from a parquet file."""
    texts = corpus["texts"]
    (tmp_path / "in").mkdir()
    _write_jsonl(tmp_path / "in" / "a.jsonl", texts[:10])
    _write("parquet", tmp_path / "in" / "b", pa.table({"text": pa.array(texts[10:25]).dictionary_encode()}))
    _write("arrow-stream", tmp_path / "in" / "c", _table(texts[25:]))
    val = _write("parquet", tmp_path / "val", _table(texts[:7]))
    split = prepare([str(tmp_path / "in" / "*")], corpus["tokenizer"], str(tmp_path / "out"), progress=False,
                    val_inputs=[str(val)]).corpus.splits
    np.testing.assert_array_equal(split["train"].tokens(0, split["train"].num_tokens), _expected_ids(corpus, texts))
    np.testing.assert_array_equal(split["val"].tokens(0, split["val"].num_tokens), _expected_ids(corpus, texts[:7]))


# The call that hands over one record batch, per format: counted to see the reader take one at a time.
_BATCH_CALLS = {"parquet": (pq.ParquetFile, "iter_batches"), "arrow-file": (pa.ipc.RecordBatchFileReader, "get_batch"),
                "arrow-stream": (pa.ipc.RecordBatchStreamReader, "read_next_batch")}


@pytest.mark.parametrize("kind", list(_BATCH_CALLS))
def test_the_column_is_read_one_record_batch_at_a_time(corpus, tmp_path, monkeypatch, kind):
    path = _write(kind, tmp_path / "input", _table(corpus["texts"]))
    monkeypatch.setattr(columnar, "PARQUET_BATCH_ROWS", BATCH_ROWS)
    owner, name = _BATCH_CALLS[kind]
    original, batches = getattr(owner, name), []

    def counted(*args, **kwargs):
        if kind == "parquet":
            return (batches.append(batch) or batch for batch in original(*args, **kwargs))
        batches.append(original(*args, **kwargs))
        return batches[-1]

    monkeypatch.setattr(owner, name, counted)
    reader = DocumentReader([path], "text", "--input", print)
    seen, progress = [], []
    for text, _ in reader:
        seen.append(text)
        progress.append(reader.bytes_read)
        row = int(reader.where.rsplit(" ", 1)[1])
        assert len(batches) == row // BATCH_ROWS + 1, "a batch was read before its rows were needed"
    assert seen == [text for text in corpus["texts"] if text]
    assert len(batches) == 7  # 41 rows, 6 a batch
    # bytes_read moves on after each batch (a document sees the batches before its own), never back
    assert progress == sorted(progress) and len(set(progress)) == 7
    assert progress[0] == 0 < progress[-1] < reader.bytes_read == path.stat().st_size


def _prepare_cli(corpus: dict, tmp_path: pathlib.Path, source: pathlib.Path, *flags: str) -> int:
    return main(["prepare", "--tokenizer", corpus["tokenizer"], "--input", str(source), "--out",
                 str(tmp_path / "out"), "--no-progress", *flags])


@pytest.mark.parametrize("kind", ["parquet", "arrow-stream"])
def test_a_missing_or_non_string_column_is_one_line_and_touches_nothing(corpus, tmp_path, capsys, kind):
    source = _write(kind, tmp_path / "input", _table(corpus["texts"]))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.md").write_text("mine")
    for flags, message in [(["--text-field", "body"], f"{source} has no 'body' column (it has: id, text)"),
                           (["--text-field", "id"], f"{source}: column 'id' holds int64, not strings")]:
        assert _prepare_cli(corpus, tmp_path, source, *flags) == 2
        assert capsys.readouterr().err == f"error: --text-field: {message}\n"
    assert _files(tmp_path / "out") == {"notes.md": b"mine"}  # refused before --out was claimed


def test_bad_files_and_a_missing_pyarrow_are_one_line(corpus, tmp_path, capsys, monkeypatch):
    (tmp_path / "fake.parquet").write_text("not parquet")
    (tmp_path / "fake.arrow").write_text("not arrow either")
    for name, kind in [("fake.parquet", "a parquet"), ("fake.arrow", "an Arrow IPC")]:
        assert _prepare_cli(corpus, tmp_path, tmp_path / name) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and error.startswith(f"error: --input: {tmp_path / name} is not {kind} file "
                                                           "pyarrow can read (")
    assert not (tmp_path / "out").exists()
    not_utf8 = pa.array([b"fine", b"caf\xe9"], pa.binary()).view(pa.string())  # unchecked until read
    pq.write_table(pa.table({"text": not_utf8}), tmp_path / "latin1.parquet")
    assert _prepare_cli(corpus, tmp_path, tmp_path / "latin1.parquet") == 2
    assert capsys.readouterr().err == (f"error: --input: {tmp_path / 'latin1.parquet'} rows 0 to 1: a 'text' cell "
                                       "is not UTF-8 text\n")
    assert (tmp_path / "out" / INCOMPLETE_MARKER).exists()  # found while reading, as a bad .jsonl line
    shutil.rmtree(tmp_path / "out")
    source = _write("parquet", tmp_path / "input", _table(corpus["texts"]))
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    assert _prepare_cli(corpus, tmp_path, source) == 2
    assert capsys.readouterr().err == (f"error: --input: {source}: reading .parquet files needs pyarrow: pip install "
                                       "'meshtrain[data]' (in a clone: pip install -e '.[data]'), or pip install "
                                       "pyarrow\n")
    assert not (tmp_path / "out").exists()


def test_null_cells_are_skipped_with_a_count(corpus, tmp_path, capsys):
    texts = corpus["texts"][:12]
    with_nulls = texts[:3] + [None] + texts[3:8] + [None] + texts[8:]
    source = _write("parquet", tmp_path / "input", _table(with_nulls))
    assert _prepare_cli(corpus, tmp_path, source) == 0
    assert capsys.readouterr().err == (f"warning: --input: {source}: skipped 2 null 'text' cells (the first at "
                                       "row 3)\n")
    split = PreparedCorpus.open(str(tmp_path / "out")).split("train")
    np.testing.assert_array_equal(split.tokens(0, split.num_tokens), _expected_ids(corpus, texts))
    _write("parquet", tmp_path / "nulls", _table([None, None]))
    with pytest.raises(ConfigError, match=r"--input: no text documents in --input"):
        prepare([str(tmp_path / "nulls.parquet")], corpus["tokenizer"], str(tmp_path / "out2"), progress=False)


def test_train_tokenizer_reads_them_too_and_prepare_sft_refuses_them(corpus, tmp_path, capsys):
    source = _write("arrow-file", tmp_path / "input", _table(corpus["texts"]))
    written = []
    for name, given in [("from-arrow", source), ("from-jsonl", corpus["jsonl"])]:
        assert main(["train-tokenizer", "--input", str(given), "--vocab-size", "280", "--out",
                     str(tmp_path / name)]) == 0
        written.append((tmp_path / name / "tokenizer.json").read_bytes())
    assert written[0] == written[1]
    capsys.readouterr()
    with pytest.raises(ConfigError, match=r"--val-input: .*input.arrow: prepare-sft reads JSON lines, not parquet or "
                       r"Arrow files; convert it to .jsonl"):
        prepare_sft([str(corpus["jsonl"])], corpus["tokenizer"], str(tmp_path / "sft"), val_inputs=[str(source)],
                    progress=False)
    assert not (tmp_path / "sft").exists()

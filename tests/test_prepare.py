"""Corpus preparation (``python -m meshtrain.data prepare`` / ``train-tokenizer``): every document
exactly once, in order, each ending in EOS; exact shards and offsets; the held-out split; one-line
errors; a rerun after SIGKILL writing the same bytes as an uninterrupted run; deterministic BPE.

The corpus is made here: 30 text files and a jsonl of 60 lines over a small word list with
non-ASCII words and one literal ``<|endoftext|>``, plus an empty file and a binary one.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from tokenizers import Tokenizer, models

from meshtrain.data.__main__ import main
from meshtrain.data.corpus import prepare
from meshtrain.data.prepared import INCOMPLETE_MARKER, INDEX_FILE, PreparedCorpus, is_prepared_dir
from meshtrain.data.tokenizer import load_tokenizer, train_bpe
from meshtrain.errors import ConfigError
from utils import shard_writes_fill_the_disk

REPO = pathlib.Path(__file__).resolve().parents[1]
WORDS = ["the", "cat", "sat", "on", "a", "mat", "déjà", "vu", "日本語", "naïve", "über", "shard", "token",
         "data", "run", "fast", "slow", "\n", "emoji 🙂", "<|endoftext|>"]
SHARD_TOKENS = 300  # a few documents a shard: many shards


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """Input files, the documents they hold in input order, and a BPE of 320 ids trained on them."""
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    text = lambda low, high: " ".join(rng.choice(WORDS[:-1], rng.integers(low, high)))
    documents = []
    for i in range(30):
        documents.append(text(5, 150) + ("\n" if i % 3 else ""))
        (root / f"a-{i:03d}.txt").write_text(documents[-1], encoding="utf-8")
    lines = [text(1, 80) for _ in range(60)]
    lines[7] = "a literal <|endoftext|> in the text"
    records = [json.dumps({"id": i, "text": line}, ensure_ascii=i % 2 == 0) for i, line in enumerate(lines)]
    (root / "b.jsonl").write_text("\n".join(records[:30] + [""] + records[30:]) + "\n", encoding="utf-8")
    documents += lines
    (root / "c-empty.txt").write_text("")
    (root / "d-blob.bin").write_bytes(bytes(range(256)) * 4)
    tokenizer = train_bpe(documents, 320, root / "tokenizer")
    return {"root": root, "inputs": [str(root / "*")], "documents": documents, "tokenizer": str(tokenizer)}


def _expected_ids(tokenizer_path: str, documents: list[str]) -> list[list[int]]:
    """Each document's ids then EOS, as prepare must write them (special tokens encoded as text)."""
    tokenizer = load_tokenizer(tokenizer_path, "test")
    tokenizer.encode_special_tokens = True
    eos = tokenizer.token_to_id("<|endoftext|>")
    return [tokenizer.encode(doc, add_special_tokens=False).ids + [eos] for doc in documents]


def _prepare(corpus: dict, out: pathlib.Path, **options):
    return prepare(corpus["inputs"], corpus["tokenizer"], str(out), shard_tokens=SHARD_TOKENS, progress=False,
                   **options)


def _files(directory: pathlib.Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def _check_split(split, expected: list[list[int]], shard_tokens: int) -> None:
    """The split's stream is ``expected`` concatenated, with exact shard and document boundaries."""
    lengths = np.array([len(ids) for ids in expected])
    stream = np.concatenate([np.array(ids) for ids in expected])
    assert split.num_documents == len(expected) and split.num_tokens == len(stream)
    np.testing.assert_array_equal(split.tokens(0, split.num_tokens), stream)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    np.testing.assert_array_equal(split.document_starts(), starts)
    assert split.document_starts().dtype == np.int64
    shard_start = 0
    for number, path in enumerate(split.shard_paths):
        shard = np.fromfile(path, dtype=split.dtype)
        offsets = np.load(path.removesuffix(".bin") + ".docs.npy")
        assert offsets.dtype == np.int64 and offsets[0] == 0 and offsets[-1] == len(shard)
        first = np.searchsorted(starts, shard_start)
        np.testing.assert_array_equal(offsets + shard_start, starts[first:first + len(offsets)])
        np.testing.assert_array_equal(shard, stream[shard_start:shard_start + len(shard)])
        last_document = offsets[-1] - offsets[-2]
        if number < len(split.shard_paths) - 1:  # closed by reaching shard_tokens, and not before
            assert len(shard) >= shard_tokens > len(shard) - last_document
        else:
            assert len(shard) - last_document < shard_tokens
        shard_start += len(shard)
        if number:  # a read across the boundary before this shard is the concatenation
            boundary = shard_start - len(shard)
            np.testing.assert_array_equal(split.tokens(boundary - 5, boundary + 7), stream[boundary - 5:boundary + 7])


def test_every_document_once_in_order_with_eos_and_exact_shards(corpus, tmp_path, capsys):
    report = _prepare(corpus, tmp_path / "out")
    warnings = capsys.readouterr().err.strip().splitlines()
    assert len(warnings) == 1 and "skipped" in warnings[0] and "d-blob.bin" in warnings[0]

    prepared = PreparedCorpus.open(str(tmp_path / "out"))
    split = prepared.split("train")
    expected = _expected_ids(corpus["tokenizer"], corpus["documents"])
    assert len(split.shard_paths) > 5
    _check_split(split, expected, SHARD_TOKENS)
    assert np.count_nonzero(split.tokens(0, split.num_tokens) == prepared.tokenizer.eos_id) == len(expected)
    tokenizer = load_tokenizer(prepared.tokenizer.file, "test")
    starts = split.document_starts()
    for number, document in enumerate(corpus["documents"]):
        assert tokenizer.decode(split.tokens(starts[number], starts[number + 1] - 1).tolist(),
                                skip_special_tokens=False) == document

    index = json.loads((tmp_path / "out" / INDEX_FILE).read_text())
    assert index["format"] == "meshtrain-corpus/1" and index["dtype"] == "uint16" and prepared.dtype == np.uint16
    assert index["tokenizer"] == {"file": "tokenizer.json", "sha256": prepared.tokenizer.sha256, "vocab_size": 320,
                                  "eos": "<|endoftext|>", "eos_id": prepared.tokenizer.eos_id}
    record = index["splits"]["train"]
    assert list(index["splits"]) == ["train"]
    assert record["text_bytes"] == split.text_bytes == sum(len(doc.encode()) for doc in corpus["documents"])
    assert sum(shard["tokens"] for shard in record["shards"]) == record["tokens"] == split.num_tokens
    assert sum(shard["documents"] for shard in record["shards"]) == record["documents"] == len(expected)
    assert report.corpus.path == prepared.path and set(report.seconds) == {"train"}
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == pathlib.Path(corpus["tokenizer"]).read_bytes()
    assert not (tmp_path / "out" / INCOMPLETE_MARKER).exists() and is_prepared_dir(str(tmp_path / "out"))
    assert not list((tmp_path / "out").glob("*.tmp"))
    with pytest.raises(IndexError):
        split.tokens(0, split.num_tokens + 1)


def test_verify_passes_then_catches_a_flipped_byte(corpus, tmp_path):
    prepared = _prepare(corpus, tmp_path / "out").corpus
    prepared.verify()
    shard = pathlib.Path(prepared.split("train").shard_paths[2])
    data = bytearray(shard.read_bytes())
    data[3] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=r"train-00002.bin: SHA-256 differs"):
        PreparedCorpus.open(prepared.path).verify()


def test_val_fraction_takes_every_nth_document(corpus, tmp_path):
    prepared = _prepare(corpus, tmp_path / "out", val_fraction=0.29).corpus
    count = len(corpus["documents"])
    chosen = [i for i in range(count) if (i + 1) * 29 // 100 > i * 29 // 100]
    assert len(chosen) == count * 29 // 100 == 26  # exactly round-down F n, not float-rounded 25
    expected = _expected_ids(corpus["tokenizer"], corpus["documents"])
    _check_split(prepared.split("val"), [expected[i] for i in chosen], SHARD_TOKENS)
    _check_split(prepared.split("train"), [ids for i, ids in enumerate(expected) if i not in chosen], SHARD_TOKENS)
    assert sorted(json.loads((tmp_path / "out" / INDEX_FILE).read_text())["splits"]) == ["train", "val"]


def test_val_input_is_its_own_split(corpus, tmp_path):
    root = corpus["root"]
    prepared = prepare([str(root / "a-*.txt")], corpus["tokenizer"], str(tmp_path / "out"),
                       val_inputs=[str(root / "b.jsonl")], shard_tokens=SHARD_TOKENS, progress=False).corpus
    expected = _expected_ids(corpus["tokenizer"], corpus["documents"])
    _check_split(prepared.split("train"), expected[:30], SHARD_TOKENS)
    _check_split(prepared.split("val"), expected[30:], SHARD_TOKENS)
    with pytest.raises(ConfigError, match=r"--val-input: .*b.jsonl is also an --input file"):
        prepare(corpus["inputs"], corpus["tokenizer"], str(tmp_path / "both"), val_inputs=[str(root / "b.jsonl")])
    without_val = _prepare(corpus, tmp_path / "train-only").corpus
    with pytest.raises(ConfigError, match=r"data.path: .* has no 'val' split .*--val-fraction or --val-input"):
        without_val.split("val")


def _run_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshtrain.data", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=600)


def test_cli_errors_are_one_line_naming_the_field(corpus, tmp_path):
    not_a_tokenizer = tmp_path / "tokenizer.json"
    not_a_tokenizer.write_text('{"model": 3}')
    cases = [(["--tokenizer", corpus["tokenizer"], "--input", str(tmp_path / "none-*.txt")], "--input",
              "matches no file"),
             (["--tokenizer", str(not_a_tokenizer), "--input", corpus["inputs"][0]], "--tokenizer",
              "is not a Hugging Face tokenizer.json (")]
    for argv, field, message in cases:
        result = _run_cli("prepare", *argv, "--out", str(tmp_path / "out"), "--no-progress")
        assert result.returncode == 2, result.stderr
        assert result.stderr.count("\n") == 1 and result.stderr.startswith(f"error: {field}: ")
        assert message in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags, field, message", [
    (["--tokenizer", "{missing}"], "--tokenizer", "does not exist"),
    (["--tokenizer", "{root}"], "--tokenizer", "has no tokenizer.json"),
    (["--val-fraction", "0.1", "--val-input", "{root}/a-000.txt"], "--val-input", "not both"),
    (["--val-fraction", "1"], "--val-fraction", "must be in [0, 1)"),
    (["--eos", "<missing>"], "--eos", "is not in the tokenizer's vocabulary"),
    (["--shard-tokens", "0"], "--shard-tokens", "positive"),
    (["--text-field", "body"], "--text-field", "b.jsonl:1 has no 'body' field (it has: id, text)"),
], ids=["missing-tokenizer", "dir-without-tokenizer", "both-val-options", "fraction-1", "unknown-eos",
        "shard-tokens-0", "jsonl-field"])
def test_cli_errors_in_process(corpus, tmp_path, capsys, flags, field, message):
    flags = [flag.format(missing=tmp_path / "missing.json", root=corpus["root"]) for flag in flags]
    argv = ["prepare", "--tokenizer", corpus["tokenizer"], "--input", corpus["inputs"][0], "--out",
            str(tmp_path / "out"), "--no-progress", *flags]
    assert main(argv) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith(f"error: {field}: ") and message in error


def test_input_errors(corpus, tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n')
    with pytest.raises(ConfigError, match=r"--input: .*bad.jsonl:2 is not a line of JSON"):
        prepare([str(tmp_path / "bad.jsonl")], corpus["tokenizer"], str(tmp_path / "out1"), progress=False)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "x.bin").write_bytes(b"\0" * 10)
    (tmp_path / "bin" / "y.txt").write_bytes(b"caf\xe9 latin-1")
    with pytest.raises(ConfigError, match=r"--input: no text documents in --input \(2 files: 2 skipped as binary"):
        prepare([str(tmp_path / "bin" / "*")], corpus["tokenizer"], str(tmp_path / "out2"), progress=False)
    small = tmp_path / "small.txt"
    small.write_text("one document")
    with pytest.raises(ConfigError, match=r"--val-fraction: 0.5 of 1 documents rounds down to no val document"):
        prepare([str(small)], corpus["tokenizer"], str(tmp_path / "out3"), val_fraction=0.5, progress=False)
    no_eos = tmp_path / "no-eos.json"
    Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(no_eos))
    with pytest.raises(ConfigError, match="--eos: the tokenizer has none of the usual end-of-document tokens"):
        prepare([str(small)], str(no_eos), str(tmp_path / "out4"), progress=False)
    named = prepare([str(small)], str(no_eos), str(tmp_path / "out5"), eos="b", progress=False).corpus
    assert named.tokenizer.eos == "b" and named.tokenizer.eos_id == 1


# Runs prepare with smaller shards than the reference (so stale files would show) and SIGKILLs
# itself right after a writing step of corpus.py: its Nth call, or its call writing the file named.
_KILLED_RUN = """
import os, signal, sys
from meshtrain.data import corpus
target, after, inputs, tokenizer, out = sys.argv[1:]
owner, name = (corpus._SplitWriter, target.split(".")[1]) if "." in target else (corpus, target)
original, calls = getattr(owner, name), []
def killing(*args):
    result = original(*args)
    calls.append(getattr(args[0], "name", None))
    if str(len(calls)) == after or calls[-1] == after:
        os.kill(os.getpid(), signal.SIGKILL)
    return result
setattr(owner, name, killing)
corpus.prepare([inputs], tokenizer, out, val_fraction=0.1, shard_tokens={shard_tokens}, progress=False, batch_bytes=700)
""".replace("{shard_tokens}", str(SHARD_TOKENS // 3))


@pytest.mark.slow  # the fast tier's prepare: its determinism tests
def test_rerun_after_sigkill_writes_the_same_bytes(corpus, tmp_path, capsys):
    _prepare(corpus, tmp_path / "reference", val_fraction=0.1)
    reference_files = _files(tmp_path / "reference")
    # mid-way through writing a shard's .tmp; after the first shard and its offsets are committed;
    # after index.json but before the marker is removed
    for target, after in [("_SplitWriter._write", "9"), ("write_file", "1"), ("write_file", INDEX_FILE)]:
        out = tmp_path / f"killed-{target}-{after}"
        killed = subprocess.run([sys.executable, "-c", _KILLED_RUN, target, after, corpus["inputs"][0],
                                 corpus["tokenizer"], str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
        assert killed.returncode == -9, killed.stderr
        assert (out / INCOMPLETE_MARKER).exists() and (out / INDEX_FILE).exists() == (after == INDEX_FILE)
        with pytest.raises(ConfigError, match="preparation was interrupted; rerun prepare"):
            PreparedCorpus.open(str(out))
        capsys.readouterr()
        _prepare(corpus, out, val_fraction=0.1, batch_bytes=10_000)
        assert "an earlier prepare was interrupted" in capsys.readouterr().err
        assert _files(out) == reference_files, target


def test_a_prepared_or_foreign_directory_is_left_alone(corpus, tmp_path):
    out = tmp_path / "out"
    _prepare(corpus, out)
    before = {path.name: (path.read_bytes(), path.stat().st_mtime_ns) for path in out.iterdir()}
    with pytest.raises(ConfigError, match=r"--out: .* is already prepared; remove it or choose another directory"):
        _prepare(corpus, out)
    assert {path.name: (path.read_bytes(), path.stat().st_mtime_ns) for path in out.iterdir()} == before
    (out / "notes.md").write_text("mine")
    _prepare(corpus, out, overwrite=True)
    assert _files(out) == {**{name: data for name, (data, _) in before.items()}, "notes.md": b"mine"}
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "train-00000.bin").write_bytes(b"not ours")
    for overwrite in (False, True):
        with pytest.raises(ConfigError, match=r"--out: .* is not empty and holds no prepared corpus"):
            _prepare(corpus, foreign, overwrite=overwrite)
    assert _files(foreign) == {"train-00000.bin": b"not ours"}


def test_open_refuses_what_is_not_a_complete_corpus(corpus, tmp_path):
    with pytest.raises(ConfigError, match=r"data.path: .* is not a directory"):
        PreparedCorpus.open(str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match=r"not a prepared directory \(no index.json\); make one with python -m"):
        PreparedCorpus.open(str(corpus["root"]))
    out = tmp_path / "out"
    prepared = _prepare(corpus, out).corpus
    last = pathlib.Path(prepared.split("train").shard_paths[-1])
    last.write_bytes(last.read_bytes()[:-2])
    with pytest.raises(ConfigError, match=r"train-000.*.bin has .* bytes, not .* tokens x 2"):
        PreparedCorpus.open(str(out), field="eval.path")
    last.unlink()
    with pytest.raises(ConfigError, match=r"eval.path: .*bin is missing"):
        PreparedCorpus.open(str(out), field="eval.path")
    (out / INDEX_FILE).write_text(json.dumps({"format": "other/2"}))
    with pytest.raises(ConfigError, match="has format 'other/2'"):
        PreparedCorpus.open(str(out))


def test_train_tokenizer_is_deterministic_and_round_trips(corpus, tmp_path):
    paths = []
    for run in ("one", "two"):
        result = _run_cli("train-tokenizer", "--input", corpus["inputs"][0], "--vocab-size", "300",
                          "--out", str(tmp_path / run))
        assert result.returncode == 0, result.stderr
        assert "skipped" in result.stderr and "d-blob.bin" in result.stderr
        paths.append(pathlib.Path(result.stdout.strip()))
    assert paths[0] == tmp_path / "one" / "tokenizer.json"
    assert paths[0].read_bytes() == paths[1].read_bytes()
    tokenizer = load_tokenizer(str(tmp_path / "one"), "test")
    assert tokenizer.get_vocab_size() == 300
    for text in corpus["documents"][:5] + ["unseen: Ωμέγα 🚀 \t tabs\r\n", "x" * 50]:
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False).ids) == text
    with pytest.raises(ConfigError, match="--vocab-size: must be at least 257"):
        train_bpe(["text"], 256, tmp_path / "small")
    with pytest.raises(ConfigError, match=r"--out: .* already has a tokenizer.json"):
        train_bpe(["text"], 300, tmp_path / "one")
    assert paths[0].read_bytes() == paths[1].read_bytes()  # the refused run left it as it was
    replaced = train_bpe(["other text " * 50], 300, tmp_path / "one", overwrite=True)
    assert replaced == paths[0] and replaced.read_bytes() != paths[1].read_bytes()
    assert load_tokenizer(str(tmp_path / "one"), "test").get_vocab_size() <= 300
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == ["tokenizer.json"]  # no partial file left


def test_overwrite_writes_beside_the_old_corpus_and_swaps_it_in(corpus, tmp_path, monkeypatch, capsys):
    """--overwrite leaves the old corpus alone until the new one is complete beside it: a full disk
    midway (ENOSPC) is one line and the old corpus and a file beside it are intact, with no
    temporary directory left; the next run replaces the corpus and keeps the file."""
    out = tmp_path / "out"
    command = ["prepare", "--tokenizer", corpus["tokenizer"], "--input", corpus["inputs"][0], "--out", str(out),
               "--no-progress", "--shard-tokens", str(SHARD_TOKENS)]
    assert main(command) == 0
    (out / "notes.md").write_text("mine")
    before = _files(out)
    shard_writes_fill_the_disk(monkeypatch, 4, "train-00003.bin")
    capsys.readouterr()
    assert main([*command, "--overwrite", "--val-fraction", "0.1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --out: cannot write ") and err[-1].endswith(
        f"train-00003.bin.tmp: No space left on device; {out} is left as it was"), err
    assert _files(out) == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out"]
    monkeypatch.undo()
    assert main([*command, "--overwrite", "--val-fraction", "0.1"]) == 0
    assert set(PreparedCorpus.open(str(out)).splits) == {"train", "val"} and (out / "notes.md").read_text() == "mine"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("command", ["prepare", "prepare-sft"])
def test_a_word_level_tokenizer_without_its_unknown_token_is_one_line(tmp_path, capsys, command):
    """Issue 53, item 10: the tokenizers library raises on the first word outside the vocabulary."""
    from tokenizers import pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"a": 0, "b": 1, "</s>": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    source = tmp_path / ("docs.txt" if command == "prepare" else "chat.jsonl")
    source.write_text("a b c\n" if command == "prepare" else json.dumps({"prompt": "a", "response": "c"}) + "\n")
    assert main([command, "--tokenizer", str(path), "--input", str(source), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: --tokenizer: {path}: its WordLevel model's unk_token '[UNK]' is not in its vocabulary, so "
                   "a word outside the vocabulary cannot be encoded (the tokenizers library raises); add that token "
                   "to the vocabulary\n"), err
    assert not (tmp_path / "out").exists()


def test_train_tokenizer_onto_a_full_disk_is_one_line_and_leaves_no_file(corpus, tmp_path, capsys, monkeypatch):
    """Issue 53, item 7: the write fails part-way; neither tokenizer.json nor its .tmp stays."""
    import errno
    import io

    real_open = open

    class FullDisk(io.FileIO):
        def write(self, data):
            super().write(data[:10])
            raise OSError(errno.ENOSPC, "No space left on device", self.name)

    def opening(file, mode="r", *args, **kwargs):
        if str(file).endswith(".json.tmp") and "w" in mode:
            return FullDisk(file, "w")
        return real_open(file, mode, *args, **kwargs)

    from meshtrain.data import files

    monkeypatch.setattr(files, "open", opening, raising=False)
    out = tmp_path / "tok"
    assert main(["train-tokenizer", "--input", corpus["inputs"][0], "--vocab-size", "300", "--out", str(out)]) == 2
    assert capsys.readouterr().err.endswith(f"error: {out / 'tokenizer.json.tmp'}: cannot write it: No space left "
                                            "on device; free some space and run again\n")
    assert list(out.iterdir()) == []

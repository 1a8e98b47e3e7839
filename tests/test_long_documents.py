"""Long documents (issue 38 item 7): ``prepare`` and ``train-tokenizer`` give the tokenizers library
a document longer than ``PIECE_CHARS`` in pieces, cut where the ids cannot change, so that the
prepared ids equal encoding each document whole and memory does not grow with a document's size;
what cannot be cut is refused in one line.

The tokenizers are made here: this project's ``train_bpe`` (byte-level BPE, GPT-2's
configuration), GPT-2/RoBERTa-style byte-level BPE with a prefix space, Llama 3's and Qwen2's
Split regexes before a byte-level BPE, BERT's WordPiece, Metaspace (Unigram and BPE) and
whitespace-splitting ones, each trained on text like the tests' own.
"""

from __future__ import annotations

import itertools
import json
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from meshtrain.data import tokenizer as tokenizer_module
from meshtrain.data.corpus import prepare
from meshtrain.data.prepared import INCOMPLETE_MARKER, PreparedCorpus
from meshtrain.data.tokenizer import (MAX_PIECE_CHARS, PIECE_CHARS, Cuts, load_tokenizer, piece_bounds,
                                      tokenizer_cuts, train_bpe)
from meshtrain.errors import ConfigError

REPO = pathlib.Path(__file__).resolve().parents[1]
ATOMS = ["the", "cat", "sat", "on", "mat", "don't", "it's", "I'm", "we'll", "123", "4567", "3.14", "déjà", "naïve",
         "日本語", "中文文本", "🙂", "e\u0301", "¨", "x'''s", "(paren)", "a.b,c", "<|endoftext|>", "ΣΑΣ", "İstanbul",
         "ǅ", "\u0301", "ﬁ", "Ⅻ"]
# Single and repeated whitespace of every kind, characters Python and Rust disagree on (\x1c, \u180e),
# and no separator at all.
SEPARATORS = [" "] * 6 + ["  ", "   ", "\n", "\n\n", "\t", "\r\n", " \n", "\n ", "\xa0", "\u3000", "\x1c", "\x85",
                          "\u180e", "\u200b", "\x0b", "\x0c", "\r", "", "", "-"]
NO_WHITESPACE = [chr(c) for c in range(0x21, 0x7f)] + list("éß日本語中文🙂") + ["\u0301"]
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def random_text(rng: np.random.Generator, atoms: int) -> str:
    """``atoms`` words and symbols, each followed by a random separator."""
    words = rng.choice(np.array(ATOMS, dtype=object), atoms)
    separators = rng.choice(np.array(SEPARATORS, dtype=object), atoms)
    return "".join(itertools.chain.from_iterable(zip(words, separators)))


def no_whitespace(rng: np.random.Generator, chars: int) -> str:
    """``chars`` random characters, none of them whitespace."""
    return "".join(rng.choice(np.array(NO_WHITESPACE, dtype=object), chars))


def minified(rng: np.random.Generator, chars: int) -> str:
    """About ``chars`` characters of words and symbols without whitespace, like minified code."""
    atoms = [atom for atom in ATOMS if not any(char.isspace() for char in atom)] + ["{k:v}", "f(x);", "[1,2]"]
    return "".join(rng.choice(np.array(atoms, dtype=object), chars // 2))[:chars]


def _trained(pre_tokenizer, normalizer=None, model: str = "bpe", **parts) -> Tokenizer:
    special = ["<unk>", "<|endoftext|>"]
    if model == "bpe":
        tokenizer = Tokenizer(models.BPE())
        byte_level = "ByteLevel" in json.dumps(json.loads(pre_tokenizer.__getstate__()))
        trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=special, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if byte_level else [])
    elif model == "wordpiece":
        tokenizer = Tokenizer(models.WordPiece(unk_token="<unk>"))
        trainer = trainers.WordPieceTrainer(vocab_size=600, special_tokens=special, show_progress=False)
    else:
        tokenizer = Tokenizer(models.Unigram())
        trainer = trainers.UnigramTrainer(vocab_size=300, special_tokens=special, unk_token="<unk>",
                                          show_progress=False)
    tokenizer.pre_tokenizer = pre_tokenizer
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    for name, part in parts.items():
        setattr(tokenizer, name, part)
    rng = np.random.default_rng(7)
    tokenizer.train_from_iterator([random_text(rng, 300) for _ in range(40)], trainer)
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory) -> dict[str, str]:
    """name -> tokenizer.json of every tokenizer whose cuts are exact."""
    root = tmp_path_factory.mktemp("tokenizers")
    rng = np.random.default_rng(3)
    files = {"default": str(train_bpe([random_text(rng, 300) for _ in range(40)], 600, root / "default"))}
    made = {
        "gpt2-prefix-space": _trained(pre_tokenizers.ByteLevel(add_prefix_space=True),
                                      post_processor=processors.ByteLevel(), decoder=decoders.ByteLevel()),
        "bytelevel-nfkc": _trained(pre_tokenizers.ByteLevel(add_prefix_space=False), normalizers.NFKC()),
        "llama3-split": _trained(pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])),
        "qwen2-split": _trained(pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]), normalizers.NFC()),
        "bert-wordpiece": _trained(pre_tokenizers.BertPreTokenizer(), normalizers.BertNormalizer(), "wordpiece"),
        "whitespace-lowercase": _trained(pre_tokenizers.Whitespace(), normalizers.Sequence(
            [normalizers.NFD(), normalizers.Lowercase(), normalizers.StripAccents()]), "wordpiece"),
        "metaspace-unigram": _trained(pre_tokenizers.Metaspace(), None, "unigram"),
        "metaspace-first-bpe": _trained(pre_tokenizers.Metaspace(prepend_scheme="first"), normalizers.NFKC()),
        "space-delimiter": _trained(pre_tokenizers.CharDelimiterSplit(" "), None, "wordpiece"),
        "whitespace-then-digits": _trained(pre_tokenizers.Sequence(
            [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Digits(individual_digits=True)])),
    }
    for name, tokenizer in made.items():
        tokenizer.save(str(root / f"{name}.json"))
        files[name] = str(root / f"{name}.json")
    return files


def _encoder(path: str) -> Tokenizer:
    tokenizer = load_tokenizer(path, "test")
    tokenizer.encode_special_tokens = True  # as prepare
    return tokenizer


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


EXACT = ["default", "gpt2-prefix-space", "bytelevel-nfkc", "llama3-split", "qwen2-split", "bert-wordpiece",
         "whitespace-lowercase", "metaspace-unigram", "metaspace-first-bpe", "space-delimiter",
         "whitespace-then-digits"]


@pytest.mark.parametrize("name", EXACT)
def test_pieces_give_the_ids_of_the_whole_text(tokenizer_files, name):
    """Small pieces, so hundreds of cuts per tokenizer, among every kind of whitespace, contractions,
    combining marks and stretches without whitespace longer than a piece."""
    tokenizer = _encoder(tokenizer_files[name])
    cuts = tokenizer_cuts(tokenizer)
    assert cuts.before is not None, cuts.what
    rng = np.random.default_rng(EXACT.index(name))
    total_cuts = longer_pieces = 0
    for _ in range(25):
        text = random_text(rng, 120) + no_whitespace(rng, 90) + random_text(rng, 60)
        bounds = piece_bounds(text, cuts, "doc", "--input", piece_chars=40, max_chars=4000)
        pieces = [text[start:stop] for start, stop in itertools.pairwise(bounds)]
        assert "".join(pieces) == text and all(pieces)
        assert list(itertools.chain.from_iterable(_ids(tokenizer, piece) for piece in pieces)) == _ids(tokenizer, text)
        total_cuts += len(bounds) - 2
        longer_pieces += any(len(piece) > 40 for piece in pieces)
    assert total_cuts > 300 and longer_pieces == 25  # the stretch without whitespace: one longer piece each


@pytest.mark.parametrize("name", ["default", "metaspace-unigram"])
def test_a_cut_elsewhere_would_change_the_ids(tokenizer_files, name):
    """The test above can fail: the same texts cut after a space, or before a newline where a
    tokenizer puts a space before a piece (Metaspace), give other ids."""
    tokenizer = _encoder(tokenizer_files[name])
    wrong = re.compile(r" \S(?=\S)") if name == "default" else re.compile(r"\S\n(?=\S)")
    rng = np.random.default_rng(5)
    changed = 0
    for _ in range(10):
        text = random_text(rng, 200)
        bounds = piece_bounds(text, Cuts(wrong, "wrong"), "doc", "--input", piece_chars=40, max_chars=4000)
        pieces = [_ids(tokenizer, text[start:stop]) for start, stop in itertools.pairwise(bounds)]
        changed += list(itertools.chain.from_iterable(pieces)) != _ids(tokenizer, text)
    assert changed == 10


def test_piece_bounds_rules():
    cuts = tokenizer_cuts(Tokenizer(models.BPE()))  # no pre-tokenizer: no exact cut
    assert cuts.before is None and "pre-tokenizer (none)" in cuts.what
    assert piece_bounds("x" * 50, cuts, "a.jsonl:3", "--input", piece_chars=10, max_chars=60) == [0, 50]
    with pytest.raises(ConfigError, match=r"^--input: a.jsonl:3: a document of 61 characters is longer than the 60 "
                                          r"tokenized at once, and this tokenizer's ids could change if it were cut "
                                          r"\(its pre-tokenizer \(none\) is not one"):
        piece_bounds("x" * 61, cuts, "a.jsonl:3", "--input", piece_chars=10, max_chars=60)

    spaces = tokenizer_cuts(_trained(pre_tokenizers.Metaspace()))
    text = "aaaa bbbb cccc  dddd\neeee"
    assert piece_bounds(text, spaces, "w", "--input", piece_chars=len(text), max_chars=99) == [0, len(text)]
    # the last space between two non-whitespace characters within 12 characters: before " cccc"; then
    # none (not a double space, not a newline for Metaspace): the rest is one piece, up to max_chars
    assert piece_bounds(text, spaces, "w", "--input", piece_chars=12, max_chars=99) == [0, 9, len(text)]
    stretch = "a" * 30 + " b" + "c" * 30
    assert piece_bounds(stretch, spaces, "w", "--input", piece_chars=10, max_chars=32) == [0, 30, len(stretch)]
    with pytest.raises(ConfigError, match=r"^--input: big.txt: a document of 62 characters has no space between "
                                          r"two non-whitespace characters in the 29 characters from character 0 "
                                          r"\(at most 29 are tokenized at once\); split it into smaller documents$"):
        piece_bounds(stretch, spaces, "big.txt", "--input", piece_chars=10, max_chars=29)


def test_the_backward_search_finds_the_last_cut_across_its_blocks():
    """Cuts are looked for backwards in blocks of 64 Ki characters; the chosen one is the last
    within the piece, whichever block holds it (compared with a brute-force search)."""
    cuts = tokenizer_cuts(_trained(pre_tokenizers.WhitespaceSplit()))  # any ASCII whitespace character
    rng = np.random.default_rng(11)
    block = tokenizer_module._CUT_SEARCH_BLOCK
    for _ in range(8):
        chars = np.full(4 * block + 100, "x", dtype="<U1")
        chars[rng.choice(np.arange(1, len(chars) - 1), 6, replace=False)] = rng.choice([" ", "\n", "\t"], 6)
        spaced = rng.choice(np.arange(1, len(chars) - 2), 3, replace=False)
        chars[spaced] = chars[spaced + 1] = " "  # two whitespace characters: no cut
        text = "".join(chars)
        places = [p for p in range(1, len(text) - 1) if text[p] in " \n\t" and not text[p - 1].isspace()
                  and not text[p + 1].isspace()]
        piece = int(rng.integers(block // 2, 2 * block + block // 2))
        expected = [0]
        while len(text) - expected[-1] > piece:
            start = expected[-1]
            within = [p for p in places if start < p <= start + piece]
            later = [p for p in places if p > start + piece]
            if not within and not later:
                break
            expected.append(within[-1] if within else later[0])
        expected.append(len(text))
        assert piece_bounds(text, cuts, "w", "--input", piece_chars=piece, max_chars=len(text)) == expected


@pytest.fixture(scope="module")
def long_document() -> str:
    """~3.05 M characters: 1.6 M of words with every kind of whitespace, 1.1 M without any (like
    minified code), 0.34 M of words: with PIECE_CHARS (1 Mi), cut three times, the piece holding
    the stretch without whitespace longer than PIECE_CHARS."""
    rng = np.random.default_rng(13)
    first, stretch, last = random_text(rng, 330_000), minified(rng, 1_100_000), random_text(rng, 70_000)
    assert len(first) > 1.4 * PIECE_CHARS and len(stretch) > PIECE_CHARS and len(last) > 0.3 * PIECE_CHARS
    return first + "x" + stretch + "x" + last


@pytest.mark.slow
@pytest.mark.parametrize("name", ["default", "gpt2-prefix-space"])
def test_prepare_writes_the_ids_of_each_whole_document(tokenizer_files, long_document, tmp_path, name):
    """With the real PIECE_CHARS: a long document in a jsonl among short ones, and a text file just
    over PIECE_CHARS, prepared in batches smaller than a piece; every document's ids are those of
    encoding it whole."""
    tokenizer = _encoder(tokenizer_files[name])
    bounds = piece_bounds(long_document, tokenizer_cuts(tokenizer), "doc", "--input")
    sizes = np.diff(bounds)
    assert len(bounds) - 2 >= 3 and sizes.max() > PIECE_CHARS and sizes[sizes <= PIECE_CHARS].size >= 3
    lines = ["a short one", long_document, "another\nshort one", long_document[:500], "and one more"]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    just_over = long_document[:PIECE_CHARS + 7]
    (tmp_path / "in" / "b.txt").write_text(just_over, encoding="utf-8")
    documents = [*lines, just_over]
    corpus = prepare([str(tmp_path / "in" / "*")], tokenizer_files[name], str(tmp_path / "out"), progress=False,
                     val_fraction=0.34, batch_bytes=300_000, shard_tokens=50_000).corpus
    eos = tokenizer.token_to_id("<|endoftext|>")
    expected = [_ids(tokenizer, document) + [eos] for document in documents]
    for split, chosen in [("train", [0, 1, 3, 4]), ("val", [2, 5])]:
        part = corpus.split(split)
        starts = part.document_starts()
        assert part.num_documents == len(chosen)
        for number, document in enumerate(chosen):
            np.testing.assert_array_equal(part.tokens(int(starts[number]), int(starts[number + 1])),
                                          expected[document])
        assert part.text_bytes == sum(len(documents[i].encode()) for i in chosen)
    corpus.verify()


def test_train_tokenizer_on_pieces_equals_training_on_whole_texts(tmp_path, monkeypatch):
    """train_bpe cuts a text longer than PIECE_CHARS (its pre-tokenizer's words are kept whole, so
    it counts the same words): the same tokenizer.json as training on the uncut texts."""
    rng = np.random.default_rng(17)
    texts = [random_text(rng, 450_000), "a short text", random_text(rng, 1000) + no_whitespace(rng, 300)]
    assert len(texts[0]) > 2 * PIECE_CHARS
    given = []
    real_pieces = tokenizer_module.text_pieces

    def counting(text, *args, **kwargs):
        pieces = list(real_pieces(text, *args, **kwargs))
        given.append(len(pieces))
        return iter(pieces)

    monkeypatch.setattr(tokenizer_module, "text_pieces", counting)
    cut = train_bpe(texts, 700, tmp_path / "cut").read_bytes()
    assert given[0] >= 3 and given[1:] == [1, 1]
    monkeypatch.setattr(tokenizer_module, "text_pieces", lambda text, *args, **kwargs: iter([text]))
    whole = train_bpe(texts, 700, tmp_path / "whole").read_bytes()
    assert cut == whole


def _run_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshtrain.data", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_a_document_that_cannot_be_cut_is_refused_in_one_line(tokenizer_files, tmp_path):
    """A line with more than MAX_PIECE_CHARS characters and no whitespace: prepare and train-tokenizer
    exit 2 with one line naming the line and the limit, before tokenizing it; --out stays marked
    incomplete (a rerun starts afresh) and an existing tokenizer.json is kept."""
    big = tmp_path / "big.jsonl"
    big.write_text(json.dumps({"text": "fine words"}) + "\n" + json.dumps({"text": "y" * (MAX_PIECE_CHARS + 5)}) + "\n")
    limit = f"{MAX_PIECE_CHARS:,}"
    result = _run_cli("prepare", "--tokenizer", tokenizer_files["default"], "--input", str(big), "--out",
                      str(tmp_path / "out"), "--no-progress")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"error: --input: {big}:2: a document of {MAX_PIECE_CHARS + 5:,} characters "
                                    f"has no whitespace character between two non-whitespace characters in the "
                                    f"{limit} characters from character 0 (at most {limit} are tokenized at once)")
    assert (tmp_path / "out" / INCOMPLETE_MARKER).exists()
    with pytest.raises(ConfigError, match="preparation was interrupted; rerun prepare"):
        PreparedCorpus.open(str(tmp_path / "out"))

    kept = train_bpe(["earlier text " * 20], 300, tmp_path / "tok").read_bytes()
    result = _run_cli("train-tokenizer", "--input", str(big), "--vocab-size", "300", "--out", str(tmp_path / "tok"),
                      "--overwrite")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"error: --input: {big}:2: a document of ") and limit in result.stderr
    assert (tmp_path / "tok" / "tokenizer.json").read_bytes() == kept
    assert sorted(path.name for path in (tmp_path / "tok").iterdir()) == ["tokenizer.json"]


def test_a_tokenizer_without_an_exact_cut_encodes_documents_whole_up_to_the_limit(tmp_path):
    """Prepend("▁") puts a ▁ before every piece: no cut is exact, so a document up to the limit is
    encoded whole (the ids of the whole) and a longer one refused, naming the file and the reason."""
    tokenizer = _trained(pre_tokenizers.WhitespaceSplit(), normalizers.Prepend("▁"))
    tokenizer.save(str(tmp_path / "prepend.json"))
    cuts = tokenizer_cuts(tokenizer)
    assert cuts.before is None and cuts.what == "its normalizer Prepend may act across whitespace"
    rng = np.random.default_rng(19)
    text = random_text(rng, 400)
    (tmp_path / "doc.txt").write_text(text, encoding="utf-8")
    corpus = prepare([str(tmp_path / "doc.txt")], str(tmp_path / "prepend.json"), str(tmp_path / "out"),
                     progress=False, piece_chars=100, max_piece_chars=len(text)).corpus
    tokenizer.encode_special_tokens = True
    expected = _ids(tokenizer, text) + [tokenizer.token_to_id("<|endoftext|>")]
    np.testing.assert_array_equal(corpus.split("train").tokens(0, len(expected)), expected)
    with pytest.raises(ConfigError, match=rf"^--input: .*doc.txt: a document of {len(text):,} characters is longer "
                                          rf"than the {len(text) - 1:,} tokenized at once, and this tokenizer's ids "
                                          r"could change if it were cut \(its normalizer Prepend"):
        prepare([str(tmp_path / "doc.txt")], str(tmp_path / "prepend.json"), str(tmp_path / "out2"), progress=False,
                piece_chars=100, max_piece_chars=len(text) - 1)


def test_truncation_and_padding_in_the_tokenizer_file_are_ignored(tokenizer_files, tmp_path):
    tokenizer = load_tokenizer(tokenizer_files["default"], "test")
    tokenizer.enable_truncation(8)
    tokenizer.enable_padding(length=64)
    tokenizer.save(str(tmp_path / "truncating.json"))
    (tmp_path / "doc.txt").write_text("the cat sat on the mat " * 20)
    corpus = prepare([str(tmp_path / "doc.txt")], str(tmp_path / "truncating.json"), str(tmp_path / "out"),
                     progress=False).corpus
    plain = _encoder(tokenizer_files["default"])
    assert corpus.split("train").num_tokens == len(_ids(plain, "the cat sat on the mat " * 20)) + 1


# Runs a command and prints its peak resident memory in KiB (the only child of this process).
_PEAK = ("import resource, subprocess, sys; result = subprocess.run(sys.argv[1:]); "
         "print(result.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
MEMORY_BOUND_KIB = 1_500 * 1024


@pytest.mark.slow
def test_peak_memory_of_a_large_single_line_document(tmp_path):
    """A 16 MB one-line document (a text file; a jsonl line is read the same way): prepare and
    train-tokenizer peak well under 1.5 GB (measured: 665 and 554 MB). Given whole to the library
    it took 2.45 and 2.0 GB, ~150 bytes per character, so that a 200 MB line aborted the process."""
    text = ("the cat sat on a mat, déjà vu: 1234 tokens don't shard. " * 290_000)[:16_000_000]
    (tmp_path / "one.txt").write_text(text, encoding="utf-8")
    peaks = {}
    for command in (["prepare", "--tokenizer", str(train_bpe([text[:200_000]], 500, tmp_path / "tok")), "--input",
                     str(tmp_path / "one.txt"), "--out", str(tmp_path / "out"), "--no-progress"],
                    ["train-tokenizer", "--input", str(tmp_path / "one.txt"), "--vocab-size", "500", "--out",
                     str(tmp_path / "trained")]):
        result = subprocess.run([sys.executable, "-c", _PEAK, sys.executable, "-m", "meshtrain.data", *command],
                                cwd=REPO, capture_output=True, text=True, timeout=300)
        code, peak = result.stdout.split()[-2:]
        assert code == "0", result.stderr
        peaks[command[0]] = int(peak)
    assert max(peaks.values()) < MEMORY_BOUND_KIB, peaks
    corpus = PreparedCorpus.open(str(tmp_path / "out"))
    assert corpus.split("train").num_documents == 1 and corpus.split("train").text_bytes == len(text.encode())

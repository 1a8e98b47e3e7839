"""Hugging Face ``tokenizers`` tokenizers: loading one (a ``tokenizer.json`` or a directory holding
one), finding its end-of-document token, cutting long documents into pieces whose ids are those of
the whole, and training a byte-level BPE on local text."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import json
import pathlib
import re
from collections.abc import Iterable, Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from meshtrain.data.files import write_file
from meshtrain.errors import ConfigError, writable_directory

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"  # transformers' record of a tokenizer's special tokens
# End-of-document tokens of the common families, in the order they are looked for.
COMMON_EOS_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>")
TRAINED_EOS_TOKEN = "<|endoftext|>"
BYTE_ALPHABET_SIZE = 256
_HASH_CHUNK_BYTES = 1 << 20
# A document longer than PIECE_CHARS characters is tokenized (and trained on) in pieces of at most
# about that many: the tokenizers library needs ~150 bytes of memory per character it is given at
# once (a 200 MB line aborted the process). MAX_PIECE_CHARS (~2.5 GB of that memory) is the most
# ever given at once: a longer stretch without a place to cut is refused. See ``piece_bounds``.
PIECE_CHARS = 1 << 20
MAX_PIECE_CHARS = 1 << 24
_CUT_SEARCH_BLOCK = 1 << 16


def tokenizer_file(path: str | pathlib.Path) -> pathlib.Path:
    """``path`` itself, or ``path/tokenizer.json`` when ``path`` is a directory."""
    path = pathlib.Path(path)
    return path / TOKENIZER_FILE if path.is_dir() else path


def load_tokenizer(path: str | pathlib.Path, field: str) -> Tokenizer:
    """The tokenizer of a ``tokenizer.json`` file or of a directory holding one; a one-line
    ``ConfigError(field, ...)`` when it is missing or is not a tokenizer."""
    file = tokenizer_file(path)
    if not file.is_file():
        where = f"{path} has no {TOKENIZER_FILE}" if pathlib.Path(path).is_dir() else f"{path} does not exist"
        raise ConfigError(field, f"{where}; give a Hugging Face tokenizer.json or a directory holding one")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as err:  # noqa: BLE001 - the Rust side raises plain Exception for every parse failure
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(field, f"{file} is not a Hugging Face tokenizer.json ({reason[:120]})") from None
    unknown = getattr(tokenizer.model, "unk_token", None)
    if isinstance(tokenizer.model, models.WordLevel) and tokenizer.token_to_id(unknown or "") is None:
        raise ConfigError(field, f"{file}: its WordLevel model's unk_token {unknown!r} is not in its vocabulary, so "
                          "a word outside the vocabulary cannot be encoded (the tokenizers library raises); add "
                          "that token to the vocabulary")
    return tokenizer


def file_sha256(path: str | pathlib.Path) -> str:
    """Hex SHA-256 of a file's bytes, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def end_of_document_id(tokenizer: Tokenizer, eos: str | None, field: str) -> tuple[str, int]:
    """``(token, id)`` that ends every document: ``eos`` when given, else the first of
    ``COMMON_EOS_TOKENS`` that the tokenizer holds as an added (special) token."""
    if eos is not None:
        token_id = tokenizer.token_to_id(eos)
        if token_id is None:
            raise ConfigError(field, f"{eos!r} is not in the tokenizer's vocabulary")
        return eos, token_id
    added = {token.content: token_id for token_id, token in tokenizer.get_added_tokens_decoder().items()}
    for token in COMMON_EOS_TOKENS:
        if token in added:
            return token, added[token]
    raise ConfigError(field, f"the tokenizer has none of the usual end-of-document tokens "
                      f"{', '.join(COMMON_EOS_TOKENS)}; name one with --eos")


# ---- cutting long documents ----

# A cut is made before the second character of a match: a space (or, where the tokenizer allows
# it, any ASCII whitespace character) between two non-whitespace characters.
_SPACE = "space between two non-whitespace characters"
_WHITESPACE = "whitespace character between two non-whitespace characters"
_CUT_BEFORE = {_SPACE: re.compile(r"\S (?=\S)"), _WHITESPACE: re.compile(r"\S[ \t\n\r\f\v](?=\S)")}
# Normalizers that map each character (with its combining marks) on its own, never across a space.
_LOCAL_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "StripAccents"}
# Pre-tokenizers that drop all whitespace and never keep characters on both sides of it in one word.
_WHITESPACE_DROPPING = {"Whitespace", "WhitespaceSplit", "BertPreTokenizer"}
# Split regexes (behaviour Isolated) of common tokenizers in which no word holds a non-whitespace
# character followed by a space, nothing looks behind or anchors, and a lookahead only follows
# whitespace: a cut before a space between two non-whitespace characters keeps every word.
_SPLIT_PATTERNS_CUT_AT_SPACES = {
    "GPT-4 (cl100k), Llama 3": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "Qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
             r"|\s+(?!\S)|\s+",
    "GPT-2": r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
}


@dataclasses.dataclass(frozen=True)
class Cuts:
    """Where a tokenizer's documents may be cut without changing their ids. ``before``: a pattern
    whose match at q means a cut at q + 1 (a non-whitespace character, then the whitespace
    character the next piece starts with), or None when no cut is known to keep the ids; ``what``:
    that place in words, or why there is none."""

    before: re.Pattern | None
    what: str


def _state(component) -> dict | None:
    return None if component is None else json.loads(component.__getstate__())


def _pre_tokenizer_cut(state: dict | None) -> tuple[str | None, str]:
    """(place, pre-tokenizer type): the place (``_SPACE``, ``_WHITESPACE``) where the pre-tokenizer
    ``state`` always ends a word and starts the next one as it would start a text, or (None, type)."""
    if state is None:
        return None, "none"
    kind = state.get("type")
    if kind == "Sequence":  # its first one splits; the rest act within each word the first makes
        steps = state.get("pretokenizers") or [None]
        return _pre_tokenizer_cut(steps[0])
    if kind in _WHITESPACE_DROPPING:
        return _WHITESPACE, kind
    if kind == "ByteLevel" and state.get("use_regex", True):
        # GPT-2's regex: no word holds a non-whitespace character and whitespace after it. With
        # add_prefix_space, a piece is left as it is only when it starts with a space.
        return (_SPACE if state.get("add_prefix_space") else _WHITESPACE), kind
    if kind == "Metaspace" and state.get("split", True):
        return _SPACE, kind
    if kind == "CharDelimiterSplit" and state.get("delimiter") == " ":
        return _SPACE, kind
    if (kind == "Split" and state.get("behavior") == "Isolated" and not state.get("invert")
            and state.get("pattern", {}).get("Regex") in _SPLIT_PATTERNS_CUT_AT_SPACES.values()):
        return _SPACE, kind
    return None, kind


def _normalizer_types(state: dict | None) -> list[str]:
    if state is None:
        return []
    if state.get("type") == "Sequence":
        return [kind for step in state.get("normalizers", []) for kind in _normalizer_types(step)]
    return [state.get("type")]


def tokenizer_cuts(tokenizer: Tokenizer) -> Cuts:
    """Where ``tokenizer`` (as ``prepare`` uses it: ``encode_special_tokens`` on, no truncation or
    padding) may cut a document with its ids unchanged: the ids of the pieces, concatenated, are
    those of the whole. That holds when

    * the normalizer maps characters on their own: none, NFC, NFD, NFKC, NFKD, Lowercase,
      StripAccents, a Sequence of them; or BertNormalizer (which deletes control characters, the
      vertical tab and form feed among them) with a pre-tokenizer that drops whitespace, cutting
      at spaces only;
    * the pre-tokenizer (a Sequence's first) always ends a word before the whitespace that follows
      a non-whitespace character and starts the next one as it would start a text: ByteLevel with
      its regex (GPT-2's, RoBERTa's and this project's ``train_bpe``'s), Whitespace,
      WhitespaceSplit, BertPreTokenizer, Metaspace with split, CharDelimiterSplit on a space,
      Split (isolating) with the regex of GPT-2, of GPT-4 and Llama 3, or of Qwen2, as written in
      their tokenizer.json files (``_SPLIT_PATTERNS_CUT_AT_SPACES``). The model (BPE, WordPiece,
      Unigram, WordLevel) works word by word, so it sees the same words;
    * no non-special added token holds whitespace or strips the whitespace after it.

    The cut is then before a space between two non-whitespace characters, or before any ASCII
    whitespace character between two non-whitespace ones where the pre-tokenizer drops whitespace
    or is ByteLevel without ``add_prefix_space`` (which puts a space before a piece that does not
    start with one). Any other tokenizer (another Split regex; Metaspace without split, as in
    Llama 2's and Mistral's converted tokenizers; no pre-tokenizer; a normalizer such as Prepend or
    Replace) gets ``Cuts(None, why)``: its documents are encoded whole, up to ``MAX_PIECE_CHARS``
    characters."""
    place, kind = _pre_tokenizer_cut(_state(tokenizer.pre_tokenizer))
    if place is None:
        return Cuts(None, f"its pre-tokenizer ({kind}) is not one whose words always end at whitespace")
    normalizers = _normalizer_types(_state(tokenizer.normalizer))
    local = _LOCAL_NORMALIZERS | ({"BertNormalizer"} if kind in _WHITESPACE_DROPPING else set())
    odd = [name for name in normalizers if name not in local]
    if odd:
        return Cuts(None, f"its normalizer {odd[0]} may act across whitespace")
    if "BertNormalizer" in normalizers:  # it deletes control characters, \v and \f among them: spaces stay
        place = _SPACE
    for token in tokenizer.get_added_tokens_decoder().values():
        if not token.special and (token.rstrip or any(char.isspace() for char in token.content)):
            return Cuts(None, f"its added token {token.content!r} holds or strips whitespace")
    return Cuts(_CUT_BEFORE[place], place)


def piece_bounds(text: str, cuts: Cuts, where: str, field: str, *, piece_chars: int = PIECE_CHARS,
                 max_chars: int = MAX_PIECE_CHARS) -> list[int]:
    """``[0, c1, ..., len(text)]``: where ``text`` is cut into pieces to tokenize one at a time.

    A text of at most ``piece_chars`` characters is one piece. A longer one is cut at ``cuts``
    (``tokenizer_cuts``), so that its pieces' ids are its own: each piece ends at the last cut within
    ``piece_chars`` characters of its start, or, when there is none (a long stretch without
    whitespace: base64, minified code, text in a script without spaces), at the first after them,
    within ``max_chars``. A piece is never cut elsewhere, so no id differs from encoding the text
    whole. Refused with a one-line ``ConfigError(field)`` naming ``where`` (the document's file or
    line): ``max_chars`` characters with no cut, or, for a tokenizer with no exact cut, a text
    longer than ``max_chars``."""
    if len(text) <= piece_chars:
        return [0, len(text)]
    if cuts.before is None:
        if len(text) <= max_chars:
            return [0, len(text)]
        raise ConfigError(field, f"{where}: a document of {len(text):,} characters is longer than the {max_chars:,} "
                          f"tokenized at once, and this tokenizer's ids could change if it were cut ({cuts.what}); "
                          "split it into documents of at most that size")
    bounds = [0]
    while len(text) - bounds[-1] > piece_chars:
        start = bounds[-1]
        cut = _last_cut(text, cuts.before, start, start + piece_chars)
        if cut is None:
            found = cuts.before.search(text, start + piece_chars, min(start + max_chars + 2, len(text)))
            if found is None and len(text) - start <= max_chars:
                break
            if found is None:
                raise ConfigError(field, f"{where}: a document of {len(text):,} characters has no {cuts.what} "
                                  f"in the {max_chars:,} characters from character {start:,} (at most "
                                  f"{max_chars:,} are tokenized at once); split it into smaller documents")
            cut = found.start() + 1
        bounds.append(cut)
    bounds.append(len(text))
    return bounds


def _last_cut(text: str, before: re.Pattern, low: int, high: int) -> int | None:
    """The largest cut p with low < p <= high (a match of ``before`` at p - 1), or None; searched
    backwards in blocks so that a cut near ``high`` is found without scanning from ``low``."""
    end = min(high + 2, len(text))  # a match at q needs text[q + 2] (its lookahead) before end
    while True:
        begin = max(low, end - _CUT_SEARCH_BLOCK)
        last = collections.deque(before.finditer(text, begin, end), maxlen=1)
        if last:
            return last[0].start() + 1
        if begin == low:
            return None
        end = begin + 2


def text_pieces(text: str, cuts: Cuts, where: str, field: str, **limits: int) -> Iterator[str]:
    """The pieces of ``text`` (``piece_bounds``), sliced one at a time; bounds and refusals are
    found before the first piece is given."""
    bounds = piece_bounds(text, cuts, where, field, **limits)
    for start, stop in itertools.pairwise(bounds):
        yield text[start:stop]


MAX_VOCAB_SIZE = 2 ** 31 - 1  # ids a prepared corpus stores (uint32) and the tokenizers library trains


def _untrained_bpe() -> Tokenizer:
    """The tokenizer ``train_bpe`` trains: byte-level BPE, no prefix space."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train_bpe_cuts() -> Cuts:
    """Where ``train_bpe`` cuts a long text: before an ASCII whitespace character between two
    non-whitespace ones (its pre-tokenizer's words never span one, so the words it counts, and
    the tokenizer it trains, are those of the whole text)."""
    return tokenizer_cuts(_untrained_bpe())


def vocabulary_shortfall(trained: int, asked: int, min_frequency: int = 2) -> str | None:
    """One line for a trained vocabulary smaller than the one asked (the trainer stops merging when
    no pair is seen ``min_frequency`` times), or None when it has them all."""
    if trained >= asked:
        return None
    return (f"--vocab-size: the tokenizer has {trained:,} of the {asked:,} tokens asked: the input holds no more "
            f"pairs seen at least {min_frequency} times to merge; train on more text for more tokens, or use it "
            f"as is with model.vocab_size >= {trained:,}")


def train_bpe(texts: Iterable[str], vocab_size: int, out_dir: str | pathlib.Path, *, min_frequency: int = 2,
              progress: bool = False, overwrite: bool = False) -> pathlib.Path:
    """Trains a byte-level BPE (every byte in its alphabet, ``<|endoftext|>`` its one special token)
    on ``texts`` and saves it as ``out_dir/tokenizer.json``, which it returns. The same texts give
    the same file. An existing ``tokenizer.json`` is an error unless ``overwrite``; then it is
    replaced only once the new one is written whole. A text longer than ``PIECE_CHARS`` reaches
    the trainer in pieces (``piece_bounds`` with ``train_bpe_cuts``: the same words, so the same
    file; pass ``DocumentReader.pieces`` to have a refusal name the input's file or line)."""
    if vocab_size < BYTE_ALPHABET_SIZE + 1:
        raise ConfigError("--vocab-size", f"must be at least {BYTE_ALPHABET_SIZE + 1} (the {BYTE_ALPHABET_SIZE} "
                          f"bytes and {TRAINED_EOS_TOKEN}), got {vocab_size}")
    if vocab_size > MAX_VOCAB_SIZE:  # the tokenizers library aborts the process on larger ones
        raise ConfigError("--vocab-size", f"must be at most {MAX_VOCAB_SIZE:,} (2**31 - 1), got {vocab_size:,}")
    out = writable_directory(out_dir, "--out")  # before training, not after
    if (out / TOKENIZER_FILE).exists() and not overwrite:
        raise ConfigError("--out", f"{out} already has a {TOKENIZER_FILE}; remove it, choose another directory "
                          "or pass --overwrite")
    tokenizer = _untrained_bpe()
    cuts = tokenizer_cuts(tokenizer)
    pieces = (piece for number, text in enumerate(texts)
              for piece in text_pieces(text, cuts, f"text {number} given to train_bpe", "--input"))
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=progress,
                                  special_tokens=[TRAINED_EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(pieces, trainer)
    write_file(out / TOKENIZER_FILE, tokenizer.to_str(pretty=True).encode())
    return out / TOKENIZER_FILE

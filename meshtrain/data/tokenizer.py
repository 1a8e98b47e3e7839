"""Hugging Face ``tokenizers`` tokenizers: loading one (a ``tokenizer.json`` or a directory holding
one), finding its end-of-document token, and training a byte-level BPE on local text."""

from __future__ import annotations

import hashlib
import pathlib
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from meshtrain.data.files import write_file
from meshtrain.errors import ConfigError, writable_directory

TOKENIZER_FILE = "tokenizer.json"
# End-of-document tokens of the common families, in the order they are looked for.
COMMON_EOS_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>")
TRAINED_EOS_TOKEN = "<|endoftext|>"
BYTE_ALPHABET_SIZE = 256
_HASH_CHUNK_BYTES = 1 << 20


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
        return Tokenizer.from_file(str(file))
    except Exception as err:  # noqa: BLE001 - the Rust side raises plain Exception for every parse failure
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(field, f"{file} is not a Hugging Face tokenizer.json ({reason[:120]})") from None


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


MAX_VOCAB_SIZE = 2 ** 31 - 1  # ids a prepared corpus stores (uint32) and the tokenizers library trains


def train_bpe(texts: Iterable[str], vocab_size: int, out_dir: str | pathlib.Path, *, min_frequency: int = 2,
              progress: bool = False, overwrite: bool = False) -> pathlib.Path:
    """Trains a byte-level BPE (every byte in its alphabet, ``<|endoftext|>`` its one special token)
    on ``texts`` and saves it as ``out_dir/tokenizer.json``, which it returns. The same texts give
    the same file. An existing ``tokenizer.json`` is an error unless ``overwrite``; then it is
    replaced only once the new one is written whole."""
    if vocab_size < BYTE_ALPHABET_SIZE + 1:
        raise ConfigError("--vocab-size", f"must be at least {BYTE_ALPHABET_SIZE + 1} (the {BYTE_ALPHABET_SIZE} "
                          f"bytes and {TRAINED_EOS_TOKEN}), got {vocab_size}")
    if vocab_size > MAX_VOCAB_SIZE:  # the tokenizers library aborts the process on larger ones
        raise ConfigError("--vocab-size", f"must be at most {MAX_VOCAB_SIZE:,} (2**31 - 1), got {vocab_size:,}")
    out = writable_directory(out_dir, "--out")  # before training, not after
    if (out / TOKENIZER_FILE).exists() and not overwrite:
        raise ConfigError("--out", f"{out} already has a {TOKENIZER_FILE}; remove it, choose another directory "
                          "or pass --overwrite")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=progress,
                                  special_tokens=[TRAINED_EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    write_file(out / TOKENIZER_FILE, tokenizer.to_str(pretty=True).encode())
    return out / TOKENIZER_FILE

"""A prepared corpus as training reads it (``python -m meshtrain.data prepare`` / ``prepare-sft``
write it: ``meshtrain.data.corpus``): ``PreparedCorpus.open`` checks ``index.json`` and its files, each
split's shards are read through memory maps, with the documents' starts and, for a fine-tuning corpus,
the loss mask."""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Callable

import numpy as np

from meshtrain import jsonio
from meshtrain.data.tokenizer import file_sha256
from meshtrain.errors import ConfigError

FORMAT = "meshtrain-corpus/1"
INDEX_FILE = "index.json"
INCOMPLETE_MARKER = ".prepare-incomplete"  # in a directory being prepared, until index.json is written
TRAIN, VAL = "train", "val"
MASK_SUFFIX = ".mask.bin"  # a shard's loss mask: train-00000.bin -> train-00000.mask.bin
_HASH_CHUNK_TOKENS = 1 << 24


@dataclasses.dataclass(frozen=True)
class TokenizerRecord:
    """The tokenizer a corpus was prepared with. file: absolute path of its copy in the directory."""

    file: str
    sha256: str
    vocab_size: int
    eos: str
    eos_id: int


class CorpusSplit:
    """One split: the concatenation of its shards' tokens, read through a memory map per shard.

    Attributes: name, num_tokens, num_documents, text_bytes (UTF-8 bytes of the documents' text),
    shard_paths (absolute paths of the ``.bin`` shards, in order); for a fine-tuning corpus
    ``mask_paths`` (their ``.mask.bin`` loss masks) and ``loss_tokens`` (how many are 1), else
    ``mask_paths`` empty and ``loss_tokens`` None.
    """

    def __init__(self, name: str, record: dict, directory: pathlib.Path, dtype: np.dtype, field: str,
                 masked: bool = False):
        self.name, self.dtype, self.field = name, dtype, field
        self.num_tokens, self.num_documents = int(record["tokens"]), int(record["documents"])
        self.text_bytes = int(record["text_bytes"])
        self.shard_files = [shard["file"] for shard in record["shards"]]  # as index.json names them
        self.shard_paths = [str(directory / name) for name in self.shard_files]
        self.mask_paths = [path.removesuffix(".bin") + MASK_SUFFIX for path in self.shard_paths] if masked else []
        self.loss_tokens = int(record["loss_tokens"]) if masked else None
        self._shards = record["shards"]
        self._bounds = np.cumsum([0] + [int(shard["tokens"]) for shard in self._shards])  # [shards + 1]
        self._maps: dict[int, np.memmap] = {}
        self._mask_maps: dict[int, np.memmap] = {}
        self._document_starts: np.ndarray | None = None

    @property
    def has_loss_mask(self) -> bool:
        """Whether the split carries a loss mask (a fine-tuning corpus)."""
        return bool(self.mask_paths)

    def _map(self, shard: int) -> np.memmap:
        if shard not in self._maps:
            self._maps[shard] = np.memmap(self.shard_paths[shard], dtype=self.dtype, mode="r")
        return self._maps[shard]

    def _mask_map(self, shard: int) -> np.memmap:
        if shard not in self._mask_maps:
            self._mask_maps[shard] = np.memmap(self.mask_paths[shard], dtype=np.uint8, mode="r")
        return self._mask_maps[shard]

    def _read(self, start: int, stop: int, shard_map: Callable[[int], np.memmap], dtype: np.dtype) -> np.ndarray:
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"[{start}, {stop}) is outside the {self.name} split's {self.num_tokens} tokens")
        pieces, position = [], start
        while position < stop:
            shard = int(np.searchsorted(self._bounds, position, side="right")) - 1
            end = min(stop, int(self._bounds[shard + 1]))
            pieces.append(shard_map(shard)[position - self._bounds[shard]:end - self._bounds[shard]])
            position = end
        return np.concatenate(pieces) if pieces else np.empty(0, dtype)

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [stop - start] at [start, stop) of the split's stream (a copy, stored dtype); the
        range may span shards."""
        return self._read(start, stop, self._map, self.dtype)

    def loss_mask(self, start: int, stop: int) -> np.ndarray:
        """uint8 [stop - start]: the loss mask of the tokens at [start, stop) (1: a loss target);
        only for a split that ``has_loss_mask``."""
        if not self.has_loss_mask:
            raise ValueError(f"the {self.name} split has no loss mask")
        return self._read(start, stop, self._mask_map, np.dtype(np.uint8))

    def _shard_starts(self, shard: int) -> np.ndarray:
        """int64 [documents + 1] of one shard, checked against its index entry."""
        path = self.shard_paths[shard].removesuffix(".bin") + ".docs.npy"
        try:
            starts = np.load(path)
        except (OSError, ValueError) as err:
            raise ConfigError(self.field, f"{path} is not readable ({err}); prepare the corpus again") from None
        entry = self._shards[shard]
        if (starts.dtype != np.int64 or starts.shape != (int(entry["documents"]) + 1,) or starts[0] != 0
                or starts[-1] != int(entry["tokens"]) or np.any(np.diff(starts) < 1)):
            raise ConfigError(self.field, f"{path} does not match its shard ({entry['documents']} documents, "
                              f"{entry['tokens']} tokens); prepare the corpus again")
        return starts

    def document_starts(self) -> np.ndarray:
        """int64 [num_documents + 1] (read-only): where each document starts in the split's stream;
        the last entry is num_tokens."""
        if self._document_starts is None:
            parts = [self._shard_starts(shard)[:-1] + self._bounds[shard] for shard in range(len(self._shards))]
            starts = np.concatenate(parts + [np.array([self.num_tokens], np.int64)])
            starts.flags.writeable = False
            self._document_starts = starts
        return self._document_starts

    def verify(self, eos_id: int, vocab_size: int) -> None:
        """Checks every shard's SHA-256, its document offsets, that every document ends in
        ``eos_id`` and that every id is below ``vocab_size``; ``ConfigError`` at the first fault."""
        for shard, path in enumerate(self.shard_paths):
            if file_sha256(path) != self._shards[shard]["sha256"]:
                raise ConfigError(self.field, f"{path}: SHA-256 differs from index.json; the shard changed")
            if self.has_loss_mask:
                mask_path = self.mask_paths[shard]
                if file_sha256(mask_path) != self._shards[shard]["mask_sha256"]:
                    raise ConfigError(self.field, f"{mask_path}: SHA-256 differs from index.json; the loss mask "
                                      "changed")
                if int(self._mask_map(shard).max(initial=0)) > 1:
                    raise ConfigError(self.field, f"{mask_path}: a loss mask value is not 0 or 1; prepare the "
                                      "corpus again")
            tokens = self._map(shard)
            if np.any(tokens[self._shard_starts(shard)[1:] - 1] != eos_id):
                raise ConfigError(self.field, f"{path}: a document does not end in the EOS id {eos_id}")
            for chunk in range(0, len(tokens), _HASH_CHUNK_TOKENS):
                high = int(tokens[chunk:chunk + _HASH_CHUNK_TOKENS].max())
                if high >= vocab_size:
                    raise ConfigError(self.field, f"{path}: token id {high} is not below the vocabulary size "
                                      f"{vocab_size}; the corpus is damaged or its index.json forged: prepare it "
                                      "again")


def _index_error(path: pathlib.Path, field: str, problem: str) -> ConfigError:
    return ConfigError(field, f"{path / INDEX_FILE} {problem}; prepare the corpus again")


@dataclasses.dataclass(frozen=True, eq=False)
class PreparedCorpus:
    """A prepared directory, opened. path: absolute; dtype: the shards' id type; splits by name;
    loss_mask: index.json's entry of a fine-tuning corpus (``prepare-sft``: its chat template), else
    None."""

    path: str
    dtype: np.dtype
    tokenizer: TokenizerRecord
    splits: dict[str, CorpusSplit]
    loss_mask: dict | None = None

    @classmethod
    def open(cls, path: str, field: str = "data.path") -> PreparedCorpus:
        """Reads ``path/index.json`` and checks that every shard is there with the size it should
        have (not its hash: see ``verify``); a one-line ``ConfigError(field)`` otherwise."""
        directory = pathlib.Path(path).absolute()
        if not directory.is_dir():
            raise ConfigError(field, f"{path} is not a directory")
        if (directory / INCOMPLETE_MARKER).exists():
            raise ConfigError(field, f"{path}: preparation was interrupted; rerun prepare")
        if not (directory / INDEX_FILE).is_file():
            raise ConfigError(field, f"{path} is not a prepared directory (no {INDEX_FILE}); make one with "
                              "python -m meshtrain.data prepare")
        try:
            index = jsonio.loads((directory / INDEX_FILE).read_text())
        except (ValueError, UnicodeDecodeError) as err:
            raise _index_error(directory, field, f"is not JSON ({err})") from None
        if not isinstance(index, dict) or index.get("format") != FORMAT:
            found = index.get("format") if isinstance(index, dict) else None
            raise _index_error(directory, field, f"has format {found!r}, not {FORMAT!r}")
        try:
            dtype = np.dtype({"uint16": "<u2", "uint32": "<u4"}[index["dtype"]])
            record = index["tokenizer"]
            tokenizer = TokenizerRecord(str(directory / record["file"]), record["sha256"], int(record["vocab_size"]),
                                        record["eos"], int(record["eos_id"]))
            masked = "loss_mask" in index
            splits = {name: CorpusSplit(name, split, directory, dtype, field, masked)
                      for name, split in index["splits"].items()}
            shard_tokens = {name: [int(shard["tokens"]) for shard in split["shards"]]
                            for name, split in index["splits"].items()}
            if masked:  # a fine-tuning corpus: every shard's mask has its hash
                loss_mask = index["loss_mask"]
                template = loss_mask["chat_template"]
                hashes = [shard["mask_sha256"] for split in index["splits"].values() for shard in split["shards"]]
                if not all(isinstance(h, str) for h in [*hashes, template["sha256"]]):
                    raise TypeError("a mask_sha256 or the chat template's sha256 is not a string")
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise _index_error(directory, field, f"is malformed ({type(err).__name__}: {err})") from None
        named = [("tokenizer", record["file"])] + [(f"{name} shard", shard) for name, split in splits.items()
                                                   for shard in split.shard_files]
        if masked:
            named.append(("chat template", template.get("file")))
        outside = next(((what, name) for what, name in named if not jsonio.is_plain_file_name(name)), None)
        if outside is not None:  # read from outside the directory otherwise
            raise _index_error(directory, field, f"names {outside[0]} file {outside[1]!r}, which is not a plain file "
                               "name in its directory (no directory part, not . or ..)")
        if TRAIN not in splits:
            raise _index_error(directory, field, f"has no {TRAIN!r} split")
        for name, split in splits.items():
            if sum(shard_tokens[name]) != split.num_tokens:
                raise _index_error(directory, field, f"counts {split.num_tokens} {name} tokens but its shards "
                                   f"{sum(shard_tokens[name])}")
            for shard_path, tokens in zip(split.shard_paths, shard_tokens[name]):
                if not os.path.isfile(shard_path):
                    raise ConfigError(field, f"{shard_path} is missing; prepare the corpus again")
                if os.path.getsize(shard_path) != tokens * dtype.itemsize:
                    raise ConfigError(field, f"{shard_path} has {os.path.getsize(shard_path)} bytes, not "
                                      f"{tokens} tokens x {dtype.itemsize}; prepare the corpus again")
            for mask_path, tokens in zip(split.mask_paths, shard_tokens[name]):
                if not os.path.isfile(mask_path) or os.path.getsize(mask_path) != tokens:
                    found = f"has {os.path.getsize(mask_path)} bytes" if os.path.isfile(mask_path) else "is missing"
                    raise ConfigError(field, f"{mask_path} (a loss mask of {tokens} tokens) {found}; prepare the "
                                      "corpus again")
        return cls(str(directory), dtype, tokenizer, splits, index["loss_mask"] if masked else None)

    def split(self, name: str, field: str = "data.path") -> CorpusSplit:
        """The split called ``name``; ``ConfigError(field)`` when the corpus has none."""
        if name not in self.splits:
            hint = "; prepare with --val-fraction or --val-input" if name == VAL else ""
            raise ConfigError(field, f"{self.path} has no {name!r} split (it has {', '.join(self.splits)}){hint}")
        return self.splits[name]

    def verify(self, field: str = "data.path") -> None:
        """Reads everything: the tokenizer's and every shard's SHA-256 against index.json, the
        document offsets, the EOS ending every document; ``ConfigError(field)`` at the first fault."""
        if file_sha256(self.tokenizer.file) != self.tokenizer.sha256:
            raise ConfigError(field, f"{self.tokenizer.file}: SHA-256 differs from index.json")
        if self.loss_mask is not None:
            template = os.path.join(self.path, self.loss_mask["chat_template"]["file"])
            if not os.path.isfile(template) or file_sha256(template) != self.loss_mask["chat_template"]["sha256"]:
                raise ConfigError(field, f"{template}: missing or its SHA-256 differs from index.json")
        for split in self.splits.values():
            split.verify(self.tokenizer.eos_id, self.tokenizer.vocab_size)


def is_prepared_dir(path: str) -> bool:
    """Whether ``path`` is a directory holding an ``index.json`` (complete or not: open checks)."""
    return os.path.isfile(os.path.join(path, INDEX_FILE))

"""File sources: token streams read from files, cut into windows, and mixtures of them.

Readers give a ``TokenStream`` and its ``StreamInfo``: ``text_stream`` (local files as bytes: tokens
0..255) and ``id_stream`` (a prepared directory's split, ``meshtrain/data/corpus.py``, or
pre-tokenised ids in one ``.npy`` or raw ``.bin`` file). ``FileDataset`` serves a stream's windows
of ``seq_len + 1`` tokens, shuffled per epoch (or in order, for evaluation), as
``TokenDataset.rows``; ``MixtureDataset`` draws examples from several datasets with weights.

Windows: without document boundaries (``packing: concat``) the stream is cut into windows and the
incomplete tail dropped; with them (``packing: documents``, prepared directories) the same windows
are taken, the tail padded, and per-token ``positions`` and ``segments`` (``models.api.Documents``)
added so that no token attends across a document boundary, positions restart at each document, and
no target is the first token of a document predicted from the one before (its ``mask`` is 0, as is
padding's).

A fine-tuning corpus (``prepare-sft``) carries a loss mask per token (1 on response tokens): a
target counts only where it is 1, under either packing (``mask`` is the product of both), so the
loss, its gradients and the held-out evaluation are over the responses alone.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import glob
import os
import stat
import sys
from typing import Protocol
from collections.abc import Callable

import grain
import numpy as np

from meshtrain.data.prepared import CorpusSplit, PreparedCorpus
from meshtrain.data.dataset import SHUFFLE_STREAM, TokenDataset, as_rows, check_indices
from meshtrain.data.tokenizer import file_sha256, load_tokenizer, tokenizer_file
from meshtrain.errors import ConfigError

TRAIN_SPLIT = "train"
TOKEN_DTYPES = ("uint8", "uint16", "uint32", "int32", "int64")  # of a raw .bin file
_MAX_CHECK_CHUNK = 1 << 24  # tokens per chunk when scanning a file for its largest id


class TokenStream(Protocol):
    """A split's tokens as one stream: a prepared split (``CorpusSplit``) or an ``ArrayStream``."""

    num_tokens: int

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [stop - start] of the stream."""


class ArrayStream:
    """A 1-D token array (memory-mapped from a file, or in memory) as a ``TokenStream``."""

    def __init__(self, array: np.ndarray):
        self.array, self.num_tokens = array, int(array.shape[0])

    def tokens(self, start: int, stop: int) -> np.ndarray:
        return self.array[start:stop]


@dataclasses.dataclass(frozen=True)
class StreamInfo:
    """What a token stream's source knows about it besides its tokens.

    Attributes:
      label: for the start-up line. watched: files the stream reads, checked for changes before
      every read. document_starts: int64 [documents + 1] offsets where each document starts (last =
      num_tokens), for ``packing: documents``. bytes_per_token, tokenizer_file: see ``TokenDataset``;
      tokenizer_sha256: that file's hash. loss_mask: the stream has ``loss_mask(start, stop)`` (uint8,
      1 where a token is a loss target: a fine-tuning corpus's response tokens).
    """

    label: str
    watched: tuple[str, ...] = ()
    document_starts: np.ndarray | None = None
    bytes_per_token: float | None = None
    tokenizer_file: str | None = None
    tokenizer_sha256: str | None = None
    loss_mask: bool = False


class FileDataset:
    """Windows of ``seq_len + 1`` tokens of a token stream, shuffled per epoch (or in order).

    Example ``i`` is window ``perm_e(i % num_windows)`` of epoch ``e = i // num_windows``, where
    ``perm_e`` is grain's seeded index shuffle (a different permutation every epoch); unshuffled
    (``shuffle=False``, evaluation) example ``i`` is window ``i % num_windows``. Without document
    boundaries the incomplete tail is dropped; with them (``packing: documents``) it is padded with
    token 0 in segment 0, masked. A stream with a loss mask (``StreamInfo.loss_mask``) zeroes
    ``mask`` where the target is not a loss target.
    """

    entropy_floor = None

    def __init__(self, stream: TokenStream, info: StreamInfo, *, seq_len: int, seed: int, shuffle: bool = True):
        self.stream, self.info, self.seq_len = stream, info, seq_len
        self.bytes_per_token, self.tokenizer_file = info.bytes_per_token, info.tokenizer_file
        # A memory-mapped file that shrinks under the run would kill it with SIGBUS on the next read:
        # its identity is checked before every read instead (one stat call per file).
        self._identities = {path: _identity(path) for path in info.watched}
        window = seq_len + 1
        self.num_windows = (stream.num_tokens // window if info.document_starts is None
                            else -(-stream.num_tokens // window))
        order = grain.MapDataset.range(self.num_windows)
        if shuffle:
            shuffle_seed = int(np.random.SeedSequence([SHUFFLE_STREAM, seed]).generate_state(1)[0])
            order = order.shuffle(seed=shuffle_seed)
        self._order = order.repeat()

    def windows(self, indices: np.ndarray) -> np.ndarray:
        """Window numbers int64 [n] of global example indices int64 [n]."""
        return np.array([self._order[int(i)] for i in check_indices(indices)], np.int64)

    def rows(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Examples for global indices int64 [n]; see TokenDataset.rows.

        Raises:
          DataChanged: a memory-mapped token file was truncated, replaced or rewritten.
        """
        for path, identity in self._identities.items():
            now = _identity(path)
            if now != identity:
                change = f"{identity[0]} -> {now[0]} bytes" if now[0] != identity[0] else "rewritten or replaced"
                raise DataChanged("data.path", f"{path} changed while training ({change})")
        window, total = self.seq_len + 1, self.stream.num_tokens
        starts = self.windows(indices) * window
        tokens = np.zeros((starts.shape[0], window), np.int64)
        loss_mask = np.zeros((starts.shape[0], window), np.float32) if self.info.loss_mask else None
        for row, start in enumerate(starts):
            stop = min(int(start) + window, total)
            piece = self.stream.tokens(int(start), stop)
            tokens[row, :piece.shape[0]] = piece
            if loss_mask is not None:
                loss_mask[row, :piece.shape[0]] = self.stream.loss_mask(int(start), stop)
        rows = as_rows(tokens)
        if self.info.document_starts is not None:
            rows.update(_document_spans(starts, window, self.info.document_starts, total))
        if loss_mask is not None:  # a target counts only where it is a response token
            rows["mask"] = rows["mask"] * loss_mask[:, 1:]
        return rows

    def describe(self) -> str:
        packing = "documents" if self.info.document_starts is not None else "concat"
        masked = ""
        if self.info.loss_mask:
            share = self.stream.loss_tokens / max(self.stream.num_tokens, 1)
            masked = f", loss on the {self.stream.loss_tokens:,} response tokens ({share:.1%}) only"
        return (f"data: {self.info.label}: {self.stream.num_tokens:,} tokens, {self.num_windows:,} "
                f"windows of {self.seq_len + 1}, packing {packing}{masked}; entropy floor unknown")


def _document_spans(starts: np.ndarray, window: int, document_starts: np.ndarray,
                    num_tokens: int) -> dict[str, np.ndarray]:
    """mask f32, positions and segments int32, each [n, window - 1], of the windows beginning at
    ``starts`` [n]: a target counts only when it continues the document of its input; positions
    count from the document's first token in the window; segments number the window's documents
    from 1; padding (past the stream's end) is segment 0, masked."""
    index = starts[:, None] + np.arange(window)  # [n, window] positions in the stream
    valid = index < num_tokens
    document = np.searchsorted(document_starts, index, side="right") - 1
    first = np.maximum(document_starts[document], starts[:, None])
    positions = np.where(valid, index - first, 0)
    segments = np.where(valid, document - document[:, :1] + 1, 0)
    mask = (document[:, 1:] == document[:, :-1]) & valid[:, 1:]
    return {"mask": mask.astype(np.float32), "positions": positions[:, :-1].astype(np.int32),
            "segments": segments[:, :-1].astype(np.int32)}


class MixtureDataset:
    """Examples drawn from several datasets with weights: example ``i`` is example ``j`` of dataset
    ``d``, with ``(d, j)`` from grain's deterministic weighted interleave (``MapDataset.mix``: every
    prefix holds each dataset in proportion to its weight, to within one example)."""

    entropy_floor = None

    def __init__(self, datasets: list[TokenDataset], weights: list[float], labels: list[str]):
        self.datasets, self.seq_len = datasets, datasets[0].seq_len
        self.weights = [w / sum(weights) for w in weights]
        self.labels = labels
        sources = [grain.MapDataset.range(sys.maxsize).map(functools.partial(_tagged, d))
                   for d in range(len(datasets))]
        self._mixed = grain.MapDataset.mix(sources, self.weights)
        self.tokenizer_file = datasets[0].tokenizer_file
        per_byte = [d.bytes_per_token for d in datasets]
        self.bytes_per_token = None if None in per_byte else float(np.dot(self.weights, per_byte))

    def sources(self, indices: np.ndarray) -> np.ndarray:
        """int64 [n, 2]: (dataset, its example) of each global example index."""
        return np.array([self._mixed[int(i)] for i in check_indices(indices)], np.int64).reshape(-1, 2)

    def rows(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        picks = self.sources(indices)
        parts = {d: self.datasets[d].rows(picks[picks[:, 0] == d, 1]) for d in np.unique(picks[:, 0])}
        first = next(iter(parts.values()))
        rows = {key: np.empty((picks.shape[0], *value.shape[1:]), value.dtype) for key, value in first.items()}
        for d, part in parts.items():
            for key, value in part.items():
                rows[key][picks[:, 0] == d] = value
        return rows

    def describe(self) -> str:
        entries = ", ".join(f"{w:.3g} x {label}" for w, label in zip(self.weights, self.labels))
        return f"data: mixture of {len(self.datasets)}: {entries}; entropy floor unknown"


def _tagged(dataset: int, example: int) -> tuple[int, int]:
    return dataset, example


class DataChanged(ConfigError):
    """The data a run reads changed under it (the loop saves and stops with one line)."""


def _identity(path: str) -> tuple[int, int, int]:
    """(size, modification time ns, inode) of ``path``; (-1, -1, -1) when it is gone."""
    try:
        info = os.stat(path)
    except OSError:
        return (-1, -1, -1)
    return (info.st_size, info.st_mtime_ns, info.st_ino)


# What each source reads, for the errors that name a path that is not there.
TEXT_INPUTS = "a text file, a directory of them or a quoted glob ('data/**/*.txt')"
ID_INPUTS = "a prepared directory (python -m meshtrain.data prepare) or a .npy or .bin file of token ids"
_MAX_LISTED = 10_000  # directory entries compared with a missing name for a close spelling


def missing_path(path: str, field: str, accepted: str) -> ConfigError:
    """The one-line error for ``path`` that does not exist: it says so (a broken symbolic link, or
    no such file or directory), names a close spelling beside it when there is one and what
    ``field`` accepts."""
    if os.path.islink(path):
        return ConfigError(field, f"{path} is a broken symbolic link; give {accepted}")
    parent, name = os.path.split(path.rstrip(os.sep) or path)
    close = ""
    try:
        with os.scandir(parent or ".") as entries:
            names = [entry.name for _, entry in zip(range(_MAX_LISTED), entries)]
        match = difflib.get_close_matches(name, names, n=1)
        close = f" (did you mean {os.path.join(parent, match[0])}?)" if match else ""
    except OSError:  # the parent is missing too, or unreadable
        pass
    return ConfigError(field, f"no such file or directory: {path}{close}; give {accepted}")


def _text_files(path: str, field: str = "data.path") -> list[str]:
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):
        found = [os.path.join(d, f) for d, _, names in os.walk(path) for f in names]
    elif not glob.has_magic(path):
        raise missing_path(path, field, TEXT_INPUTS)
    else:
        found = glob.glob(path, recursive=True)
    files = sorted(f for f in found if os.path.isfile(f))
    if not files:
        what = f"the directory {path} holds no files" if os.path.isdir(path) else f"no files match the glob {path}"
        raise ConfigError(field, f"{what}; give {TEXT_INPUTS}")
    return files


def _memmapped(array: np.ndarray) -> tuple[str, ...]:
    return (array.filename,) if isinstance(array, np.memmap) and array.filename else ()


def text_stream(path: str, field: str, vocab_size: int) -> tuple[TokenStream, StreamInfo]:
    if vocab_size < 256:
        raise ConfigError("model.vocab_size", f"is {vocab_size}; source 'text' uses byte tokens "
                          "0..255, so it must be >= 256")
    files = _text_files(path, field)
    if len(files) == 1:
        size = os.path.getsize(files[0])
        tokens = np.memmap(files[0], np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    else:
        tokens = np.concatenate([np.fromfile(f, np.uint8) for f in files])
    label = f"text bytes from {path} ({len(files)} file{'s' * (len(files) > 1)})"
    return ArrayStream(tokens), StreamInfo(label, _memmapped(tokens), bytes_per_token=1.0)


def _load_npy(path: str, field: str, token_dtype: str) -> np.ndarray:
    del token_dtype
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:  # truncated, header only, random bytes, pickled
        raise ConfigError(field, f"{path} is not a readable .npy array of token ids "
                          f"({' '.join(str(err).split())[:160]})") from None
    if not isinstance(tokens, np.ndarray):
        raise ConfigError(field, f"{path} is not a single .npy array (an .npz archive?)")
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise ConfigError(field, f"{path} holds {tokens.dtype} {tokens.shape}; "
                          "expected a 1-D integer array of token ids")
    return tokens


def _load_bin(path: str, field: str, token_dtype: str) -> np.ndarray:
    dtype = np.dtype(token_dtype)
    size = os.path.getsize(path)
    if size % dtype.itemsize:
        raise ConfigError(field, f"{path} has {size} bytes, not a whole number of "
                          f"{token_dtype} tokens; is data.token_dtype right?")
    return np.memmap(path, dtype, mode="r") if size else np.zeros(0, dtype)


_ID_LOADERS: dict[str, Callable[[str, str, str], np.ndarray]] = {".npy": _load_npy, ".bin": _load_bin}


def _check_regular_file(path: str, field: str) -> None:
    """A ConfigError on ``field`` unless ``path`` is a regular file (or a link to one)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        what = "a broken symbolic link" if os.path.islink(path) else "no such file"
        raise ConfigError(field, f"{what}: {path}") from None
    except OSError as err:  # a symlink loop, a name too long, no permission
        raise ConfigError(field, f"cannot open {path}: {err.strerror or err}") from None
    if not stat.S_ISREG(mode):
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "not a regular file")
        raise ConfigError(field, f"{path} is {kind}; give a prepared directory or a .npy or .bin file "
                          "of token ids")


def _check_ids(tokens: np.ndarray, path: str, field: str, vocab_size: int) -> None:
    for start in range(0, tokens.shape[0], _MAX_CHECK_CHUNK):
        chunk = tokens[start:start + _MAX_CHECK_CHUNK]
        low, high = int(chunk.min()), int(chunk.max())
        if high >= vocab_size or low < 0:
            bad = high if high >= vocab_size else low
            raise ConfigError(field, f"token id {bad} in {path} is outside [0, "
                              f"model.vocab_size {vocab_size}); raise model.vocab_size or fix the "
                              "tokenizer/data.token_dtype")


def given_tokenizer(tokenizer_path: str, vocab_size: int) -> tuple[str, str] | None:
    """(tokenizer.json path, sha256) of ``data.tokenizer`` (``tokenizer_path``; empty: None), checked
    against the vocabulary."""
    if not tokenizer_path:
        return None
    tokenizer = load_tokenizer(tokenizer_path, "data.tokenizer")
    path = str(tokenizer_file(tokenizer_path))
    if tokenizer.get_vocab_size() > vocab_size:
        raise ConfigError("model.vocab_size", f"is {vocab_size}, smaller than the {tokenizer.get_vocab_size()} "
                          f"tokens of data.tokenizer {path}; raise model.vocab_size")
    return path, file_sha256(path)


def id_stream(path: str, field: str, vocab_size: int, given: tuple[str, str] | None, *, documents: bool,
              token_dtype: str, split: str = TRAIN_SPLIT) -> tuple[TokenStream, StreamInfo]:
    """The token stream at ``path``: a prepared directory's ``split``, or one .npy/.bin file of
    ``token_dtype`` ids. ``given``: ``data.tokenizer``'s (path, sha256) from ``given_tokenizer``;
    ``documents``: ``packing: documents`` (the stream records its document boundaries)."""
    if not os.path.exists(path):  # before anything that would describe what it is
        raise missing_path(path, field, ID_INPUTS)
    if os.path.isdir(path):
        corpus = PreparedCorpus.open(path, field=field)
        record = corpus.tokenizer
        if given is not None and given[1] != record.sha256:
            raise ConfigError("data.tokenizer", f"{path} was prepared with another tokenizer ({record.file}, "
                              f"sha256 {record.sha256[:12]}) than data.tokenizer {given[0]} (sha256 "
                              f"{given[1][:12]}); prepare the corpus again with this tokenizer, or drop "
                              "data.tokenizer")
        if record.vocab_size > vocab_size:
            raise ConfigError("model.vocab_size", f"is {vocab_size}, smaller than the {record.vocab_size} "
                              f"tokens of the tokenizer {path} was prepared with; raise model.vocab_size")
        part: CorpusSplit = corpus.split(split, field=field)
        # One pass over the split's shards: their SHA-256 against index.json (a damaged byte) and every
        # id below the model's vocabulary (a forged index's vocab_size), before any step trains on them.
        part.verify(record.eos_id, vocab_size)
        starts = part.document_starts() if documents else None
        per_token = part.text_bytes / part.num_tokens if part.text_bytes and part.num_tokens else None
        info = StreamInfo(f"{path} ({split}: {part.num_documents:,} documents)",
                          tuple(part.shard_paths + part.mask_paths), starts, per_token, record.file, record.sha256,
                          loss_mask=part.has_loss_mask)
        return part, info
    if documents:
        raise ConfigError("data.packing", f"'documents' needs the document boundaries of a prepared "
                          f"directory (python -m meshtrain.data prepare); {path} is a single file of ids")
    _check_regular_file(path, field)
    load = _ID_LOADERS.get(os.path.splitext(path)[1])
    if load is None:
        raise ConfigError(field, f"{path}: expected a prepared directory or a .npy or .bin file of token ids")
    tokens = load(path, field, token_dtype)
    _check_ids(tokens, path, field, vocab_size)
    file, digest = given or (None, None)
    return ArrayStream(tokens), StreamInfo(f"tokens from {path}", _memmapped(tokens), tokenizer_file=file,
                                           tokenizer_sha256=digest)


def file_dataset(stream: TokenStream, info: StreamInfo, path: str, field: str, *, seq_len: int, seed: int,
                  shuffle: bool = True) -> FileDataset:
    if stream.num_tokens < (1 if info.document_starts is not None else seq_len + 1):
        raise ConfigError(field, f"{path} has {stream.num_tokens} tokens; need at least seq_len + 1 = "
                          f"{seq_len + 1}")
    return FileDataset(stream, info, seq_len=seq_len, seed=seed, shuffle=shuffle)

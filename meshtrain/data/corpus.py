"""Prepared corpora: text documents tokenized once into token shards that training memory-maps.

A prepared directory holds::

    index.json               the format, dtype, tokenizer and splits below; written last, atomically
    tokenizer.json           a copy of the tokenizer used
    train-00000.bin ...      raw little-endian ids of ``dtype``: each document's tokens, then EOS
    train-00000.docs.npy     int64 [documents + 1]: where each document starts in that shard
    val-00000.bin ...        the held-out split (with .docs.npy), when asked for

A supervised fine-tuning corpus (``prepare-sft``, ``meshtrain/data/sft.py``) also holds, per shard,
``train-00000.mask.bin`` (uint8 [tokens]: 1 where the token is a loss target, i.e. a response
token; 0 for the prompt and the template) and the chat template it was rendered with
(``chat_template.jinja``); ``index.json`` says so under ``loss_mask``.

``prepare`` writes one (``python -m meshtrain.data prepare``); ``PreparedCorpus.open`` reads it.
Documents never straddle shards, every file is written as ``*.tmp``, fsynced and renamed, and
``.prepare-incomplete`` marks a directory until its index is written: a rerun after an interruption
restarts cleanly and writes the same bytes as an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import fractions
import glob
import hashlib
import io
import itertools
import json
import os
import pathlib
import time
from typing import BinaryIO
from collections.abc import Callable, Iterator, Sequence

import numpy as np
from tokenizers import Tokenizer
from rich.console import Console
from rich.progress import (BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn,
                           TransferSpeedColumn)

from meshtrain import jsonio
from meshtrain.data import columnar
from meshtrain.data.files import commit_file, fsync_dir, write_file
from meshtrain.data.out_dir import claimed
from meshtrain.data.prepared import FORMAT, INCOMPLETE_MARKER, INDEX_FILE, MASK_SUFFIX, TRAIN, VAL, PreparedCorpus
from meshtrain.data.tokenizer import (MAX_PIECE_CHARS, PIECE_CHARS, TOKENIZER_FILE, Cuts, end_of_document_id,
                                      file_sha256, load_tokenizer, piece_bounds, tokenizer_cuts, tokenizer_file)
from meshtrain.errors import ConfigError, writable_directory
from meshtrain.run_lock import RunLock

DEFAULT_SHARD_TOKENS = 2 ** 27
BATCH_TEXT_BYTES = 4 << 20  # text per encode_batch_fast call
SNIFF_BYTES = 8192  # a file with a NUL byte or broken UTF-8 here is binary
JSONL_SUFFIX = ".jsonl"
_UINT16_VOCAB = 2 ** 16
_UINT32_VOCAB = 2 ** 32
_PARALLELISM_OFF = ("", "0", "false", "off", "no", "n", "f")


# ---- reading the input documents ----

def input_files(patterns: Sequence[str], field: str) -> list[pathlib.Path]:
    """The files the globs match (``**`` recursive), each once, in sorted absolute-path order: a
    matched directory that ``datasets``' ``save_to_disk`` wrote gives its Arrow files (its
    ``state.json`` and ``dataset_info.json`` are never input), other directories nothing; a
    ``ConfigError(field)`` when there are none or a glob matches no file."""
    if not patterns:
        raise ConfigError(field, "give at least one glob of input files")
    files = set()
    for pattern in patterns:
        paths, matched = glob.glob(pattern, recursive=True), []
        for path in paths:
            if os.path.isdir(path):
                matched += columnar.saved_dataset_files(path, field) or []
            elif os.path.isfile(path) and not columnar.is_saved_dataset_metadata(path, field):
                matched.append(path)
        if not matched:
            raise ConfigError(field, f"{pattern!r} matches no file{columnar.dataset_dict_hint(paths)}")
        files.update(os.path.abspath(path) for path in matched)
    return [pathlib.Path(path) for path in sorted(files)]


def _binary_reason(path: pathlib.Path, head: bytes) -> str | None:
    """Why the file starting with ``head`` is not read as text, or None when it is text."""
    if b"\0" in head:
        return f"binary: a NUL byte in its first {SNIFF_BYTES // 1024} KiB"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as err:
        if err.start < len(head) - 3:  # not just a character cut at the end of the sniffed bytes
            return f"not UTF-8 text (byte {err.start})"
    return None


class DocumentReader:
    """Iterates ``(text, utf8_bytes)`` over the documents of ``files`` in order: a ``.jsonl`` file
    holds one per line (its ``text_field``), a parquet or Arrow file one per row (its column
    ``text_field``, read a record batch at a time: ``columnar``), any other file is one document.
    Binary files are skipped with a one-line ``warn``, and so are null cells (one line per file
    with their count); empty documents and blank lines are skipped. The columnar files' columns are
    checked when the reader is made (a ``ConfigError``, before anything is read). Raises
    ``ConfigError(field)`` at the end when no document was found.

    Counters advanced while iterating: ``bytes_read`` (input bytes consumed, skipped files
    included; a columnar file's by the share of its rows or batches read), ``files_read``,
    ``skipped`` (binary files); ``where``: the file (``path``), line (``path:N``) or row
    (``path row N``, from 0) of the document last given.
    """

    def __init__(self, files: Sequence[pathlib.Path], text_field: str, field: str, warn: Callable[[str], None]):
        self.files, self.text_field, self.field, self.warn = list(files), text_field, field, warn
        self.bytes_read = self.files_read = self.skipped = 0
        self.where = ""
        for path in self.files:
            if columnar.is_columnar(path):
                columnar.check_text_column(path, text_field, field)

    def pieces(self, cuts: Cuts, *, piece_chars: int = PIECE_CHARS,
               max_chars: int = MAX_PIECE_CHARS) -> Iterator[tuple[str, int, bool]]:
        """``(piece, utf8_bytes, last)`` over the documents cut by ``piece_bounds`` (a document of
        at most ``piece_chars`` characters is one piece); ``last`` marks a document's final piece.
        A document that cannot be cut is refused (``ConfigError(field)`` naming its file or line)
        before any of its pieces is given."""
        for text, size in self:
            if len(text) <= piece_chars:
                yield text, size, True
                continue
            bounds = piece_bounds(text, cuts, self.where, self.field, piece_chars=piece_chars, max_chars=max_chars)
            for start, stop in itertools.pairwise(bounds):
                piece = text[start:stop]
                yield piece, len(piece.encode("utf-8")), stop == len(text)

    def __iter__(self) -> Iterator[tuple[str, int]]:
        documents = 0
        for path in self.files:
            for document in self._documents(path):
                documents += 1
                yield document
            self.files_read += 1
        if not documents:
            raise ConfigError(self.field, f"no text documents in {self.field} ({len(self.files)} files: "
                              f"{self.skipped} skipped as binary, the rest empty)")

    def _documents(self, path: pathlib.Path) -> Iterator[tuple[str, int]]:
        if columnar.is_columnar(path):
            yield from self._column_documents(path)
            return
        with open(path, "rb") as stream:
            head = stream.read(SNIFF_BYTES)
            reason = _binary_reason(path, head)
            if reason is None and path.suffix == JSONL_SUFFIX:
                stream.seek(0)
                yield from self._jsonl_documents(path, stream)
                return
            if reason is None:
                data = head + stream.read()
                try:
                    text = data.decode("utf-8")
                except UnicodeDecodeError as err:
                    reason = f"not UTF-8 text (byte {err.start})"
            if reason is not None:
                self.warn(f"warning: {self.field}: skipped {path} ({reason})")
                self.skipped += 1
                self.bytes_read += os.fstat(stream.fileno()).st_size
                return
        size = len(data)
        del data, head  # not held while the text is tokenized: a large document's bytes are its size again
        self.bytes_read += size
        self.where = str(path)
        if text:
            yield text, size

    def _column_documents(self, path: pathlib.Path) -> Iterator[tuple[str, int]]:
        start, file_bytes = self.bytes_read, path.stat().st_size
        row, nulls, first_null = 0, 0, None
        for texts, sizes, done in columnar.text_batches(path, self.text_field, self.field):
            for text, size in zip(texts, sizes):
                if text is None:
                    nulls += 1
                    first_null = row if first_null is None else first_null
                elif text:
                    self.where = f"{path} row {row}"
                    yield text, size
                row += 1
            self.bytes_read = start + round(file_bytes * done)
        self.bytes_read = start + file_bytes
        if nulls:
            self.warn(f"warning: {self.field}: {path}: skipped {nulls:,} null {self.text_field!r} cells (the first "
                      f"at row {first_null})")

    def _jsonl_documents(self, path: pathlib.Path, stream: BinaryIO) -> Iterator[tuple[str, int]]:
        for number, line in enumerate(stream, 1):
            self.bytes_read += len(line)
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = jsonio.loads(line, max_depth=None)  # a document's other fields are not ours to bound
            except ValueError as err:
                raise ConfigError(self.field, f"{where} is not a line of JSON ({err})") from None
            if not isinstance(record, dict) or self.text_field not in record:
                keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
                raise ConfigError("--text-field", f"{where} has no {self.text_field!r} field (it has: {keys})")
            text = record[self.text_field]
            if not isinstance(text, str):
                raise ConfigError("--text-field", f"{where}: {self.text_field!r} is a {type(text).__name__}, not text")
            try:
                size = len(text.encode("utf-8"))
            except UnicodeEncodeError:
                raise ConfigError(self.field, f"{where}: {self.text_field!r} holds a lone surrogate "
                                  f"(\\ud800-\\udfff escape), which is not text") from None
            del line, record  # not held while the text is tokenized
            self.where = where
            if text:
                yield text, size


# ---- writing a prepared directory ----

def token_dtype(vocab_size: int) -> np.dtype:
    """Little-endian uint16 when every id fits, else uint32; ``ConfigError`` beyond uint32."""
    if vocab_size > _UINT32_VOCAB:
        raise ConfigError("--tokenizer", f"a vocabulary of {vocab_size:,} ids does not fit uint32")
    return np.dtype("<u2" if vocab_size <= _UINT16_VOCAB else "<u4")


class _SplitWriter:
    """Appends one split's documents to shards ``{split}-NNNNN.bin`` + ``.docs.npy`` (and, when
    ``masked``, the loss mask ``.mask.bin``), closing a shard once it holds ``shard_tokens`` tokens
    (documents never straddle shards)."""

    def __init__(self, out: pathlib.Path, split: str, dtype: np.dtype, shard_tokens: int, masked: bool = False):
        self.out, self.split, self.dtype, self.shard_tokens, self.masked = out, split, dtype, shard_tokens, masked
        self.documents = self.tokens = self.text_bytes = self.loss_tokens = 0
        self.shards: list[dict] = []
        self._stream: BinaryIO | None = None
        self._mask_stream: BinaryIO | None = None
        self._hash = hashlib.sha256()  # of the open shard's bytes
        self._mask_hash = hashlib.sha256()  # of its mask's
        self._starts = [0]  # offsets in the open shard where its documents start, then its length

    def add(self, tokens: np.ndarray, lengths: np.ndarray, text_bytes: int, mask: np.ndarray | None = None) -> None:
        """tokens: [sum(lengths)] the documents' ids, each ending in EOS; lengths: [documents];
        mask: uint8 [sum(lengths)], 1 where a token is a loss target (``masked`` writers only)."""
        if (mask is not None) != self.masked:
            raise ValueError(f"a {'masked' if self.masked else 'plain'} split writer got mask={mask is not None}")
        ends = np.cumsum(lengths)
        first, offset = 0, 0  # first document not yet written, and where it starts in ``tokens``
        while first < len(lengths):
            room = self.shard_tokens - self._starts[-1]
            last = min(int(np.searchsorted(ends[first:] - offset, room)) + first, len(lengths) - 1)
            self._write(tokens[offset:ends[last]], ends[first:last + 1] - offset,
                        None if mask is None else mask[offset:ends[last]])
            first, offset = last + 1, int(ends[last])
            if self._starts[-1] >= self.shard_tokens:
                self._close_shard()
        self.documents += len(lengths)
        self.tokens += len(tokens)
        self.text_bytes += text_bytes
        if mask is not None:
            self.loss_tokens += int(np.count_nonzero(mask))

    def _write(self, tokens: np.ndarray, ends: np.ndarray, mask: np.ndarray | None = None) -> None:
        if self._stream is None:
            self._stream = open(self.out / f"{self._name()}.bin.tmp", "wb")  # noqa: SIM115 - closed by commit
            if self.masked:
                self._mask_stream = open(self.out / f"{self._name()}{MASK_SUFFIX}.tmp", "wb")  # noqa: SIM115
        data = np.ascontiguousarray(tokens, self.dtype).data
        self._stream.write(data)
        self._hash.update(data)
        if mask is not None:
            mask_data = np.ascontiguousarray(mask, np.uint8).data
            self._mask_stream.write(mask_data)
            self._mask_hash.update(mask_data)
        self._starts.extend((self._starts[-1] + ends).tolist())

    def _name(self) -> str:
        return f"{self.split}-{len(self.shards):05d}"

    def _close_shard(self) -> None:
        name = self._name()
        commit_file(self._stream, self.out / f"{name}.bin")
        self._stream = None
        shard = {"file": f"{name}.bin", "tokens": self._starts[-1], "documents": len(self._starts) - 1,
                 "sha256": self._hash.hexdigest()}
        if self.masked:
            commit_file(self._mask_stream, self.out / f"{name}{MASK_SUFFIX}")
            self._mask_stream = None
            shard["mask_sha256"] = self._mask_hash.hexdigest()
        offsets = io.BytesIO()
        np.save(offsets, np.asarray(self._starts, np.int64))
        write_file(self.out / f"{name}.docs.npy", offsets.getvalue())
        self.shards.append(shard)
        self._starts, self._hash, self._mask_hash = [0], hashlib.sha256(), hashlib.sha256()

    def record(self) -> dict:
        """Closes the open shard; the split's entry of index.json."""
        if self._stream is not None:
            self._close_shard()
        record = {"tokens": self.tokens, "documents": self.documents, "text_bytes": self.text_bytes,
                  "shards": self.shards}
        if self.masked:
            record["loss_tokens"] = self.loss_tokens
        return record


def _val_selector(val_fraction: float) -> Callable[[int], bool]:
    """Whether document i goes to val: floor((i+1)F) > floor(iF), F taken as the decimal it prints as
    (so exactly floor(F n) of n documents, evenly spread)."""
    if not 0 <= val_fraction < 1:
        raise ConfigError("--val-fraction", f"must be in [0, 1), got {val_fraction}")
    exact = fractions.Fraction(repr(float(val_fraction)))
    return lambda i: (i + 1) * exact.numerator // exact.denominator > i * exact.numerator // exact.denominator


@dataclasses.dataclass(frozen=True)
class PrepareReport:
    """What ``prepare`` wrote, and the seconds spent on each split (a batch's time shared by its
    text bytes)."""

    corpus: PreparedCorpus
    seconds: dict[str, float]


def _count(number: int) -> str:
    """12345678 -> "12.3M": short enough that the progress line fits 80 columns."""
    for unit, size in (("G", 10 ** 9), ("M", 10 ** 6), ("k", 10 ** 3)):
        if number >= size:
            return f"{number / size:.1f}{unit}"
    return str(number)


class _Progress:
    """The rich progress bar on stderr (files, documents, tokens, MB/s, ETA by input bytes)."""

    def __init__(self, console: Console, total_bytes: int, total_files: int, enabled: bool):
        self.bar = Progress(BarColumn(bar_width=12), TaskProgressColumn(),
                            TextColumn("{task.fields[files]}/{task.fields[total_files]} files"),
                            TextColumn("{task.fields[documents]} docs"), TextColumn("{task.fields[tokens]} tokens"),
                            TransferSpeedColumn(), TimeRemainingColumn(), console=console, disable=not enabled)
        self.task = self.bar.add_task("prepare", total=total_bytes, files=0, total_files=total_files,
                                      documents="0", tokens="0")

    def update(self, done_bytes: int, files: int, writers: dict[str, _SplitWriter]) -> None:
        self.bar.update(self.task, completed=done_bytes, files=files,
                        documents=_count(sum(writer.documents for writer in writers.values())),
                        tokens=_count(sum(writer.tokens for writer in writers.values())))


class _Encoder:
    """Tokenizes batches of ``(text, utf8_bytes, split, last)`` pieces into their splits' writers:
    a document is its pieces in order, ``last`` on its final one (a document under the piece size is
    one piece), its ids followed by ``eos_id``. A document's pieces may span batches; its ids are
    kept as arrays until it is complete. ``seconds`` per split shares each batch's time (since the
    previous batch: reading included) by its text bytes."""

    def __init__(self, tokenizer: Tokenizer, eos_id: int, writers: dict[str, _SplitWriter]):
        self.tokenizer, self.eos_id, self.writers = tokenizer, eos_id, writers
        self.seconds = dict.fromkeys(writers, 0.0)
        self._mark = time.perf_counter()
        self._pending: list[np.ndarray] = []  # the ids of the pieces so far of an unfinished document
        self._pending_bytes = 0

    def encode(self, batch: list[tuple[str, int, str, bool]]) -> None:
        dtype = next(iter(self.writers.values())).dtype
        ids = {split: [] for split in self.writers}  # whole documents' ids, as Python ints
        parts = {split: [] for split in self.writers}  # arrays of ids, in order, ``ids`` flushed among them
        lengths = {split: [] for split in self.writers}
        done_bytes = dict.fromkeys(self.writers, 0)  # of the documents completed in this batch
        batch_bytes = dict.fromkeys(self.writers, 0)
        encodings = self.tokenizer.encode_batch_fast([text for text, _, _, _ in batch], add_special_tokens=False)
        for (_, size, split, last), encoding in zip(batch, encodings):
            batch_bytes[split] += size
            if last and not self._pending:
                document_ids = encoding.ids
                ids[split].extend(document_ids)
                ids[split].append(self.eos_id)
                lengths[split].append(len(document_ids) + 1)
                done_bytes[split] += size
                continue
            self._pending.append(np.array(encoding.ids, dtype))
            self._pending_bytes += size
            if last:
                if ids[split]:
                    parts[split].append(np.array(ids[split], dtype))
                    ids[split] = []
                parts[split].append(np.concatenate(self._pending + [np.array([self.eos_id], dtype)]))
                lengths[split].append(len(parts[split][-1]))
                done_bytes[split] += self._pending_bytes
                self._pending, self._pending_bytes = [], 0
        for split, writer in self.writers.items():
            if lengths[split]:
                tokens = np.array(ids[split], dtype)
                if parts[split]:
                    tokens = np.concatenate([*parts[split], tokens])
                writer.add(tokens, np.array(lengths[split], np.int64), done_bytes[split])
        now = time.perf_counter()
        for split in self.writers:
            self.seconds[split] += (now - self._mark) * batch_bytes[split] / sum(batch_bytes.values())
        self._mark = now


def split_input_files(inputs, val_inputs, out_dir: pathlib.Path) -> tuple[list[pathlib.Path], list[pathlib.Path]]:
    """The files of ``--input`` and ``--val-input`` (none without it): ConfigError when a file is in
    both, or inside ``--out`` ``out_dir``."""
    train_files = input_files(inputs, "--input")
    val_files = input_files(val_inputs, "--val-input") if val_inputs else []
    if set(train_files) & set(val_files):
        raise ConfigError("--val-input", f"{sorted(set(train_files) & set(val_files))[0]} is also an --input file")
    if any(out_dir in path.parents for path in train_files + val_files):
        raise ConfigError("--input", f"matches files inside --out {out_dir}")
    return train_files, val_files


def prepare(inputs: Sequence[str], tokenizer_path: str, out: str, *, val_fraction: float = 0.0,
            val_inputs: Sequence[str] = (), text_field: str = "text", eos: str | None = None,
            shard_tokens: int = DEFAULT_SHARD_TOKENS, overwrite: bool = False, progress: bool = True,
            batch_bytes: int = BATCH_TEXT_BYTES, piece_chars: int = PIECE_CHARS,
            max_piece_chars: int = MAX_PIECE_CHARS) -> PrepareReport:
    """Tokenizes the documents of ``inputs`` (globs) into the prepared directory ``out``.

    Every document's ids (``encode_batch_fast(add_special_tokens=False)``: ``encode_batch`` without
    character offsets, about ``batch_bytes`` of text a call, on all cores; a special token written
    in the text is encoded as text; the tokenizer file's truncation and padding are turned off) are
    followed by the EOS id. A document longer than ``piece_chars`` characters is tokenized in
    pieces cut where its ids do not change (``tokenizer.piece_bounds``), or whole up to
    ``max_piece_chars`` for a tokenizer with no such cut; longer is refused. The ``val`` split takes
    document i when floor((i+1) val_fraction) > floor(i val_fraction), or the documents of
    ``val_inputs``. The output does not depend on ``batch_bytes``, ``piece_chars`` or on an
    earlier interrupted run. Bad input is a one-line ``ConfigError`` naming the CLI flag.
    """
    console = Console(stderr=True, soft_wrap=True, highlight=False)
    say = lambda line: console.print(line, markup=False)
    if val_inputs and val_fraction:
        raise ConfigError("--val-input", "give --val-fraction or --val-input, not both")
    is_val = _val_selector(val_fraction)
    if shard_tokens < 1:
        raise ConfigError("--shard-tokens", f"must be a positive number of tokens, got {shard_tokens}")
    tokenizer = load_tokenizer(tokenizer_path, "--tokenizer")
    tokenizer.encode_special_tokens = True
    tokenizer.no_truncation()  # a tokenizer.json may carry them for fine-tuning; a corpus keeps every id
    tokenizer.no_padding()
    cuts = tokenizer_cuts(tokenizer)
    eos_token, eos_id = end_of_document_id(tokenizer, eos, "--eos")
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = token_dtype(vocab_size)
    out_dir = pathlib.Path(out).absolute()
    train_files, val_files = split_input_files(inputs, val_inputs, out_dir)
    readers = [(DocumentReader(train_files, text_field, "--input", say), None)]  # columnar files checked here
    if val_files:
        readers.append((DocumentReader(val_files, text_field, "--val-input", say), VAL))
    if os.environ.get("TOKENIZERS_PARALLELISM", "true").strip().lower() in _PARALLELISM_OFF:
        say("warning: TOKENIZERS_PARALLELISM turns off tokenizers' threads: one core encodes; unset it")
    writable_directory(out_dir, "--out")
    # Another prepare writing into --out holds it: a second one refuses instead of removing its files.
    with RunLock(out_dir, field="--out", holder="prepare"), claimed(out_dir, overwrite, say) as target:
        encoder = _Encoder(tokenizer, eos_id, {split: _SplitWriter(target, split, dtype, shard_tokens)
                                               for split in ([TRAIN, VAL] if val_files or val_fraction else [TRAIN])})
        all_files = train_files + val_files
        bar = _Progress(console, sum(path.stat().st_size for path in all_files), len(all_files), progress)
        with bar.bar:
            done_bytes = done_files = 0
            for reader, split in readers:
                batch, size, number = [], 0, 0
                for text, text_bytes, last in reader.pieces(cuts, piece_chars=piece_chars, max_chars=max_piece_chars):
                    batch.append((text, text_bytes, split or (VAL if is_val(number) else TRAIN), last))
                    number += last
                    size += text_bytes
                    if size >= batch_bytes:
                        encoder.encode(batch)
                        batch, size = [], 0
                        bar.update(done_bytes + reader.bytes_read, done_files + reader.files_read, encoder.writers)
                if batch:
                    encoder.encode(batch)
                done_bytes, done_files = done_bytes + reader.bytes_read, done_files + reader.files_read
                bar.update(done_bytes, done_files, encoder.writers)
        writers = encoder.writers
        if val_fraction and not writers[VAL].documents:
            raise ConfigError("--val-fraction", f"{val_fraction} of {writers[TRAIN].documents} documents rounds "
                              "down to no val document; raise it or use --val-input")

        finish(target, tokenizer_path, dtype, (eos_token, eos_id), vocab_size, writers)
    return PrepareReport(PreparedCorpus.open(str(out_dir), field="--out"), encoder.seconds)


def finish(out_dir: pathlib.Path, tokenizer_path: str, dtype: np.dtype, eos: tuple[str, int], vocab_size: int,
           writers: dict[str, _SplitWriter], loss_mask: dict | None = None) -> None:
    """Writes the tokenizer's copy and ``index.json`` (last) and removes the incomplete marker.
    ``loss_mask``: the index's entry of a masked (fine-tuning) corpus."""
    write_file(out_dir / TOKENIZER_FILE, tokenizer_file(tokenizer_path).read_bytes())
    index = {"format": FORMAT, "dtype": dtype.name,
             "tokenizer": {"file": TOKENIZER_FILE, "sha256": file_sha256(out_dir / TOKENIZER_FILE),
                           "vocab_size": vocab_size, "eos": eos[0], "eos_id": eos[1]},
             "splits": {split: writer.record() for split, writer in writers.items()}}
    if loss_mask is not None:
        index["loss_mask"] = loss_mask
    fsync_dir(out_dir)
    write_file(out_dir / INDEX_FILE, (json.dumps(index, indent=1) + "\n").encode())
    (out_dir / INCOMPLETE_MARKER).unlink()
    fsync_dir(out_dir)

"""Columnar inputs of ``prepare`` and ``train-tokenizer``: parquet files, Arrow IPC files in the
file or the stream format (``.arrow``), and directories written by Hugging Face ``datasets``'
``save_to_disk`` (a ``state.json`` listing its ``.arrow`` stream files). One string column holds
the documents, read record batch by record batch, so that a corpus need not fit in memory.
pyarrow (the ``data`` extra) is imported only when such a file is read.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterator

from meshtrain import jsonio
from meshtrain.errors import ConfigError

PARQUET_SUFFIX, ARROW_SUFFIX = ".parquet", ".arrow"
SAVED_DATASET_STATE = "state.json"  # save_to_disk's list of its data files
SAVED_DATASET_METADATA = (SAVED_DATASET_STATE, "dataset_info.json")  # never documents themselves
DATASET_DICT_FILE = "dataset_dict.json"  # DatasetDict.save_to_disk: one saved dataset per split below it
PARQUET_BATCH_ROWS = 1024  # rows of a parquet file decoded at once
PARQUET_READ_BYTES = 1 << 20  # read a page at a time through a buffer of this size, not a row group's column whole
TEXT_FLAG = "--text-field"
_ARROW_FILE_MAGIC = b"ARROW1"  # how the IPC file format starts; the stream format does not


def is_columnar(path: pathlib.Path) -> bool:
    """Whether ``path`` is read as a table (``.parquet``, ``.arrow``) rather than as text."""
    return path.suffix in (PARQUET_SUFFIX, ARROW_SUFFIX)


def saved_dataset_files(directory: str, field: str) -> list[str] | None:
    """The Arrow files that ``directory``'s ``state.json`` lists, in its order, when ``save_to_disk``
    wrote the directory (its state.json is an object with ``_data_files``), else None;
    ``ConfigError(field)`` when it lists something other than an ``.arrow`` file beside it."""
    state = os.path.join(directory, SAVED_DATASET_STATE)
    try:
        with open(state, "rb") as stream:
            text = stream.read()
    except OSError:
        return None
    try:
        entries = jsonio.loads(text)["_data_files"]
    except (ValueError, KeyError, TypeError) as err:
        problem = err if isinstance(err, ValueError) else "it holds no _data_files list"
        raise ConfigError(field, f"{state} is not the state.json datasets' save_to_disk writes ({problem}); "
                          "save the dataset again, or give its .arrow or .parquet files") from None
    names = [entry.get("filename") if isinstance(entry, dict) else entry
             for entry in (entries if isinstance(entries, list) else [entries])]
    for name in names:
        if not (jsonio.is_plain_file_name(name) and name.endswith(ARROW_SUFFIX)
                and os.path.isfile(os.path.join(directory, name))):
            raise ConfigError(field, f"{os.path.join(directory, SAVED_DATASET_STATE)} lists {name!r} among its "
                              f"_data_files, which is not an {ARROW_SUFFIX} file in {directory}")
    return [os.path.join(directory, name) for name in names]


def is_saved_dataset_metadata(path: str, field: str) -> bool:
    """Whether ``path`` is the ``state.json`` or ``dataset_info.json`` of a ``save_to_disk`` directory."""
    return (os.path.basename(path) in SAVED_DATASET_METADATA
            and saved_dataset_files(os.path.dirname(path), field) is not None)


def dataset_dict_hint(paths: list[str]) -> str:
    """What a "matches no file" error adds when one of ``paths`` is a directory that
    ``DatasetDict.save_to_disk`` wrote (its splits are the saved datasets): their paths; else ""."""
    for path in paths:
        if os.path.isfile(os.path.join(path, DATASET_DICT_FILE)):
            splits = sorted(entry.name for entry in os.scandir(path) if entry.is_dir())
            return (f"; {path} is a DatasetDict saved by save_to_disk: give one of its splits "
                    f"({', '.join(os.path.join(path, split) for split in splits)})")
    return ""


def _pyarrow(path: pathlib.Path, field: str):
    """pyarrow, its compute, ipc and parquet modules imported; a ``ConfigError(field)`` saying how to
    install it when it is missing."""
    try:
        import pyarrow
        import pyarrow.compute
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise ConfigError(field, f"{path}: reading {path.suffix} files needs pyarrow: pip install 'meshtrain[data]' "
                          "(in a clone: pip install -e '.[data]'), or pip install pyarrow") from None
    return pyarrow


def _ipc_reader(pyarrow, source):
    """The reader of an Arrow IPC file or stream, by its first bytes."""
    is_file = source.read(len(_ARROW_FILE_MAGIC)) == _ARROW_FILE_MAGIC
    source.seek(0)
    return pyarrow.ipc.open_file(source) if is_file else pyarrow.ipc.open_stream(source)


def _is_text(pyarrow, data_type) -> bool:
    if pyarrow.types.is_dictionary(data_type):
        data_type = data_type.value_type
    return (pyarrow.types.is_string(data_type) or pyarrow.types.is_large_string(data_type)
            or pyarrow.types.is_string_view(data_type))


def check_text_column(path: pathlib.Path, column: str, field: str) -> None:
    """Opens ``path`` (its schema only) and checks that it has a string ``column``: a one-line
    ``ConfigError`` otherwise (``field`` when pyarrow is missing or cannot read it, else
    ``--text-field``)."""
    pyarrow = _pyarrow(path, field)
    try:
        if path.suffix == PARQUET_SUFFIX:
            schema = pyarrow.parquet.read_schema(path)
        else:
            with pyarrow.memory_map(str(path)) as source:
                schema = _ipc_reader(pyarrow, source).schema
    except (pyarrow.ArrowException, OSError) as err:
        kind = "a parquet" if path.suffix == PARQUET_SUFFIX else "an Arrow IPC"
        raise ConfigError(field, f"{path} is not {kind} file pyarrow can read ({err})") from None
    if column not in schema.names:
        raise ConfigError(TEXT_FLAG, f"{path} has no {column!r} column (it has: {', '.join(schema.names)})")
    data_type = schema.field(column).type
    if not _is_text(pyarrow, data_type):
        raise ConfigError(TEXT_FLAG, f"{path}: column {column!r} holds {data_type}, not strings")


def _column_batches(pyarrow, path: pathlib.Path, column: str) -> Iterator[tuple[object, float]]:
    """``(cells, done)`` per record batch: the column's array and the fraction of the file read."""
    if path.suffix == PARQUET_SUFFIX:
        with pyarrow.parquet.ParquetFile(path, pre_buffer=False, buffer_size=PARQUET_READ_BYTES) as table:
            rows, total = 0, max(table.metadata.num_rows, 1)
            for batch in table.iter_batches(PARQUET_BATCH_ROWS, columns=[column]):
                rows += batch.num_rows
                yield batch.column(0), rows / total
        return
    with pyarrow.memory_map(str(path)) as source:
        reader = _ipc_reader(pyarrow, source)
        if isinstance(reader, pyarrow.ipc.RecordBatchFileReader):
            for number in range(reader.num_record_batches):
                yield reader.get_batch(number).column(column), (number + 1) / reader.num_record_batches
        else:
            for batch in reader:
                yield batch.column(column), source.tell() / max(source.size(), 1)


def text_batches(path: pathlib.Path, column: str, field: str) -> Iterator[tuple[list[str | None], list[int], float]]:
    """``(texts, utf8_bytes, done)`` per record batch of ``path``'s string ``column`` (checked by
    ``check_text_column``): its cells in row order (None for a null, 0 bytes) and the fraction of
    the file read so far. A file pyarrow fails on midway, or a cell that is not UTF-8, is a
    ``ConfigError(field)`` naming the file and rows."""
    pyarrow = _pyarrow(path, field)
    row = 0
    try:
        for cells, done in _column_batches(pyarrow, path, column):
            cells = cells.cast(pyarrow.large_string())
            try:
                texts = cells.to_pylist()
            except UnicodeDecodeError:
                raise ConfigError(field, f"{path} rows {row} to {row + len(cells) - 1}: a {column!r} cell is not "
                                  "UTF-8 text") from None
            sizes = pyarrow.compute.binary_length(cells).fill_null(0).to_pylist()
            row += len(texts)
            yield texts, sizes, done
    except (pyarrow.ArrowException, OSError) as err:
        raise ConfigError(field, f"{path}: pyarrow failed reading it after row {row} ({err})") from None

"""Files written whole or not at all: each is written to ``<path>.tmp``, flushed and fsynced, then
renamed over ``path``, so a crash or a full disk leaves the old file (or none), never half of one."""

from __future__ import annotations

import os
import pathlib
from typing import BinaryIO


def commit_file(stream: BinaryIO, path: pathlib.Path) -> None:
    """Flushes, fsyncs and closes ``stream`` (open on ``path.tmp``), then renames it to ``path``."""
    stream.flush()
    os.fsync(stream.fileno())
    stream.close()
    os.replace(stream.name, path)


def write_file(path: pathlib.Path, data: bytes) -> None:
    """``data`` as the whole content of ``path``, through ``path.tmp`` (removed if the write fails)."""
    stream = open(f"{path}.tmp", "wb")  # noqa: SIM115 - commit_file closes it
    try:
        stream.write(data)
        commit_file(stream, path)
    except BaseException:
        stream.close()
        pathlib.Path(stream.name).unlink(missing_ok=True)
        raise


def fsync_dir(path: pathlib.Path) -> None:
    """Makes the entries of directory ``path`` (renames, new files) durable."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)

"""The one error type for bad user input (the CLI prints it as one line and exits 2), the helpers
that keep a value quoted in its message to one short line, the check of an output directory that
turns the file system's refusals into it, and the infeasibility of a layout, which the trainer
raises and the planner lists."""

import contextlib
import dataclasses
import errno
import os
import pathlib
import shutil
from collections.abc import Iterator
from typing import Any


class ConfigError(ValueError):
    """A user-facing configuration error naming the offending field.

    Args:
      field: dotted config path (``"mesh.data"``) or CLI flag (``"--config"``).
      message: what is wrong and what would be valid.
    """

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def shown(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages."""
    return cut(repr(value), limit)


def cut(text: str, limit: int = 120) -> str:
    """``text`` on one line (runs of white space as one space), cut to ``limit`` characters."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


WRITE_CHECK_PREFIX = ".meshtrain-write-check-"  # the probe file writable_directory creates and removes


def writable_directory(path: str | os.PathLike, field: str, *, create: bool = True) -> pathlib.Path:
    """``path`` as a directory this process can create files in, made (with its parents) if missing;
    ``ConfigError(field)`` in one line otherwise: it or a parent is a file, or the file system
    refuses (permissions, a read-only file system). Call it before the work that writes there starts.
    ``create=False`` creates nothing (for a command whose failures must leave no directory behind):
    the nearest existing ancestor must be a directory this process may write in."""
    directory = pathlib.Path(path)
    if not create:
        existing = directory
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            where = "is a file" if existing == directory else f"has a parent that is a file ({existing})"
            raise ConfigError(field, f"{directory} {where}, not a directory")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ConfigError(field, f"cannot write in {existing}: permission denied")
        return directory
    probe = directory / f"{WRITE_CHECK_PREFIX}{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.touch()
        probe.unlink()
    except FileExistsError:
        raise ConfigError(field, f"{directory} is a file, not a directory") from None
    except NotADirectoryError:
        raise ConfigError(field, f"{directory}: a parent of it is a file, not a directory") from None
    except OSError as error:
        raise ConfigError(field, f"cannot write in {directory}: {error.strerror or error}") from None
    return directory


@dataclasses.dataclass(frozen=True)
class Infeasible:
    """Why a layout cannot be built: the ``ConfigError`` the trainer raises (``field``, ``message``)
    and the short ``reason`` the planner prints in its table."""

    field: str
    message: str
    reason: str

    def error(self) -> ConfigError:
        return ConfigError(self.field, self.message)


# The file system out of room: the errno of an OSError, or the text a library's own error carries
# (orbax, safetensors and XLA wrap the OSError).
_DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_DISK_FULL_TEXTS = ("No space left on device", "Disk quota exceeded", "File too large")


def disk_full(err: BaseException | None) -> str | None:
    """Why ``err`` (or an exception it was raised from) is the file system out of room (its
    ``strerror``), else None."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in _DISK_FULL_ERRNOS:
            return err.strerror or os.strerror(err.errno)
        found = next((text for text in _DISK_FULL_TEXTS if text in str(err)), None)
        if found is not None:
            return found
        err = err.__cause__ or err.__context__
    return None


@contextlib.contextmanager
def new_output(path: str | os.PathLike, field: str) -> Iterator[pathlib.Path]:
    """Writing the new output ``path`` (a file or directory that is absent or an empty directory):
    if the body fails, what it wrote there is removed (nothing half-written stays), and a full disk
    (``disk_full``) is ``ConfigError(field)`` in one line."""
    path = pathlib.Path(path)
    existed = path.is_dir()
    try:
        yield path
    except BaseException as err:
        for written in (list(path.iterdir()) if path.is_dir() else []) if existed else [path]:
            _remove(written)
        reason = disk_full(err) if isinstance(err, Exception) else None
        if reason is not None:
            raise ConfigError(field, f"cannot write {path}: {reason}; nothing of it was kept") from None
        raise


def _remove(path: pathlib.Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)

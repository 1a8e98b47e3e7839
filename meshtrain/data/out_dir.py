"""The ``--out`` directory a corpus is prepared into (``prepare``, ``prepare-sft``): ``check_out``
refuses what cannot be written there before any work, ``claimed`` yields the directory to write into
and, under ``--overwrite``, writes beside a complete corpus and swaps the new one in when it is
complete, so a failure (a full disk) leaves the old one as it was."""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator

from meshtrain.data.files import fsync_dir
from meshtrain.data.prepared import INCOMPLETE_MARKER, INDEX_FILE
from meshtrain.errors import WRITE_CHECK_PREFIX, ConfigError
from meshtrain.run_lock import LOCK_FILE

# The files of a prepared corpus (and their partial .tmp copies): what --out may hold besides others'.
_PREPARED_NAME = re.compile(r"^(?:(?:train|val)-\d{5}(?:\.bin|\.docs\.npy|\.mask\.bin)|index\.json|tokenizer\.json"
                            r"|chat_template\.jinja)(?:\.tmp)?$")


def _remove_prepared_files(out: pathlib.Path) -> None:
    for path in out.iterdir():
        if _PREPARED_NAME.match(path.name):
            path.unlink()


def check_out(out: pathlib.Path, overwrite: bool) -> None:
    """Refuses an ``out`` that ``claimed`` would refuse, touching nothing: a file, a prepared corpus
    without ``overwrite``, a directory holding other files."""
    if out.exists() and not out.is_dir():
        raise ConfigError("--out", f"{out} is a file, not a directory")
    if (out / INCOMPLETE_MARKER).exists():
        return
    if (out / INDEX_FILE).exists():
        if not overwrite:
            raise ConfigError("--out", f"{out} is already prepared; remove it or choose another directory "
                              "(or pass --overwrite)")
    elif out.exists() and any(path.name != LOCK_FILE and not path.name.startswith(WRITE_CHECK_PREFIX)
                              for path in out.iterdir()):
        raise ConfigError("--out", f"{out} is not empty and holds no prepared corpus; give a new or empty directory")


def _remove_corpus(directory: pathlib.Path) -> None:
    """Removes a corpus written beside ``out`` (``claimed``): its own files, then the directory."""
    _remove_prepared_files(directory)
    (directory / INCOMPLETE_MARKER).unlink(missing_ok=True)
    directory.rmdir()


def _swap_in(new: pathlib.Path, out: pathlib.Path) -> None:
    """Puts the complete corpus ``new`` (beside ``out``) in the place of ``out``'s: ``out`` renamed
    aside, ``new`` renamed to ``out``, the other files of ``out`` (and its lock) moved into it, the old
    corpus removed."""
    aside = new.with_name(new.name.replace(".new-", ".old-", 1))
    os.rename(out, aside)
    try:
        os.rename(new, out)
    except OSError:
        os.rename(aside, out)
        raise
    for path in aside.iterdir():
        if not _PREPARED_NAME.match(path.name):
            os.rename(path, out / path.name)
    _remove_corpus(aside)
    fsync_dir(out.parent)


def _write_error(error: OSError, out: pathlib.Path, kept: str) -> ConfigError:
    where = error.filename or out
    return ConfigError("--out", f"cannot write {where}: {error.strerror or error}; {kept}")


@contextlib.contextmanager
def claimed(out: pathlib.Path, overwrite: bool, say: Callable[[str], None]) -> Iterator[pathlib.Path]:
    """The directory to write a corpus for ``out`` into, inside the ``with``; refused as
    ``check_out`` refuses, deleting nothing but a prepared or interrupted corpus's own files.

    A new or interrupted ``out`` is that directory itself, marked incomplete (an interrupted run's
    files removed) until ``finish`` completes it; a failure leaves it marked. An ``out`` that holds
    a complete corpus (``overwrite``) is untouched until the new corpus is complete in a directory
    beside it (``.NAME.new-*``), which then takes its place (``_swap_in``); a failure removes that
    directory, leaving the old corpus as it was. An ``OSError`` (a full disk) is a one-line
    ``ConfigError`` saying so."""
    check_out(out, overwrite)
    if (out / INDEX_FILE).exists() and not (out / INCOMPLETE_MARKER).exists():
        kept, real = f"{out} is left as it was", out.resolve()  # a link to a directory: swapped where it points
        try:
            new = pathlib.Path(tempfile.mkdtemp(prefix=f".{real.name}.new-", dir=real.parent))
        except OSError as error:
            raise _write_error(error, out, f"{kept} (--overwrite writes the new corpus beside it, in "
                               f"{real.parent}, then swaps it in)") from None
        try:
            new.chmod(stat.S_IMODE(real.stat().st_mode))
            (new / INCOMPLETE_MARKER).touch()
            yield new
        except BaseException as failure:
            shutil.rmtree(new)  # only this run's files: a directory it made
            if isinstance(failure, OSError):
                raise _write_error(failure, out, kept) from None
            raise
        try:
            _swap_in(new, real)
        except OSError as error:
            raise _write_error(error, out, f"swapping in the new corpus, complete beside it in {real.parent}, "
                               "failed") from None
        return
    if (out / INCOMPLETE_MARKER).exists():
        say(f"{out}: an earlier prepare was interrupted; removing its partial files and starting again")
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / INCOMPLETE_MARKER).touch()
        fsync_dir(out)
        _remove_prepared_files(out)
        yield out
    except OSError as error:
        raise _write_error(error, out, f"{out} is left marked incomplete (a rerun starts afresh)") from None

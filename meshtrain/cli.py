"""What every ``python -m meshtrain.*`` tool shares: bad input is one ``error: field: message``
line on stderr and exit status 2, never a traceback (XLA_FLAGS included, checked before a backend
starts: ``check_xla_flags``); ``--host-devices`` simulates CPU devices."""

from __future__ import annotations

import argparse
import difflib
import functools
import importlib.metadata
import importlib.util
import mmap
import os
import pathlib
import re
import sys
from collections.abc import Callable

import jax

from meshtrain.errors import ConfigError, disk_full

EXIT_USER_ERROR = 2
MAX_HOST_DEVICES = 1024
HOST_MEMORY_MESSAGE = ("the host ran out of memory building what the config asks for (a batch, the data "
                       "source, the parameters); reduce train.batch_size, model.* sizes or data.*")


class ArgumentParser(argparse.ArgumentParser):
    """Reports bad arguments as a ``ConfigError`` (one line, exit 2) instead of usage + exit.

    ``section.field=value`` overrides may stand anywhere among the flags (``--config X a.b=1
    --host-devices 8 c.d=2``): every argument that is neither a flag nor a flag's value is collected,
    in order, into ``args.overrides``.
    """

    def error(self, message: str):
        raise ConfigError("arguments", message)

    def parse_args(self, args=None, namespace=None) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        flags = [extra for extra in extras if extra.startswith("-")]
        if flags:
            self.error(f"unrecognized arguments: {' '.join(flags)}")
        parsed.overrides = extras
        return parsed


def use_host_devices(count: int) -> None:
    """Run on ``count`` simulated CPU devices; only possible before JAX's backends start."""
    if not 1 <= count <= MAX_HOST_DEVICES:
        raise ConfigError("--host-devices", f"must be an integer in [1, {MAX_HOST_DEVICES}] (each simulated "
                          f"device costs memory and start-up time), got {count}")
    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError as err:
        raise ConfigError("--host-devices", f"JAX already started its backends: {err}") from None


# XLA_FLAGS as XLA's parser splits it (parse_flags_from_env.cc): whitespace-separated tokens, a value
# possibly quoted ('...' or "..." with backslash escapes); a flag is --name or --name=value.
_XLA_FLAGS_TOKEN = re.compile(r"""(?:"(?:\\.|[^"\\])*"?|'[^']*'?|[^\s"'])+""")
_XLA_FLAG = re.compile(r"--([A-Za-z0-9_-]+)(?:=.*)?", re.DOTALL)


@functools.cache
def known_xla_flag_names() -> frozenset[str]:
    """Every ``xla_*`` name in the installed jaxlib's shared libraries, read without starting XLA (about
    0.2 s, once per process): a superset of the flags its XLA parses, whose names are string constants
    there. Empty when no library is found (nothing can be checked then)."""
    names: set[bytes] = set()
    for directory in importlib.util.find_spec("jaxlib").submodule_search_locations:
        for library in pathlib.Path(directory).glob("*.so"):
            with open(library, "rb") as stream, mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ) as data:
                names.update(re.findall(rb"xla_[a-z0-9_]+", data))
    return frozenset(name.decode() for name in names)


def check_xla_flags(value: str) -> None:
    """Refuses, as a ``ConfigError`` naming XLA_FLAGS, what XLA's flag parser would abort the process
    on (or silently stop at) when a backend starts: a token that is not ``--name`` or ``--name=value``,
    a name this jaxlib does not know, or a value that does not start with ``-`` (XLA reads such a
    value as a file of flags: that file's flags are checked) naming no file. Flags' values are XLA's
    to check."""
    if not value.strip():
        return
    where = ""
    if not value.lstrip().startswith("-"):
        try:
            flags = pathlib.Path(value).read_text(errors="replace")
        except OSError as error:
            raise ConfigError("XLA_FLAGS", f"{value!r} is no flag (--name or --name=value, separated by "
                              "spaces), and XLA reads a value not starting with '--' as a file of flags: "
                              f"cannot read it ({error.strerror})") from None
        value, where = flags, f" (in the file {value})"
    known = known_xla_flag_names()
    for token in _XLA_FLAGS_TOKEN.findall(value):
        flag = _XLA_FLAG.fullmatch(token)
        if flag is None:
            raise ConfigError("XLA_FLAGS", f"{token!r}{where} is not a flag; give --name or --name=value, "
                              "separated by spaces")
        name = flag.group(1)
        if known and name not in known:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.85)
            raise ConfigError("XLA_FLAGS", f"{token!r}{where}: {name} is no flag of this jaxlib "
                              f"({importlib.metadata.version('jaxlib')}), and XLA would abort at start-up; "
                              + (f"did you mean --{close[0]}?" if close else "unset it or fix its spelling"))


def run(tool: Callable[[list[str] | None], int | None], argv: list[str] | None) -> int:
    """``tool(argv)``'s exit status (0 when it returns None), ``XLA_FLAGS`` checked first; a ConfigError
    prints one line, exit 2."""
    try:
        check_xla_flags(os.environ.get("XLA_FLAGS", ""))
        return tool(argv) or 0
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    except MemoryError:
        print(f"error: memory: {HOST_MEMORY_MESSAGE}", file=sys.stderr)
        return EXIT_USER_ERROR
    except Exception as err:
        reason = disk_full(err)
        if reason is None:
            raise
        where = next((e.filename for e in (err, err.__cause__, err.__context__)
                      if isinstance(e, OSError) and e.filename), "a file")
        print(f"error: {where}: cannot write it: {reason}; free some space and run again", file=sys.stderr)
        return EXIT_USER_ERROR


TRUST_PLUGIN_FLAG = "--trust-plugin"


def output_file(path: str, suffix: str, why: str = "") -> pathlib.Path:
    """``--out`` as a new file path ending in ``suffix`` in an existing directory (a ConfigError
    otherwise; ``why`` adds the reason the suffix matters)."""
    out = pathlib.Path(path)
    if out.is_dir() or out.suffix != suffix:
        raise ConfigError("--out", f"{out} is {'a directory' if out.is_dir() else f'not a {suffix} path'}; give the "
                          f"{suffix} file to write{why}")
    if not out.parent.is_dir():
        raise ConfigError("--out", f"directory {out.parent} does not exist")
    return out


def add_trust_plugin_argument(parser: argparse.ArgumentParser) -> None:
    """``--trust-plugin``: a tool that loads a run or an export may import the ``model.plugin`` it
    records (running that Python code); without it, it refuses in one line."""
    parser.add_argument(TRUST_PLUGIN_FLAG, action="store_true",
                        help="import the model.plugin a run or export names (runs its Python code; only for "
                             "files you trust)")


def add_mesh_arguments(parser: argparse.ArgumentParser) -> None:
    """``--host-devices N``; ``mesh.*=`` / ``sharding.*=`` overrides may stand anywhere (see
    ``ArgumentParser.parse_args``)."""
    parser.add_argument("--host-devices", type=int, metavar="N", help="simulate N CPU devices")

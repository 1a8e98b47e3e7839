"""What every ``python -m meshtrain.*`` tool shares: bad input is one ``error: field: message``
line on stderr and exit status 2, never a traceback; ``--host-devices`` simulates CPU devices."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import jax

from meshtrain.errors import ConfigError

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


def run(tool: Callable[[list[str] | None], int | None], argv: list[str] | None) -> int:
    """``tool(argv)``'s exit status (0 when it returns None); a ConfigError prints one line, exit 2."""
    try:
        return tool(argv) or 0
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    except MemoryError:
        print(f"error: memory: {HOST_MEMORY_MESSAGE}", file=sys.stderr)
        return EXIT_USER_ERROR


TRUST_PLUGIN_FLAG = "--trust-plugin"


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

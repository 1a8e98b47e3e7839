"""What every ``python -m meshtrain.*`` tool shares: bad input is one ``error: field: message``
line on stderr and exit status 2, never a traceback; ``--host-devices`` simulates CPU devices."""

from __future__ import annotations

import argparse
import sys
from typing import Callable

import jax

from meshtrain.errors import ConfigError

EXIT_USER_ERROR = 2


class ArgumentParser(argparse.ArgumentParser):
    """Reports bad arguments as a ``ConfigError`` (one line, exit 2) instead of usage + exit."""

    def error(self, message: str):
        raise ConfigError("arguments", message)


def use_host_devices(count: int) -> None:
    """Run on ``count`` simulated CPU devices; only possible before JAX's backends start."""
    if count < 1:
        raise ConfigError("--host-devices", f"must be a positive integer, got {count}")
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

"""The XLA flags the test processes compile with (tests/conftest.py says why). Subprocesses that start
without the session's XLA_FLAGS pass them on.

An XLA_FLAGS entry the installed XLA does not know aborts the process when a backend starts (the
suite supports several jaxlib releases, which add and remove flags), so the flags are first tried
in a short subprocess and only those this jaxlib parses are used (``known_xla_flags``).
"""

import os
import re
import subprocess
import sys

FAST_COMPILE_XLA_FLAGS = (
    # LLVM at optimization level 0.
    "--xla_backend_optimization_level=0",
    # XLA:CPU's elemental IR emitter for fusions instead of the MLIR fusion emitters, which take
    # most of a small program's compile time: tests/test_plan.py and tests/test_long_context.py
    # (48 tests, fresh compilation cache) 125 s -> 76 s on 2 cores, jax 0.10.2; the same
    # collectives, memory_analysis() within 0.02%, every assertion passing. jaxlib 0.11 removed the
    # flag (the fusion emitters are XLA:CPU's only path there), so there it is left out.
    "--xla_cpu_use_fusion_emitters=false",
)

_UNKNOWN = re.compile(r"Unknown flags? in XLA_FLAGS: (.*)")


def known_xla_flags(flags: tuple[str, ...] | list[str]) -> list[str]:
    """The ``flags`` that this jaxlib's XLA parses: a subprocess starts JAX's CPU backend with them,
    and the flags it names as unknown are dropped. Any other failure raises."""
    flags = list(flags)
    if not flags:
        return flags
    env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    if proc.returncode == 0:
        return flags
    unknown = _UNKNOWN.search(proc.stderr)
    if unknown is None:
        raise RuntimeError(f"JAX did not start with XLA_FLAGS={' '.join(flags)!r}:\n{proc.stderr[-2000:]}")
    names = {flag.lstrip("-").split("=", 1)[0] for flag in unknown.group(1).split()}
    kept = [flag for flag in flags if flag.lstrip("-").split("=", 1)[0] not in names]
    if len(kept) == len(flags):
        raise RuntimeError(f"XLA named unknown flags that were not given: {unknown.group(0)}")
    return known_xla_flags(kept)


KNOWN_FAST_COMPILE_XLA_FLAGS = tuple(known_xla_flags(FAST_COMPILE_XLA_FLAGS))
FAST_COMPILE_XLA_FLAG = " ".join(KNOWN_FAST_COMPILE_XLA_FLAGS)


def with_fast_compile(xla_flags: str) -> str:
    """``xla_flags`` plus each fast-compile flag (of those this jaxlib knows) it does not already set."""
    missing = [flag for flag in KNOWN_FAST_COMPILE_XLA_FLAGS if flag.split("=")[0] not in xla_flags]
    return " ".join([xla_flags, *missing]).strip()

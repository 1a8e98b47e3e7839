"""Test set-up: 8 simulated CPU devices, configured before any backend starts, and JAX's persistent
compilation cache for the whole session, subprocesses included (through the environment they
inherit): many tests compile the same init and step programs, each a few seconds on 2 cores.

The cache lives in ``.pytest_cache/jax-compilation-cache`` (override with JAX_COMPILATION_CACHE_DIR);
entries are keyed by the program, the flags and the JAX version, so a stale one is never reused.
"""

import os
import pathlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      str(pathlib.Path(__file__).resolve().parents[1] / ".pytest_cache" / "jax-compilation-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

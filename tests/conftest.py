"""Test set-up: 8 simulated CPU devices, configured before any backend starts, and JAX's persistent
compilation cache for the whole session, subprocesses included (through the environment they
inherit): many tests compile the same init and step programs, each a few seconds on 2 cores.

The cache directory is new for every session and removed at its end: executables written by an
earlier session and loaded in a later one intermittently abort XLA:CPU (jax 0.10.2; 5 of 13 runs of
test_checkpoint.py aborted on a cache kept from earlier runs, none of 6 on a fresh one).
JAX_COMPILATION_CACHE_DIR set in the environment overrides it.

XLA:CPU compiles with the flags of tests/compile_flags.py (LLVM at optimization level 0, the
elemental fusion emitter; each unless XLA_FLAGS already sets it): the suite is mostly compiles of
programs that then run a step or two, and the collectives stay the same and ``memory_analysis()``
within 0.02% (README.md's test section has the figures and the time it saves).
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _CACHE = tempfile.mkdtemp(prefix="meshtrain-tests-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
from compile_flags import with_fast_compile  # noqa: E402  (no jax import there)

os.environ["XLA_FLAGS"] = with_fast_compile(os.environ.get("XLA_FLAGS", ""))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

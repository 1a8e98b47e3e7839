"""Test set-up: 8 simulated CPU devices, configured before any backend starts, and JAX's persistent
compilation cache for the whole session, subprocesses included (through the environment they
inherit): many tests compile the same init and step programs, each a few seconds on 2 cores.

The cache directory is new for every session and removed at its end: executables written by an
earlier session and loaded in a later one intermittently abort XLA:CPU (jax 0.10.2; 5 of 13 runs of
test_checkpoint.py aborted on a cache kept from earlier runs, none of 6 on a fresh one).
JAX_COMPILATION_CACHE_DIR set in the environment overrides it.

XLA:CPU compiles with the flags of tests/compile_flags.py (LLVM at optimization level 0, the
elemental fusion emitter; each that this jaxlib knows, unless XLA_FLAGS already sets it; the header
of pytest's output names them): the suite is mostly compiles of programs that then run a step or two,
and the collectives stay the same and ``memory_analysis()`` within 0.02% (README.md's test section
has the figures and the time it saves).
"""

import atexit
import importlib.metadata
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
from compile_flags import FAST_COMPILE_XLA_FLAGS, KNOWN_FAST_COMPILE_XLA_FLAGS, with_fast_compile  # noqa: E402

os.environ["XLA_FLAGS"] = with_fast_compile(os.environ.get("XLA_FLAGS", ""))

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


def pytest_report_header(config):
    left_out = [flag for flag in FAST_COMPILE_XLA_FLAGS if flag not in KNOWN_FAST_COMPILE_XLA_FLAGS]
    return [f"jax {jax.__version__}, jaxlib {importlib.metadata.version('jaxlib')}; XLA_FLAGS={os.environ['XLA_FLAGS']}"
            + (f" (left out, unknown to this jaxlib: {' '.join(left_out)})" if left_out else "")]


@pytest.fixture
def no_compile(monkeypatch):
    """Fails a test whose bad input reached compilation (``Trainer.init_state``) instead of failing early."""
    from meshtrain.trainer import Trainer

    def fail(*args, **kwargs):
        raise AssertionError("bad input reached Trainer.init_state (compilation) instead of failing early")

    monkeypatch.setattr(Trainer, "init_state", fail)

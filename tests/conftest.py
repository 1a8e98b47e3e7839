"""Test set-up: 8 simulated CPU devices, configured before any backend starts, and JAX's persistent
compilation cache for the whole session, subprocesses included (through the environment they
inherit): many tests compile the same init and step programs, each a few seconds on 2 cores.

The cache directory is new for every session and removed at its end: executables written by an
earlier session and loaded in a later one intermittently abort XLA:CPU (docs/benchmarks.md, "The
test suite, measured"). JAX_COMPILATION_CACHE_DIR set in the environment overrides it.

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


@pytest.fixture(scope="session")
def one_step_run(tmp_path_factory):
    """A one-step run of configs/tiny.yaml (``utils.config``) with its checkpoint: read, never changed."""
    from meshtrain.loop import train
    from utils import config

    run_dir = tmp_path_factory.mktemp("one-step") / "run"
    train(config(run_dir, "checkpoint.every=1", steps=1))
    return run_dir


@pytest.fixture(scope="session")
def prepared_corpus(tmp_path_factory):
    """A prepared corpus (one train shard) of 20 documents and its byte-level BPE of 260 ids:
    {"root": the documents (doc-NN.txt), "tokenizer": its file, "good": the prepared directory}; read, never changed."""
    from meshtrain.data.corpus import prepare
    from meshtrain.data.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("prepared")
    documents = [f"document {i}: the cat sat on the mat " * (i + 1) for i in range(20)]
    for i, text in enumerate(documents):
        (root / f"doc-{i:02d}.txt").write_text(text)
    tokenizer = train_bpe(documents, 260, root / "tokenizer")
    prepare([str(root / "doc-*.txt")], str(tokenizer), str(root / "good"), progress=False)
    return {"root": root, "tokenizer": tokenizer, "good": root / "good"}

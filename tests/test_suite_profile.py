"""tests/suite_profile.py (``make test-profile``): per test file, the tests' wall time and the XLA
compiles inside them, merged over pytest-xdist's workers."""

import json
import os
import subprocess
import sys

import pytest

TESTS = '''
import jax
import jax.numpy as jnp


def test_compiles_once():
    assert float(jax.jit(lambda x: jnp.sin(x) * 3)(jnp.ones(()))) > 0


def test_compiles_nothing():
    assert 1 + 1 == 2
'''


@pytest.mark.slow  # a tool of the suite's own
def test_the_profile_counts_each_files_tests_and_compiles(tmp_path):
    (tmp_path / "test_tiny.py").write_text(TESTS)
    out = tmp_path / "profile"
    tests_dir = os.path.dirname(__file__)
    env = {**os.environ, "PYTHONPATH": tests_dir, "SUITE_PROFILE_DIR": str(out), "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # a compile, not a cache hit
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "suite_profile", "-p", "no:cacheprovider",
                           "-n", "2", "test_tiny.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary) == ["test_tiny.py"]
    tiny = summary["test_tiny.py"]
    assert tiny["tests"] == 2 and tiny["compiles"] >= 1 and 0 < tiny["compile_s"] <= tiny["wall_s"]
    assert sorted(p.name for p in out.iterdir()) == ["gw0.json", "gw1.json", "summary.json"]
    assert "suite profile (" in proc.stdout and "test_tiny.py" in proc.stdout

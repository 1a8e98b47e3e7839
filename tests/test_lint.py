"""The code passes the linter with the rules pyproject.toml states ([tool.ruff])."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ruff_reports_nothing():
    command = [sys.executable, "-m", "ruff", "check", "--no-cache", "meshtrain", "models", "scripts", "tests",
               "tests_gpu"]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]

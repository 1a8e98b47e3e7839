"""Checkpoints against real signals, in ``python -m meshtrain.train`` subprocesses: SIGTERM (preemption)
and SIGKILL at ten moments, some in the middle of an asynchronous save.

Every run here is the same LONG-step config, so the subprocesses reuse the compiled programs of the
in-process reference run through a persistent compilation cache.
"""

from __future__ import annotations

import os
import pathlib
import random
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from meshtrain.checkpoint import CHECKPOINT_DIR
from meshtrain.loop import train
from utils import REPO, TINY, complete_steps, config, losses, overrides, records

LONG = 30
KILLS = 10
TMP_MARK = ".orbax-checkpoint-tmp"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted LONG-step run (no checkpoints): step -> loss."""
    run_dir = tmp_path_factory.mktemp("long-reference")
    train(config(run_dir, "checkpoint.enabled=false", steps=LONG))
    expected = losses(run_dir)
    assert list(expected) == list(range(1, LONG + 1))
    return expected


def _command(run_dir, *extra) -> list[str]:
    return [sys.executable, "-m", "meshtrain.train", "--host-devices", "8", "--config", TINY,
            *overrides(run_dir, *extra, steps=LONG)]


def _env() -> dict[str, str]:
    """The test session's environment (its compilation cache included, see conftest.py) on CPU."""
    return {**os.environ, "JAX_PLATFORMS": "cpu"}


def _count_records(run_dir) -> int:
    path = pathlib.Path(run_dir) / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _wait_for(condition, proc, what: str, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended (rc {proc.returncode}) while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def _temporary(run_dir) -> set[str]:
    root = pathlib.Path(run_dir) / CHECKPOINT_DIR
    return {p.name for p in root.iterdir() if TMP_MARK in p.name} if root.is_dir() else set()


def _complete(run_dir) -> list[int]:
    return complete_steps(run_dir) if (pathlib.Path(run_dir) / CHECKPOINT_DIR).is_dir() else []


def _resumed_step(stderr: str) -> int | None:
    match = re.search(r"^resumed from \S+ \(step (\d+),", stderr, re.MULTILINE)
    return int(match.group(1)) if match else None


def _assert_every_logged_loss_matches(run_dir, expected) -> None:
    """Every metrics record, including steps redone after a restart, has the reference loss bit for bit."""
    for record in records(run_dir):
        assert record["loss"] == expected[record["step"]], record


@pytest.mark.slow
def test_sigterm_saves_and_resumes(reference, tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(_command(run_dir, "checkpoint.every=0"), cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: _count_records(run_dir) >= 3, proc, "three logged steps")
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr
    last = stderr.strip().splitlines()[-1]
    match = re.fullmatch(r"preempted at step (\d+) \(saved to (\S+)\); resume with: (.+)", last)
    assert match, last
    step = int(match.group(1))
    assert 3 <= step < LONG
    assert match.group(2) == str(run_dir / CHECKPOINT_DIR / str(step))
    assert _complete(run_dir) == [step] and not _temporary(run_dir)  # saved and committed before exit
    assert [r["step"] for r in records(run_dir)][-1] == step

    resume = shlex.split(match.group(3))
    assert resume[:3] == ["python", "-m", "meshtrain.train"]
    done = subprocess.run([sys.executable, *resume[1:]], cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert _resumed_step(done.stderr) == step
    assert [r["step"] for r in records(run_dir)] == list(range(1, LONG + 1))
    _assert_every_logged_loss_matches(run_dir, reference)
    assert _complete(run_dir) == [step, LONG]


@pytest.mark.slow
def test_sigkill_at_ten_moments(reference, tmp_path):
    """One run, checkpoints every step, killed ten times: once during start-up, the even moments as
    soon as a save's temporary directory appears, the odd ones 1-3 logged steps after a restart plus a
    random delay (seeded)."""
    run_dir = tmp_path / "run"
    command, env = _command(run_dir, "checkpoint.every=1", "checkpoint.keep=2"), _env()
    rng = random.Random(20261201)
    killed_mid_save, seen_steps = 0, []
    for moment in range(KILLS):
        before, logged, partial = _complete(run_dir), _count_records(run_dir), _temporary(run_dir)
        with (tmp_path / f"attempt{moment}.err").open("w") as log:
            proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log)
            if moment == 0:
                time.sleep(rng.uniform(0.5, 2.0))  # during start-up or compilation
            else:
                progress = 1 if moment % 2 == 0 else rng.randint(1, 3)
                _wait_for(lambda: _count_records(run_dir) >= logged + progress, proc, "progress")  # noqa: B023
                if moment % 2 == 0:
                    _wait_for(lambda: _temporary(run_dir) - partial, proc, "a save in progress")  # noqa: B023
                else:
                    time.sleep(rng.uniform(0.0, 0.5))
            proc.kill()
            proc.wait(timeout=60)
        assert proc.returncode == -signal.SIGKILL, f"moment {moment}: the run ended by itself"
        stderr = (tmp_path / f"attempt{moment}.err").read_text()
        # Each restart continues from the newest checkpoint that was complete when it started.
        assert _resumed_step(stderr) == (before[-1] if before else None), (moment, before, stderr)
        killed_mid_save += bool(_temporary(run_dir) - partial)
        seen_steps.append(_complete(run_dir)[-1] if _complete(run_dir) else 0)

    print(f"checkpoint reached at each kill: {seen_steps}; kills during a save: {killed_mid_save}")
    before = _complete(run_dir)
    final = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stderr
    assert _resumed_step(final.stderr) == before[-1]
    assert killed_mid_save >= 3, killed_mid_save  # some kills really hit an unfinished save
    assert len(set(seen_steps)) >= 5, seen_steps  # the kills are spread over the run
    assert not [p for p in (run_dir / CHECKPOINT_DIR).iterdir() if "unreadable" in p.name]
    assert _complete(run_dir)[-1] == LONG
    _assert_every_logged_loss_matches(run_dir, reference)
    assert losses(run_dir) == reference

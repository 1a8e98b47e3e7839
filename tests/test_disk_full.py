"""A full disk is one line and leaves no half-written output: a checkpoint save (checked before
writing, and failing in orbax's writer threads, whose tracebacks stay quiet only while a save is in
flight), an export or HF import, and metrics.jsonl; the complete checkpoints stay and a resume from
them is exact.
"""

from __future__ import annotations

import errno
import os
import pathlib
import subprocess
import sys

import pytest

from meshtrain import convert, export
from meshtrain.checkpoint import CHECKPOINT_DIR
from meshtrain.loop import train
from meshtrain.run_lock import LOCK_FILE
from meshtrain.train import main
from utils import REPO, TINY, complete_steps, config, overrides, records, restore


def test_a_full_disk_stops_with_one_line_before_writing_and_keeps_earlier_checkpoints(tmp_path, monkeypatch,
                                                                                           capsys):
    import collections
    import shutil

    from meshtrain import checkpoint as checkpoint_module

    real = shutil.disk_usage
    calls = []

    def filling_up(path):
        calls.append(path)
        usage = real(path)
        free = usage.free if len(calls) == 1 else 5 * 10 ** 6  # room for the first save only
        return collections.namedtuple("usage", "total used free")(usage.total, usage.used, free)

    monkeypatch.setattr(checkpoint_module.shutil, "disk_usage", filling_up)
    code = main(["--config", TINY, *overrides(tmp_path, "checkpoint.every=1", steps=4)])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: checkpoint: cannot write checkpoint 2 in {tmp_path / CHECKPOINT_DIR}: it "
                             "needs about ") and "MB and 5 MB are free; the complete checkpoints there are " \
                             "intact ([1])" in err[0]
    assert complete_steps(tmp_path) == [1]
    assert not list((tmp_path / CHECKPOINT_DIR).glob("*tmp*"))  # nothing half-written
    restore(tmp_path, 1, config(tmp_path, steps=4))  # the earlier one is intact
    assert not (tmp_path / LOCK_FILE).exists()


def _fills_the_disk_after_writing_some(path_of):
    """A writer that leaves part of its output, then finds the disk full (``path_of(args)``: where)."""
    def write(*args, **kwargs):
        path = pathlib.Path(path_of(*args, **kwargs))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    return write


def test_a_full_disk_during_export_or_import_is_one_line_and_keeps_nothing(one_step_run, tmp_path, capsys,
                                                                           monkeypatch):
    """orbax's and safetensors' writes (safetensors wraps the OSError in its own
    error, found by its text)."""
    import orbax.checkpoint as ocp
    import safetensors.numpy

    monkeypatch.setattr(ocp.StandardCheckpointer, "save", _fills_the_disk_after_writing_some(
        lambda self, directory, *a, **k: pathlib.Path(directory) / "part.bin"))
    out = tmp_path / "export"
    assert export.main(["--run", str(one_step_run), "--out", str(out)]) == 2
    assert capsys.readouterr().err == (f"error: --out: cannot write {out}: No space left on device; nothing of it "
                                       "was kept\n")
    assert not out.exists()

    def storage_full(tensors, filename, *args, **kwargs):
        pathlib.Path(filename).write_bytes(b"partial")
        raise RuntimeError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space '
                           'left on device" })')

    monkeypatch.setattr(safetensors.numpy, "save_file", storage_full)
    out = tmp_path / "hf"
    out.mkdir()  # an empty directory given as --out stays, empty
    assert convert.main(["to-hf", "--from", str(one_step_run), "--out", str(out)]) == 2
    assert capsys.readouterr().err == (f"error: --out: cannot write {out}: No space left on device; nothing of it "
                                       "was kept\n")
    assert list(out.iterdir()) == []


def test_a_full_disk_while_writing_metrics_is_one_line(tmp_path, capsys, monkeypatch):
    """metrics.jsonl's write at step 2 fails; the checkpoints stay complete."""
    from meshtrain.metrics import MetricsLogger

    real_log = MetricsLogger.log

    def log(self, step, metrics):
        if step == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.run_dir / "metrics.jsonl"))
        real_log(self, step, metrics)

    monkeypatch.setattr(MetricsLogger, "log", log)
    run_dir = tmp_path / "run"
    assert main(["--config", TINY, *overrides(run_dir, "checkpoint.every=1", steps=3)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert errors == [f"error: {run_dir / 'metrics.jsonl'}: cannot write it: No space left on device; free some "
                      "space and run again"]
    assert complete_steps(run_dir) == [1, 2]  # the step that failed to log still saved its checkpoint


# Runs meshtrain.train with every file write past 50 kB refused (EFBIG, as a full disk refuses one) from
# checkpoint 4's save on, once checkpoint 2 is complete: orbax's writer threads fail, not the caller.
# The limit is set in this process, which is the run's own (a preexec_fn would run Python in a child
# forked from pytest's threads); the run's logs stay under it.
_FULL_FROM_CHECKPOINT_4 = """
import resource, runpy, signal, sys
from meshtrain import checkpoint
save = checkpoint.RunCheckpoints.save
def filling(self, step, state, meta):
    if step == 4:
        self.wait()
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, resource.RLIM_INFINITY))
    save(self, step, state, meta)
checkpoint.RunCheckpoints.save = filling
sys.argv = ["meshtrain.train", *sys.argv[1:]]
runpy.run_module("meshtrain.train", run_name="__main__")
"""


@pytest.mark.slow
def test_a_save_failing_in_orbaxs_threads_is_one_line_and_resume_is_exact(tmp_path):
    """One error line, exit 2, no traceback of orbax's threads (its logged ones and the
    unraisable "Event loop is closed" of writes still completing); checkpoint 2 intact, and the run
    resumed from it repeats steps 3-5 bit-exactly."""
    run_dir = tmp_path / "run"
    # No compilation cache and no bytecode files (under the limit both would be written truncated); this
    # process's XLA flags, so that both compile the same step.
    env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1",
           "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}
    proc = subprocess.run([sys.executable, "-c", _FULL_FROM_CHECKPOINT_4, "--host-devices", "8", "--config", TINY,
                           *overrides(run_dir, "checkpoint.every=2", steps=6)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1] == (
        f"error: checkpoint: cannot write a checkpoint in {run_dir / CHECKPOINT_DIR} (File too large); the "
        "complete checkpoints there are intact ([2]); free space or fix the directory, then resume")
    assert [line for line in proc.stderr.splitlines() if line.startswith(("error", "ERROR", "warning", "WARNING"))] \
        == proc.stderr.splitlines()[-1:], proc.stderr[-3000:]
    for noise in ("Traceback", "Exception in thread", "Event loop is closed"):
        assert noise not in proc.stderr, proc.stderr[-3000:]
    assert complete_steps(run_dir) == [2]
    first = {record["step"]: record["loss"] for record in records(run_dir)}
    assert sorted(first) == [1, 2, 3, 4, 5]  # the failure surfaced at checkpoint 6's save

    train(config(run_dir, "checkpoint.every=2", steps=6))  # resumes from checkpoint 2
    again = [(record["step"], record["loss"]) for record in records(run_dir)[len(first):]]
    assert [step for step, _ in again] == [3, 4, 5, 6] and all(loss == first[step] for step, loss in again[:3])
    assert complete_steps(run_dir) == [2, 4, 6]


def test_orbaxs_failure_reports_are_dropped_only_while_a_save_is_in_flight(tmp_path, monkeypatch):
    """The quiet scope opens at a save and closes at the wait (no global state): then
    the unraisable hook is the one before and the absl logger passes orbax's error records again."""
    import asyncio
    import logging
    import types

    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    from meshtrain.checkpoint import RunCheckpoints

    passed = []
    monkeypatch.setattr(sys, "unraisablehook", passed.append)
    absl = logging.getLogger("absl")
    filters = list(absl.filters)
    loop = asyncio.new_event_loop()
    loop.close()
    try:
        loop.call_soon_threadsafe(print)  # what a write completing after orbax closed its loop raises
    except RuntimeError as err:
        late = types.SimpleNamespace(exc_type=RuntimeError, exc_value=err, exc_traceback=err.__traceback__,
                                     err_msg=None, object=None)
    other = types.SimpleNamespace(exc_type=RuntimeError, exc_value=RuntimeError("Event loop is closed"),
                                  exc_traceback=None, err_msg=None, object=None)
    try:
        raise OSError(errno.ENOSPC, "No space left on device")
    except OSError:
        orbax_error = logging.LogRecord("absl", logging.ERROR, str(pathlib.Path(ocp.__file__).parent / "x.py"), 1,
                                        "Failed", None, sys.exc_info())
    checkpoints = RunCheckpoints(tmp_path / CHECKPOINT_DIR, keep=1)
    assert sys.unraisablehook == passed.append and absl.filters == filters  # nothing until a save
    checkpoints.save(1, {"x": jnp.arange(8.0)}, {"step": 1})
    sys.unraisablehook(late)
    sys.unraisablehook(other)  # not raised in call_soon_threadsafe: passes
    assert passed == [other] and not absl.filter(orbax_error)
    checkpoints.wait()
    assert sys.unraisablehook == passed.append and absl.filters == filters and absl.filter(orbax_error)
    checkpoints.close()
    assert checkpoints.steps() == [1]

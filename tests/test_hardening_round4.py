"""Hardening, round 4 (issue 53). Files a user may download run no code (items 1 and 9): a run's
checkpoint or an export that names a ``model.plugin`` is refused by every tool that loads it unless
``--trust-plugin`` is given; a plugin that fails to import is one line naming its file. A run writes
nothing through a link in its directory (2a), and a file where its checkpoints go is found at
start-up (10). A full disk is one line and leaves no half-written output (7), a checkpoint save that
fails in orbax's writer threads included (no traceback of theirs beside it)."""

from __future__ import annotations

import errno
import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from meshtrain import convert, export, generate, logits
from meshtrain.checkpoint import CHECKPOINT_DIR
from meshtrain.weights.export_format import EXPORT_META, PARAMS_DIR
from meshtrain.loop import train
from meshtrain.train import main as train_main
from test_checkpoint import REPO, TINY, config

PAYLOAD = """
import pathlib
pathlib.Path({marker!r}).write_text("ran")
"""


def _payload(directory: pathlib.Path, name: str) -> tuple[pathlib.Path, pathlib.Path]:
    """A plugin file (module ``name``) that leaves a marker file when imported: (the file, the marker)."""
    marker = directory / f"{name}.ran"
    plugin = directory / f"{name}.py"
    plugin.write_text(PAYLOAD.format(marker=str(marker)))
    return plugin, marker


@pytest.fixture(scope="module")
def one_step_run(tmp_path_factory):
    """A one-step tiny run with its checkpoint."""
    run_dir = tmp_path_factory.mktemp("one-step") / "run"
    train(config(run_dir, "checkpoint.every=1", steps=1))
    return run_dir


@pytest.fixture(scope="module")
def run_with_a_plugin(one_step_run, tmp_path_factory):
    """A copy of ``one_step_run`` whose checkpoint's recorded config names a payload plugin: (run,
    marker, plugin, tokens)."""
    root = tmp_path_factory.mktemp("untrusted")
    run_dir = root / "run"
    shutil.copytree(one_step_run, run_dir)
    plugin, marker = _payload(root, "downloaded_payload")
    meta_path = run_dir / CHECKPOINT_DIR / "1" / "meta" / "metadata"
    meta = json.loads(meta_path.read_text())
    meta["config"]["model"]["plugin"] = str(plugin)
    meta_path.write_text(json.dumps(meta))
    tokens = root / "tokens.npy"
    np.save(tokens, np.arange(8, dtype=np.int32)[None])
    return run_dir, marker, plugin, tokens


def _refused(code: int, capsys, plugin: pathlib.Path, field: str) -> None:
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: {field}: ") and str(plugin) in err and "--trust-plugin" in err, err


def test_every_tool_refuses_a_runs_plugin_without_trust_plugin(run_with_a_plugin, tmp_path, capsys):
    run_dir, marker, plugin, tokens = run_with_a_plugin
    _refused(logits.main(["--model", str(run_dir), "--tokens", str(tokens), "--out", str(tmp_path / "l.npy")]),
             capsys, plugin, "--model")
    _refused(export.main(["--run", str(run_dir), "--out", str(tmp_path / "export")]), capsys, plugin, "--run")
    _refused(convert.main(["to-hf", "--from", str(run_dir), "--out", str(tmp_path / "hf")]), capsys, plugin, "--from")
    _refused(generate.main(["--run", str(run_dir), "--prompt", "a", "--max-new-tokens", "1"]), capsys, plugin,
             "--run")
    assert not marker.exists()  # no code ran
    assert not (tmp_path / "export").exists() and not (tmp_path / "hf").exists() and not (tmp_path / "l.npy").exists()


def test_trust_plugin_imports_it(run_with_a_plugin, tmp_path, capsys):
    run_dir, marker, _, tokens = run_with_a_plugin
    out = tmp_path / "logits.npy"
    assert logits.main(["--model", str(run_dir), "--tokens", str(tokens), "--out", str(out), "--trust-plugin"]) == 0
    assert marker.read_text() == "ran" and np.load(out).shape[:2] == (1, 8)


def test_an_export_that_ships_its_own_plugin_is_refused_before_any_read(tmp_path, capsys, monkeypatch):
    """An export whose meshtrain.json names a plugin file beside it (a relative path)."""
    export_dir = tmp_path / "export"
    (export_dir / PARAMS_DIR).mkdir(parents=True)
    plugin, marker = _payload(export_dir, "shipped_payload")
    (export_dir / EXPORT_META).write_text(json.dumps({"model": {"family": "llama", "plugin": plugin.name}}))
    monkeypatch.chdir(export_dir)  # where the relative path would resolve
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.zeros((1, 4), np.int32))
    code = logits.main(["--model", str(export_dir), "--tokens", str(tokens), "--out", str(tmp_path / "l.npy")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and str(export_dir / EXPORT_META) in err and plugin.name in err, err
    assert "--trust-plugin" in err and not marker.exists()


@pytest.mark.parametrize("source, shown", [
    ("def broken(:\n", "SyntaxError at line 1"),
    ("raise RuntimeError('the plugin refuses to load')\n", "RuntimeError: the plugin refuses to load"),
], ids=["syntax-error", "raises"])
def test_a_plugin_that_fails_to_import_is_one_line_naming_its_file(tmp_path, capsys, source, shown):
    plugin = tmp_path / f"failing_plugin_{len(source)}.py"
    plugin.write_text(source)
    assert train_main(["--config", TINY, f"model.plugin={plugin}", f"run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: model.plugin: cannot import {plugin}: {shown}"), err


@pytest.mark.parametrize("name", ["metrics.jsonl", "config.yaml", "summary.json", "loss.png"])
def test_a_run_dir_with_a_link_where_an_output_goes_is_refused_before_writing(tmp_path, capsys, name):
    """Issue 53, item 2a: a link to a file outside, or a dangling one, in run.dir."""
    from test_checkpoint import overrides

    outside = tmp_path / "outside.txt"
    outside.write_text("keep me")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / name).symlink_to(outside)
    (run_dir / "tokenizer.json.tmp").symlink_to(tmp_path / "dangling-target")
    assert train_main(["--config", TINY, *overrides(run_dir, steps=1)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: run.dir: ") and "symbolic link" in err, err
    assert outside.read_text() == "keep me" and not (tmp_path / "dangling-target").exists()
    assert sorted(p.name for p in run_dir.iterdir()) == sorted([name, "tokenizer.json.tmp"])  # nothing written


def test_a_checkpoints_path_that_is_a_file_stops_before_the_first_step(tmp_path, capsys):
    """Issue 53, item 10: found at start-up, not at the first save after training steps."""
    from test_checkpoint import overrides

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / CHECKPOINT_DIR).write_text("a file")
    assert train_main(["--config", TINY, *overrides(run_dir, "checkpoint.every=1", steps=1)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: run.dir: {run_dir / CHECKPOINT_DIR} is a file, not a directory\n", err
    assert not (run_dir / "metrics.jsonl").exists() and (run_dir / CHECKPOINT_DIR).read_text() == "a file"


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
    """Issue 53, item 7: orbax's and safetensors' writes (safetensors wraps the OSError in its own
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
    """Issue 53, item 7: metrics.jsonl's write at step 2 fails; the checkpoints stay complete."""
    from meshtrain.metrics import MetricsLogger
    from test_checkpoint import complete_steps, overrides

    real_log = MetricsLogger.log

    def log(self, step, metrics):
        if step == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.run_dir / "metrics.jsonl"))
        real_log(self, step, metrics)

    monkeypatch.setattr(MetricsLogger, "log", log)
    run_dir = tmp_path / "run"
    assert train_main(["--config", TINY, *overrides(run_dir, "checkpoint.every=1", steps=3)]) == 2
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
    """Issue 53, item 7: one error line, exit 2, no traceback of orbax's threads (its logged ones and the
    unraisable "Event loop is closed" of writes still completing); checkpoint 2 intact, and the run
    resumed from it repeats steps 3-5 bit-exactly."""
    from test_checkpoint import complete_steps, overrides, records

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
    """Issue 53, item 7: the quiet scope opens at a save and closes at the wait (no global state): then
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

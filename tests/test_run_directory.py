"""A run's directory and a prepare's ``--out`` are held by one live process at a time: a second one
refuses and writes nothing; a lock no live process can hold (a killed run's, a restarted container's,
an impossible PID) is taken over with a warning. Nothing is written through a link in run.dir, and
an output path under a file (run.dir, checkpoints, profile, --out) is one line before any work.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from meshtrain.checkpoint import CHECKPOINT_DIR
from meshtrain.loop import train
from meshtrain.run_lock import LOCK_FILE
from meshtrain.train import main
from utils import REPO, TINY, complete_steps, config, overrides


def _lock(run_dir, pid: int, host: str | None = None) -> None:
    import json
    import socket

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / LOCK_FILE).write_text(json.dumps({"pid": pid, "host": host or socket.gethostname(),
                                                 "started": "2026-12-01T00:00:00Z"}))


def test_a_live_run_holds_its_directory_and_a_second_one_writes_nothing(tmp_path, capsys):
    live = subprocess.Popen(["sleep", "60"])
    try:
        _lock(tmp_path, live.pid)
        before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
        assert main(["--config", TINY, f"run.dir={tmp_path}", "train.steps=2"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"error: run.dir: {tmp_path} is in use by a live run "
                                                       f"(process {live.pid} on host "), err
        assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # nothing written
    finally:
        live.kill()
        live.wait()
    _lock(tmp_path, live.pid, host="another-host")  # another host's lock cannot be checked: refused
    assert main(["--config", TINY, f"run.dir={tmp_path}", "train.steps=2"]) == 2
    assert f"if that run is gone, remove {tmp_path / LOCK_FILE}" in capsys.readouterr().err


def test_a_killed_runs_stale_lock_is_taken_over_with_a_warning(tmp_path, capsys):
    dead = subprocess.Popen(["true"])
    dead.wait()
    _lock(tmp_path, dead.pid)
    train(config(tmp_path, steps=2))
    err = capsys.readouterr().err
    assert f"warning: {tmp_path / LOCK_FILE} was left by process {dead.pid}, which is no longer running" in err
    assert complete_steps(tmp_path) == [2] and not (tmp_path / LOCK_FILE).exists()  # released at the end


@pytest.mark.slow
def test_two_real_runs_on_one_directory(tmp_path, capsys):
    """A run in another process holds the directory; a second refuses; once the first is SIGKILLed
    its lock is stale and a third run takes over and resumes from its checkpoints."""
    command = [sys.executable, "-m", "meshtrain.train", "--host-devices", "8", "--config", TINY,
               *overrides(tmp_path, "checkpoint.every=1", steps=10_000)]
    log = tmp_path / "first.log"
    with log.open("w") as err:
        first = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err)
    try:
        # Waits for the first checkpoint however slow the machine is: it ends early only if the run
        # exits (its error then shown) or after 15 minutes (a hang).
        deadline = time.monotonic() + 900
        while not complete_steps_or_empty(tmp_path) and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert complete_steps_or_empty(tmp_path), f"the first run never saved:\n{log.read_text()[-3000:]}"
        assert main(["--config", TINY, *overrides(tmp_path, steps=10_000)]) == 2
        assert f"(process {first.pid} on host " in capsys.readouterr().err
    finally:
        first.kill()
        first.wait()
    latest = complete_steps(tmp_path)[-1]
    train(config(tmp_path, steps=latest + 1))
    err = capsys.readouterr().err
    assert "which is no longer running; taking over" in err and "resumed from" in err
    assert complete_steps(tmp_path)[-1] == latest + 1


def complete_steps_or_empty(run_dir) -> list[int]:
    return complete_steps(run_dir) if (run_dir / CHECKPOINT_DIR).is_dir() else []


@pytest.mark.parametrize("pid", ["own", 10 ** 30], ids=["own-pid-after-a-container-restart", "pid-out-of-range"])
def test_locks_no_live_process_can_hold_are_taken_over(tmp_path, capsys, pid):
    """A restarted container's run has the PID of the killed one (PID 1): its lock used to block every
    restart; a lock naming a PID no process can have was an OverflowError traceback."""
    import json
    import os
    import socket

    from meshtrain.run_lock import RunLock

    holder = {"pid": os.getpid() if pid == "own" else pid, "host": socket.gethostname(), "started": "earlier"}
    (tmp_path / LOCK_FILE).write_text(json.dumps(holder))
    with RunLock(tmp_path):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert "which is no longer running; taking over the run directory" in capsys.readouterr().err
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_second_prepare_into_a_running_ones_out_refuses_and_removes_nothing(prepared_corpus, tmp_path,
                                                                                           capsys):
    """A prepare holds its --out (``.meshtrain.lock``, as training holds run.dir): a second one into
    the same directory while the first is live (its lock names this test's parent process, alive)
    is one line naming --out, and the first one's partial files stay; a lock left by a process
    that is gone is taken over and the corpus prepared."""
    import json
    import os
    import socket

    from meshtrain.data.__main__ import main as data_main
    from meshtrain.data.prepared import INCOMPLETE_MARKER
    from meshtrain.run_lock import LOCK_FILE

    out = tmp_path / "out"
    out.mkdir()
    (out / INCOMPLETE_MARKER).touch()  # the first prepare, mid-way
    (out / "train-00000.bin.tmp").write_bytes(b"\x01\x02")
    live = {"pid": os.getppid(), "host": socket.gethostname(), "started": "2026-12-04T19:00:00Z"}
    (out / LOCK_FILE).write_text(json.dumps(live))
    command = ["prepare", "--tokenizer", str(prepared_corpus["tokenizer"]), "--input",
               str(prepared_corpus["root"] / "doc-*.txt"), "--out", str(out)]
    assert data_main(command) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --out: {out} is in use by a live prepare (process {os.getppid()} on host "
                   f"{socket.gethostname()} since 2026-12-04T19:00:00Z); wait for it to finish or choose another "
                   "--out"], err
    assert (out / "train-00000.bin.tmp").read_bytes() == b"\x01\x02" and (out / INCOMPLETE_MARKER).exists()
    # The first one died (a PID no process can have): the next prepare takes over and finishes.
    (out / LOCK_FILE).write_text(json.dumps({**live, "pid": 2 ** 22 + 12345}))
    assert data_main(command) == 0
    assert (out / "index.json").exists() and not (out / LOCK_FILE).exists() and not (out / INCOMPLETE_MARKER).exists()
    assert "taking over" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["metrics.jsonl", "config.yaml", "summary.json", "loss.png"])
def test_a_run_dir_with_a_link_where_an_output_goes_is_refused_before_writing(tmp_path, capsys, name):
    """A link to a file outside, or a dangling one, in run.dir."""
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / name).symlink_to(outside)
    (run_dir / "tokenizer.json.tmp").symlink_to(tmp_path / "dangling-target")
    assert main(["--config", TINY, *overrides(run_dir, steps=1)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: run.dir: ") and "symbolic link" in err, err
    assert outside.read_text() == "keep me" and not (tmp_path / "dangling-target").exists()
    assert sorted(p.name for p in run_dir.iterdir()) == sorted([name, "tokenizer.json.tmp"])  # nothing written


def test_a_checkpoints_path_that_is_a_file_stops_before_the_first_step(tmp_path, capsys):
    """Found at start-up, not at the first save after training steps."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / CHECKPOINT_DIR).write_text("a file")
    assert main(["--config", TINY, *overrides(run_dir, "checkpoint.every=1", steps=1)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: run.dir: {run_dir / CHECKPOINT_DIR} is a file, not a directory\n", err
    assert not (run_dir / "metrics.jsonl").exists() and (run_dir / CHECKPOINT_DIR).read_text() == "a file"


def test_outputs_under_a_file_are_one_line_before_any_work(prepared_corpus, tmp_path, capsys, monkeypatch):
    """prepare, train-tokenizer (checked before training, not after), convert to-hf and train's
    run.dir, each asked to write under a path that is a file: one line naming the flag, exit 2
    (``meshtrain.errors.writable_directory``; a permission refusal takes the same path, but these
    tests run as root, which permissions do not stop)."""
    from tokenizers import Tokenizer

    from meshtrain.convert import main as convert_main
    from meshtrain.data.__main__ import main as data_main

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    under = blocker / "out"
    docs = str(prepared_corpus["root"] / "doc-*.txt")

    def no_training(*args, **kwargs):
        raise AssertionError("train-tokenizer trained before checking --out")

    monkeypatch.setattr(Tokenizer, "train_from_iterator", no_training)
    cases = [
        (data_main, ["prepare", "--tokenizer", str(prepared_corpus["tokenizer"]), "--input", docs, "--out", str(under)],
         f"error: --out: {under}: a parent of it is a file, not a directory"),
        (data_main, ["train-tokenizer", "--input", docs, "--vocab-size", "300", "--out", str(under)],
         f"error: --out: {under}: a parent of it is a file, not a directory"),
        (convert_main, ["to-hf", "--from", str(prepared_corpus["root"]), "--out", str(under)], None),
        (main, ["--config", TINY, *overrides(under)], f"error: run.dir: {under}: a parent of it is a file, not a "
                                                     "directory"),
    ]
    for entry, argv, expected in cases:
        assert entry(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), (argv, err)
        if expected is not None:
            assert err[0] == expected, err
    assert blocker.read_text() == "not a directory"


def test_a_profile_directory_that_is_a_file_stops_before_the_first_step(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "profile").write_text("a file where the traces would go")
    assert main(["--config", TINY, *overrides(run_dir), "train.profile_steps=1-2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"error: train.profile_steps: {run_dir / 'profile'} is a file, not a directory", err
    assert not (run_dir / "metrics.jsonl").exists() or "loss" not in (run_dir / "metrics.jsonl").read_text()

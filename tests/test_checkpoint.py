"""Checkpoints in-process: exact resume, restore onto other meshes, non-finite policies, unreadable
checkpoints, export / init_from, and bad input (one-line errors before anything compiles).

All runs use configs/tiny.yaml shrunk to embed 32, batch 16, fp32, on mesh (2, 2, 2, 1) unless said.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal

import jax
import numpy as np
import pytest
from flax import nnx

from meshtrain import loop, policies
from meshtrain import export
from meshtrain.checkpoint import CHECKPOINT_DIR, RunCheckpoints
from meshtrain.weights.export_format import check_params, load_params
from meshtrain.config import load_config, to_dict
from meshtrain.errors import ConfigError
from meshtrain.loop import train
from meshtrain.train import EXIT_NONFINITE, main
from utils import (TINY, TINY_STEPS, complete_steps, config, flat_params, losses, overrides, records,
                   restore, trainer_of_config)

HALF = TINY_STEPS // 2  # N; a run of TINY_STEPS = 2N steps unless said


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """2N steps in one run, async saves every N steps: the run everything else is compared with."""
    run_dir = tmp_path_factory.mktemp("reference")
    train(config(run_dir, f"checkpoint.every={HALF}"))
    return run_dir


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """N steps, a real SIGTERM (raised in-process once step N-1 is dispatched, so the preemption
    policy reads it after step N), then a restart for N more. The signal comes from a test-only
    policy: a new behaviour of the loop is one more object, passed to ``train``."""
    run_dir = tmp_path_factory.mktemp("interrupted")

    class SignalAtStep(policies.Policy):
        def after_step(self, run):
            if run.current.done == HALF - 1:  # called after the built-in policies, Preemption among them
                os.kill(os.getpid(), signal.SIGTERM)

    first = train(config(run_dir, "checkpoint.every=0"), policies=[SignalAtStep()])
    assert first["preempted"] and complete_steps(run_dir) == [HALF]
    first_records = records(run_dir)
    second = train(config(run_dir, "checkpoint.every=0"))
    return run_dir, first, first_records, second


@pytest.mark.slow
def test_exact_resume_is_bit_identical(reference, interrupted):
    run_dir, _, first_records, second = interrupted
    assert [r["step"] for r in first_records] == list(range(1, HALF + 1))
    assert second["resumed_from"] == HALF and not second["preempted"]
    assert [r["step"] for r in records(run_dir)] == list(range(1, TINY_STEPS + 1))  # appended, no gap
    expected = losses(reference)
    assert list(expected) == list(range(1, TINY_STEPS + 1))
    assert losses(run_dir) == expected  # bit-identical fp32 floats
    assert complete_steps(run_dir) == [HALF, TINY_STEPS]
    final = restore(run_dir, TINY_STEPS, config(run_dir))
    reference_final = restore(reference, TINY_STEPS, config(reference))
    for name, value in flat_params(reference_final.state).items():
        np.testing.assert_array_equal(flat_params(final.state)[name], value, err_msg=name)
    assert final.meta["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2, "stage": 1}
    assert final.meta["data"] == {"seed": 0, "next_example": TINY_STEPS * 16}
    assert final.meta["config"]["train"]["steps"] == TINY_STEPS


@pytest.mark.slow
@pytest.mark.parametrize("mesh, devices", [((1, 8, 1, 1), 8), ((2, 2, 1, 1), 4)], ids=["fsdp8", "4-devices"])
def test_restore_onto_another_mesh(reference, interrupted, tmp_path, mesh, devices):
    source = interrupted[0] / CHECKPOINT_DIR / str(HALF)  # written on (2, 2, 2, 1) after N steps
    data, fsdp, tensor, stage = mesh
    cfg = config(tmp_path, f"checkpoint.restore_from={source}", f"mesh.data={data}", f"mesh.fsdp={fsdp}",
                 f"mesh.tensor={tensor}", f"mesh.stage={stage}", "checkpoint.every=0")
    summary = train(cfg, devices=jax.devices()[:devices])
    assert summary["resumed_from"] == HALF and summary["mesh"] == dict(zip(("data", "fsdp", "tensor", "stage"), mesh))
    got, expected = losses(tmp_path), losses(reference)
    assert list(got) == list(range(HALF + 1, TINY_STEPS + 1))
    np.testing.assert_allclose([got[s] for s in got], [expected[s] for s in got], rtol=1e-5, atol=0)


def _inject_nan(monkeypatch, *bad_indices: int) -> None:
    """The batches of step indices ``bad_indices`` get a NaN mask: NaN loss and gradients (a test hook)."""
    original = loop.global_batch

    def batch(dataset, step, batch_size, sharding):
        result = original(dataset, step, batch_size, sharding)
        if step in bad_indices:
            result["mask"] = jax.device_put(np.full(result["mask"].shape, np.nan, np.float32), sharding)
        return result

    monkeypatch.setattr(loop, "global_batch", batch)


BAD = 2  # step index with the NaN batch: steps 1-2 are good, step 3 is bad (1-based)


@pytest.mark.slow
def test_nonfinite_skip_leaves_state_unchanged(tmp_path, monkeypatch):
    """The skipped step's state equals the one before it (read by a test-only policy before the next
    step takes it); no checkpoint is written of a skipped step, the next applied one is saved."""
    _inject_nan(monkeypatch, BAD)

    class KeepParams(policies.Policy):
        def __init__(self):
            self.params = {}

        def after_step(self, run):
            self.params[run.current.done] = flat_params(run.current.state)

    kept = KeepParams()
    summary = train(config(tmp_path, "checkpoint.every=1", "checkpoint.keep=10"), policies=[kept])
    assert summary["skipped_steps"] == 1
    logged = {r["step"]: r for r in records(tmp_path)}
    assert logged[BAD + 1]["loss"] == "nan" and logged[BAD + 1]["skipped_steps"] == 1
    assert logged[BAD + 1]["update_skipped"] == 1.0 and logged[BAD]["update_skipped"] == 0.0
    assert all(np.isfinite(logged[s]["loss"]) for s in range(1, TINY_STEPS + 1) if s != BAD + 1)
    before, bad, after = (kept.params[s] for s in (BAD, BAD + 1, BAD + 2))
    for name, value in before.items():
        np.testing.assert_array_equal(bad[name], value, err_msg=name)  # unchanged
    assert any(not np.array_equal(after[n], v) for n, v in bad.items())
    assert complete_steps(tmp_path) == [s for s in range(1, TINY_STEPS + 1) if s != BAD + 1]
    saved = restore(tmp_path, BAD + 2, config(tmp_path))
    assert int(saved.state.skipped_steps) == 1 and int(saved.state.step) == BAD + 2
    for name, value in flat_params(saved.state).items():
        np.testing.assert_array_equal(after[name], value, err_msg=name)


@pytest.mark.slow
def test_nonfinite_stop_saves_last_good_state(tmp_path, monkeypatch, capsys):
    _inject_nan(monkeypatch, BAD)
    rc = main(["--config", TINY, *overrides(tmp_path, "train.on_nonfinite=stop", "checkpoint.every=1",
                                            "checkpoint.keep=10")])
    assert rc == EXIT_NONFINITE
    error = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "step 3 had loss nan" in error[0], error
    assert str(tmp_path / CHECKPOINT_DIR / "3") in error[0]
    assert complete_steps(tmp_path) == [1, 2, 3]  # nothing after the bad step was applied or saved
    assert [r["step"] for r in records(tmp_path)] == [1, 2, 3]
    cfg = config(tmp_path)
    good, saved = restore(tmp_path, BAD, cfg), restore(tmp_path, BAD + 1, cfg)  # the last good one restores
    for name, value in flat_params(good.state).items():
        np.testing.assert_array_equal(flat_params(saved.state)[name], value, err_msg=name)
    assert all(np.isfinite(v).all() for v in flat_params(saved.state).values())


@pytest.mark.slow
def test_a_run_of_skipped_steps_stops_and_rotates_no_checkpoint_out(tmp_path, monkeypatch, capsys):
    """Under ``skip``, steps 4-8 are non-finite: checkpoints every step, keep 2. The saver writes no
    skipped step (before, 5 and 6 rotated 2 and 3 out, holding the state step 3 left), and after
    ``train.max_consecutive_skips=3`` skipped steps in a row the run stops, exit 3, one line."""
    _inject_nan(monkeypatch, *range(3, 8))
    rc = main(["--config", TINY, *overrides(tmp_path, "checkpoint.every=1", "checkpoint.keep=2",
                                            "train.max_consecutive_skips=3")])
    assert rc == EXIT_NONFINITE
    error = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "steps 4-6 all skipped their update" in error[0], error
    assert str(tmp_path / CHECKPOINT_DIR / "3") in error[0]
    assert complete_steps(tmp_path) == [2, 3]
    assert [r["step"] for r in records(tmp_path)][-1] >= 6  # the skipped steps were logged


def test_max_consecutive_skips_is_checked():
    with pytest.raises(ConfigError, match=r"train\.max_consecutive_skips: must be >= 0"):
        load_config(TINY, ["train.max_consecutive_skips=-1"])


def _largest_file(directory: pathlib.Path) -> pathlib.Path:
    return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


# orbax leaves the read coroutines of a failed restore un-awaited; pytest reports them at collection.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_unreadable_latest_falls_back_and_is_kept(reference, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    root = run_dir / CHECKPOINT_DIR
    shutil.copytree(root / str(HALF), root / "6.orbax-checkpoint-tmp")  # a save killed midway
    victim = _largest_file(root / str(TINY_STEPS) / "state")
    size = victim.stat().st_size
    with victim.open("r+b") as f:
        f.truncate(size // 2)
    cfg = config(run_dir)
    checkpoints = RunCheckpoints(root, keep=3)
    try:
        trainer = trainer_of_config(cfg)
        restored = checkpoints.restore_latest(trainer.abstract_state(), field="run.dir",
                                              layer_order=trainer.layer_order, move_unreadable=True)
    finally:
        checkpoints.close()
    assert restored.step == HALF
    err = capsys.readouterr().err
    assert f"checkpoint {root / str(TINY_STEPS)} is unreadable" in err and f"trying step {HALF}" in err, err
    assert f"ignoring incomplete checkpoint {root / '6.orbax-checkpoint-tmp'}" in err, err
    kept = root / f"{TINY_STEPS}.unreadable"
    assert kept.is_dir() and (kept / victim.relative_to(root / str(TINY_STEPS))).stat().st_size == size // 2
    assert (root / "6.orbax-checkpoint-tmp").is_dir()  # nothing deleted
    assert complete_steps(run_dir) == [HALF]


def test_every_checkpoint_unreadable_is_an_error(reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    for step in (HALF, TINY_STEPS):
        (run_dir / CHECKPOINT_DIR / str(step) / "meta" / "metadata").write_text("{not json")
    cfg = config(run_dir)
    checkpoints = RunCheckpoints(run_dir / CHECKPOINT_DIR, keep=3)
    with pytest.raises(ConfigError, match="no readable checkpoint") as err:
        trainer = trainer_of_config(cfg)
        checkpoints.restore_latest(trainer.abstract_state(), field="run.dir",
                                   layer_order=trainer.layer_order, move_unreadable=True)
    checkpoints.close()
    assert err.value.field == "run.dir"
    assert sorted(p.name for p in (run_dir / CHECKPOINT_DIR).iterdir() if "unreadable" in p.name) == [
        f"{HALF}.unreadable", f"{TINY_STEPS}.unreadable"]


def test_export_then_init_from(reference, tmp_path, capsys):
    out = tmp_path / "export"
    assert export.main(["--run", str(reference), "--out", str(out)]) == 0
    assert f"step {TINY_STEPS}" in capsys.readouterr().err
    meta = json.loads((out / "meshtrain.json").read_text())
    assert meta["step"] == TINY_STEPS and meta["model"]["embed_dim"] == 32
    assert not (out / "params" / "opt_state").exists()
    cfg = config(tmp_path / "finetune", f"checkpoint.init_from={out}", "checkpoint.enabled=false")
    trainer = trainer_of_config(cfg)
    target = check_params(str(out), trainer.abstract_params, trainer.param_shardings,
                          model_config=to_dict(cfg)["model"])
    loaded = load_params(str(out), target)
    expected = flat_params(restore(reference, TINY_STEPS, cfg).state)
    for path, value in jax.tree_util.tree_flatten_with_path(loaded)[0]:
        name = ".".join(str(getattr(k, "key", k)) for k in path)
        np.testing.assert_array_equal(np.asarray(value), expected[name], err_msg=name)
    shardings = nnx.to_pure_dict(trainer.param_shardings)
    for value, sharding in zip(jax.tree.leaves(loaded), jax.tree.leaves(shardings)):
        assert value.sharding.is_equivalent_to(sharding, value.ndim)  # born in the run's shardings
    # End to end: at step 1 the learning rate is 0 (warmup), so its loss is the exported model's loss,
    # well below that of a fresh init (5.415 on this batch).
    train(cfg)
    assert losses(tmp_path / "finetune")[1] < losses(reference)[TINY_STEPS] + 0.1 < 5.2


def test_tools_do_not_warn_that_read_only_checkpoints_are_read_only(reference, tmp_path, capsys):
    export.export(str(reference), str(tmp_path / "export"))
    err = capsys.readouterr().err
    assert "read only" not in err and "read_only" not in err, err


def _one_line_error(rc, err, field, *hints):
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {field}: "), err
    for hint in hints:
        assert hint in lines[0], (hint, lines[0])


BAD_INPUTS = [
    (["checkpoint.restore_from=/nonexistent/run"], "checkpoint.restore_from", ["no such directory"]),
    (["checkpoint.keep=0"], "checkpoint.keep", ["positive integer"]),
    (["train.on_nonfinite=ignore"], "train.on_nonfinite", ["'ignore' is not valid", "skip | stop"]),
    (["model.init_from=x", "checkpoint.init_from=y"], "model.init_from", ["not both"]),
    (["model.init_from=/x"], "checkpoint.init_from", ["no such directory: /x"]),  # the alias
    (["checkpoint.restore_from=/a", "checkpoint.init_from=/b"], "checkpoint.init_from", ["not both"]),
    (["checkpoint.every=-1"], "checkpoint.every", [">= 0"]),
]


@pytest.mark.parametrize("extra, field, hints", BAD_INPUTS,
                         ids=[b[1] + "-" + b[0][0].split("=")[1] for b in BAD_INPUTS])
def test_bad_input(tmp_path, capsys, no_compile, extra, field, hints):
    rc = main(["--config", TINY, *overrides(tmp_path, *extra)])
    _one_line_error(rc, capsys.readouterr().err, field, *hints)


def test_bad_checkpoint_paths(reference, tmp_path, capsys, no_compile):
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        ([f"checkpoint.restore_from={empty}"], "checkpoint.restore_from", ["no complete checkpoint"]),
        ([f"checkpoint.restore_from={reference / 'metrics.jsonl'}"], "checkpoint.restore_from", ["is a file"]),
        ([f"checkpoint.restore_from={reference}", "model.embed_dim=64"], "checkpoint.restore_from",
         ["does not fit this run", "model.embed_dim: 32 there, 64 here"]),
        ([f"checkpoint.init_from={reference}"], "checkpoint.init_from", ["meshtrain.export"]),
    ]
    for extra, field, hints in cases:
        rc = main(["--config", TINY, *overrides(tmp_path / "run", *extra)])
        _one_line_error(rc, capsys.readouterr().err, field, *hints)
    rc = main(["--fresh", "--config", TINY, *overrides(reference)])
    _one_line_error(rc, capsys.readouterr().err, "--fresh", "already holds checkpoints", f"step {TINY_STEPS}")


def test_export_bad_input(tmp_path, capsys):
    assert export.main(["--run", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    _one_line_error(2, capsys.readouterr().err, "--run", "no complete checkpoint")


@pytest.mark.parametrize("inherited", [signal.default_int_handler, signal.SIG_IGN],
                         ids=["foreground", "background-job"])
def test_sigint_is_preemption_and_a_second_one_aborts(capsys, inherited):
    """Also when SIGINT was inherited as ignored (``make test &``, nohup): the second one still aborts."""
    outside = signal.signal(signal.SIGINT, inherited)
    try:
        with policies.Preemption() as preemption:
            assert not preemption.requested
            os.kill(os.getpid(), signal.SIGINT)
            assert preemption.requested and preemption.received == "SIGINT"
            assert "finishing the current step" in capsys.readouterr().err
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is inherited
    finally:
        signal.signal(signal.SIGINT, outside)


def test_two_signals_coalesced_before_the_handler_runs_still_abort(capsys):
    """Python runs one handler for signals that arrive before it gets to run (a second SIGTERM 50 ms
    after the first, during a long device call); the wakeup fd still holds one byte per delivery."""
    from meshtrain.policies import Preemption

    with Preemption() as preemption:
        os.write(preemption._wakeup[1], bytes([signal.SIGINT]) * 2)  # what two deliveries leave
        with pytest.raises(KeyboardInterrupt):
            preemption._handle(signal.SIGINT, None)
    assert preemption.received is None  # aborted at once: no "finishing the current step"
    assert "finishing the current step" not in capsys.readouterr().err
    with Preemption() as preemption:  # one delivery: the normal preemption
        os.write(preemption._wakeup[1], bytes([signal.SIGTERM]))
        preemption._handle(signal.SIGTERM, None)
        assert preemption.received == "SIGTERM"


def test_time_based_saves(tmp_path, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(policies.time, "monotonic", lambda: clock[0])
    cfg = config(tmp_path, "checkpoint.every=0", "checkpoint.every_minutes=2")
    saver = policies.Saver(cfg, checkpoints=object(), mesh=None)
    assert not saver.due(1)
    clock[0] += 119
    assert not saver.due(2)
    clock[0] += 1
    assert saver.due(3)
    every = policies.Saver(config(tmp_path, "checkpoint.every=5"), checkpoints=object(), mesh=None)
    assert [s for s in range(1, 16) if every.due(s)] == [5, 10, 15]
    assert not policies.Saver(cfg, checkpoints=None, mesh=None).due(5)  # checkpoint.enabled=false

"""Hardening (issue 12): nothing lost, nothing silently wrong, every bad input one line.

Each test names the item of the issue it reproduces and then holds.
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
import time

import numpy as np
import pytest

from meshtrain.errors import ConfigError
from meshtrain.checkpoint import CHECKPOINT_DIR
from meshtrain.run_lock import LOCK_FILE
from meshtrain.loop import train
from meshtrain.policies import NonFiniteStop
from meshtrain.train import main
from test_checkpoint import (REPO, TINY, complete_steps, config, flat_params, no_compile, overrides,  # noqa: F401
                             records, restore)
from utils import trainer_of_config

NON_FINITE_FIELDS = ["optimizer.learning_rate", "optimizer.eps", "optimizer.weight_decay", "optimizer.b1",
                     "model.norm_eps", "model.rope_theta", "model.rope_scaling.factor",
                     "checkpoint.every_minutes", "data.markov_noise"]


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "nan"])
@pytest.mark.parametrize("field", NON_FINITE_FIELDS)
def test_item1_non_finite_config_values_are_one_line_errors(capsys, field, value):
    assert main(["--config", TINY, f"{field}={value}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {field}: must be a finite number, got "), err


def _nan_learning_rate(cfg):
    """``cfg`` with a NaN learning rate, as code that bypasses the config loader could build it."""
    return dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, learning_rate=math.nan))


def test_item1_a_non_finite_update_from_finite_gradients_is_measured(tmp_path):
    """Finite loss and gradients: the update is applied in place and its result is checked, every new
    parameter and moment; a NaN learning rate (bypassing the config loader) fails that check."""
    from meshtrain.data import global_batch, make_dataset

    good = config(tmp_path, "optimizer.warmup_steps=0", steps=2)
    for cfg, finite in ((good, True), (_nan_learning_rate(good), False)):
        trainer = trainer_of_config(cfg)
        dataset = make_dataset(cfg.data, vocab_size=cfg.model.vocab_size, seq_len=cfg.model.seq_len)
        state, metrics = trainer.train_step(trainer.init_state(seed=0),
                                            global_batch(dataset, 0, cfg.train.batch_size, trainer.batch_sharding))
        assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))
        assert int(state.skipped_steps) == 0 and bool(metrics["state_finite"]) is finite
        assert all(np.isfinite(value).all() for value in flat_params(state).values()) is finite


@pytest.mark.parametrize("value, finite", [(1.0, True), (3e38, True), (math.inf, False), (-math.inf, False),
                                          (math.nan, False)])
def test_item1_the_check_of_the_applied_state_is_exact(value, finite):
    """``state_finite``'s reduction: inf and NaN anywhere fail it, large finite values whose plain sum
    overflows (two of 3e38 in fp32) pass it; integer leaves are not checked, bf16 ones are."""
    import jax.numpy as jnp

    from meshtrain.trainer import all_finite

    tree = {"w": jnp.ones((4, 1000), jnp.float32).at[1, 7].set(value).at[3, 9].set(3e38),
            "count": jnp.int32(3), "half": jnp.ones((8,), jnp.bfloat16)}
    assert bool(all_finite(tree)) is finite
    assert not bool(all_finite({**tree, "half": tree["half"].at[2].set(jnp.inf)}))


@pytest.mark.parametrize("policy", ["skip", "stop"])
@pytest.mark.parametrize("every", [1, 100])  # the step's own save, and the next step's check
def test_item1_a_non_finite_update_stops_the_run_and_keeps_the_good_checkpoints(tmp_path, policy, every):
    """A run resumed from a good checkpoint with a NaN learning rate: step 2's update is applied
    (finite gradients) and leaves NaN; the run stops with exit status 3's error before saving it, under
    either policy, and checkpoint 1 is still there, bit for bit."""
    train(config(tmp_path, "checkpoint.every=1", steps=1))
    good = flat_params(restore(tmp_path, 1, config(tmp_path, steps=1)).state)
    cfg = _nan_learning_rate(config(tmp_path, f"train.on_nonfinite={policy}", f"checkpoint.every={every}",
                                    steps=4))
    with pytest.raises(NonFiniteStop, match=r"step 2 left non-finite parameters or optimizer moments .* "
                                            r"the newest checkpoint, .*checkpoints/1, holds the last good state"):
        train(cfg)
    assert complete_steps(tmp_path) == [1]
    for name, value in flat_params(restore(tmp_path, 1, cfg).state).items():
        np.testing.assert_array_equal(value, good[name], err_msg=name)


def test_item1_adam_settings_that_divide_by_zero_are_one_line_errors(capsys):
    for field, value, valid in (("optimizer.b1", "1.0", "[0, 1)"), ("optimizer.b2", "0.999999999", "[0, 1)"),
                                ("optimizer.eps", "0", "> 0")):
        assert main(["--config", TINY, f"{field}={value}"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"error: {field}: must be ") and valid in err, err


def _lock(run_dir, pid: int, host: str | None = None) -> None:
    import json
    import socket

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / LOCK_FILE).write_text(json.dumps({"pid": pid, "host": host or socket.gethostname(),
                                                 "started": "2026-12-01T00:00:00Z"}))


def test_item2_a_live_run_holds_its_directory_and_a_second_one_writes_nothing(tmp_path, capsys):
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


def test_item2_a_killed_runs_stale_lock_is_taken_over_with_a_warning(tmp_path, capsys):
    dead = subprocess.Popen(["true"])
    dead.wait()
    _lock(tmp_path, dead.pid)
    train(config(tmp_path, steps=2))
    err = capsys.readouterr().err
    assert f"warning: {tmp_path / LOCK_FILE} was left by process {dead.pid}, which is no longer running" in err
    assert complete_steps(tmp_path) == [2] and not (tmp_path / LOCK_FILE).exists()  # released at the end


@pytest.mark.slow
def test_item2_two_real_runs_on_one_directory(tmp_path, capsys):
    """A run in another process holds the directory; a second refuses; once the first is SIGKILLed
    its lock is stale and a third run takes over and resumes from its checkpoints."""
    command = [sys.executable, "-m", "meshtrain.train", "--host-devices", "8", "--config", TINY,
               *overrides(tmp_path, "checkpoint.every=1", steps=10_000)]
    first = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not complete_steps_or_empty(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert complete_steps_or_empty(tmp_path), "the first run never saved"
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


def test_item10_two_signals_coalesced_before_the_handler_runs_still_abort(capsys):
    """Python runs one handler for signals that arrive before it gets to run (a second SIGTERM 50 ms
    after the first, during a long device call); the wakeup fd still holds one byte per delivery."""
    import os
    import signal

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


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """A 2-step run saving after each step: checkpoints 1 and 2, and its losses."""
    run_dir = tmp_path_factory.mktemp("two-checkpoints")
    train(config(run_dir, "checkpoint.every=1", steps=2))
    return run_dir, {r["step"]: r["loss"] for r in records(run_dir)}


def _flip_array_byte(step_dir):
    data = max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    with data.open("r+b") as f:
        f.seek(data.stat().st_size // 2)
        byte = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([byte ^ 0x10]))


def _recorded_checksum_differs(step_dir):
    """The values no longer match what was recorded at save (as after a flipped bit that still
    decodes): deterministic, unlike a flipped byte of compressed data, which the decoder may catch
    first."""
    import json

    path = step_dir / "meta" / "metadata"
    meta = json.loads(path.read_text())
    name = sorted(meta["checksums"])[0]
    path.write_text(json.dumps({**meta, "checksums": {**meta["checksums"], name: meta["checksums"][name] ^ 1}}))


def _meta_config_not_a_mapping(step_dir):
    import json

    path = step_dir / "meta" / "metadata"
    meta = json.loads(path.read_text())
    path.write_text(json.dumps({**meta, "config": "not a mapping"}))


def _meta_without_checksums(step_dir):
    import json

    path = step_dir / "meta" / "metadata"
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "checksums"}))


def _meta_checksums_not_a_mapping(step_dir):
    import json

    path = step_dir / "meta" / "metadata"
    path.write_text(json.dumps({**json.loads(path.read_text()), "checksums": [1, 2]}))


def _another_steps_files(step_dir):
    """Step 1's checkpoint files under step 2's directory name (issue 38 item 3)."""
    import shutil

    shutil.rmtree(step_dir)
    shutil.copytree(step_dir.parent / "1", step_dir)


def _meta_without_mesh(step_dir):
    import json

    path = step_dir / "meta" / "metadata"
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "mesh"}))


@pytest.mark.parametrize("damage, reason", [
    (_flip_array_byte, ""),  # item 3: the decoder or the checksum catches it, whichever first
    (_recorded_checksum_differs, "does not match the checksum recorded when it was saved"),  # item 3
    (_meta_config_not_a_mapping, "holds no config with a model section"),  # item 5
    (_meta_without_mesh, "holds no mesh"),  # item 5
    (lambda step_dir: (step_dir / "state" / "_METADATA").unlink(), "holds no array metadata"),  # item 5
    (_meta_checksums_not_a_mapping, "checksums are not a mapping"),  # issue 38 item 13
    (_meta_without_checksums, "has lost its checksums"),  # issue 38 item 13
    (_another_steps_files, "its directory says step 2 but its state is step 1's"),  # issue 38 item 3
], ids=["flipped-array-byte", "checksum-mismatch", "meta-config-not-a-mapping", "meta-without-mesh",
        "state-metadata-deleted", "meta-checksums-not-a-mapping", "meta-without-checksums", "another-steps-files"])
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_items3_5_damaged_checkpoints_are_unreadable_and_fall_back(two_checkpoints, tmp_path, capsys, damage,
                                                                   reason):
    import shutil

    source, expected = two_checkpoints
    shutil.copytree(source, tmp_path, dirs_exist_ok=True)
    (tmp_path / "metrics.jsonl").unlink()
    damage(tmp_path / CHECKPOINT_DIR / "2")
    train(config(tmp_path, "checkpoint.every=1", steps=3))
    err = capsys.readouterr().err
    assert f"checkpoint {tmp_path / CHECKPOINT_DIR / '2'} is unreadable (" in err and reason in err, err
    assert "trying step 1" in err and "resumed from" in err and f"{CHECKPOINT_DIR}/1 (step 1" in err
    assert (tmp_path / CHECKPOINT_DIR / "2.unreadable").is_dir()  # kept, not deleted
    redone = {r["step"]: r["loss"] for r in records(tmp_path)}
    assert redone[2] == expected[2]  # step 2 redone from the good step-1 state: the same loss


def test_item16_print_sharding_into_a_closed_pipe_is_quiet(monkeypatch, capsys):
    import os

    read, write = os.pipe()
    os.close(read)  # the reader (`head`) is gone
    stdout = os.fdopen(write, "w")
    monkeypatch.setattr(sys, "stdout", stdout)
    assert main(["--config", TINY, "--print-config"]) == 0
    assert "BrokenPipeError" not in capsys.readouterr().err
    stdout.close()


def test_item16_tools_do_not_warn_that_read_only_checkpoints_are_read_only(two_checkpoints, tmp_path, capsys):
    from meshtrain.export import export

    export(str(two_checkpoints[0]), str(tmp_path / "export"))
    err = capsys.readouterr().err
    assert "read only" not in err and "read_only" not in err, err


def test_item16_one_device_is_available():
    import jax

    from meshtrain.errors import ConfigError
    from meshtrain.mesh import MeshConfig, make_mesh

    with pytest.raises(ConfigError, match="but 1 is available; make the product 1"):
        make_mesh(MeshConfig(data=2, fsdp=1), jax.devices()[:1])


def test_item15_readme_states_the_size_it_has():
    import re

    readme = (REPO / "README.md").read_text()
    stated = int(re.search(r"\(`meshtrain/`\) is about ([\d,]+) lines", readme).group(1).replace(",", ""))
    actual = sum(len(p.read_text().splitlines()) for p in (REPO / "meshtrain").rglob("*.py"))
    assert abs(stated - actual) / actual < 0.1, (stated, actual)
    assert "source .venv/bin/activate" in readme  # the commands shown run in the environment make creates


def _hostile_inputs(root):
    """(name, argv of meshtrain.train or ("convert", argv)) for the hostile-input test; files under root."""
    import json
    import os

    def write(name, content):
        path = root / name
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
        return str(path)

    laughs = "".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, 8))
    bomb = write("bomb.yaml", "l0: &l0 [x, x, x, x, x, x, x, x, x]\n" + laughs + "model: {remat_names: *l7}\n")
    digits = "1" * 5000
    a_file = write("a_file", "x")
    loop = root / "loop"
    os.symlink(loop, loop)
    os.symlink(root / "nowhere", root / "broken.npy")
    os.mkfifo(root / "fifo.npy")
    np.save(root / "good.npy", np.arange(1000, dtype=np.int32))
    good = (root / "good.npy").read_bytes()
    np.save(root / "pickled.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    np.save(root / "float2d.npy", np.zeros((4, 4), np.float32))
    tokens = ["data.source=tokens", "data.path="]
    cases = {
        "alias-bomb": ["--config", bomb],
        "deep-nesting": ["--config", write("deep.yaml", "a: " + "[" * 20000 + "]" * 20000)],
        "duplicate-keys": ["--config", write("dup.yaml", "train: {steps: 3}\ntrain: {steps: 4}\n")],
        "binary-config": ["--config", write("binary.yaml", bytes(range(256)))],
        "huge-int-in-file": ["--config", write("bigint.yaml", f"train: {{steps: {digits}}}\n")],
        "huge-int-override": ["--config", TINY, f"train.steps={digits}"],
        "seed-2**70": ["--config", TINY, f"train.seed={2 ** 70}"],
        "batch-2**70": ["--config", TINY, f"train.batch_size={2 ** 70}"],
        "vocab-2**64": ["--config", TINY, f"model.vocab_size={2 ** 64}"],
        "negative-layers": ["--config", TINY, "model.num_layers=-1"],
        "zero-seq-len": ["--config", TINY, "model.seq_len=0"],
        "run-dir-is-a-file": ["--config", TINY, f"run.dir={a_file}"],
        "run-dir-under-a-file": ["--config", TINY, f"run.dir={a_file}/run"],
        "run-dir-in-proc": ["--config", TINY, "run.dir=/proc/meshtrain-run"],
        "run-dir-name-too-long": ["--config", TINY, f"run.dir={root / ('r' * 300)}"],
        "host-devices-100000": ["--host-devices", "100000", "--config", TINY],
        "data-path-directory": ["--config", TINY, *tokens[:1], f"data.path={root}"],
        "data-path-fifo": ["--config", TINY, *tokens[:1], f"data.path={root / 'fifo.npy'}"],
        "data-path-symlink-loop": ["--config", TINY, *tokens[:1], f"data.path={loop}"],
        "data-path-broken-link": ["--config", TINY, *tokens[:1], f"data.path={root / 'broken.npy'}"],
        "npy-truncated": ["--config", TINY, *tokens[:1], f"data.path={write('trunc.npy', good[:200])}"],
        "npy-header-only": ["--config", TINY, *tokens[:1], f"data.path={write('header.npy', good[:128])}"],
        "npy-random": ["--config", TINY, *tokens[:1],
                       f"data.path={write('random.npy', np.random.default_rng(0).bytes(999))}"],
        "npy-pickled": ["--config", TINY, *tokens[:1], f"data.path={root / 'pickled.npy'}"],
        "npy-float-2d": ["--config", TINY, *tokens[:1], f"data.path={root / 'float2d.npy'}"],
        "bin-odd-size": ["--config", TINY, *tokens[:1], "data.token_dtype=uint16",
                         f"data.path={write('odd.bin', b'abc')}"],
        "nan-learning-rate": ["--config", TINY, "optimizer.learning_rate=.nan"],
        "unknown-family": ["--config", TINY, "model.family=nope"],
        "missing-plugin": ["--config", TINY, "model.plugin=no.such.plugin"],
        "rule-for-unknown-axis": ["--config", TINY, "sharding.rules.nope={params: fsdp}"],
        "mesh-product": ["--config", TINY, "mesh.data=3"],
        "missing-config": ["--config", str(root / "missing.yaml")],
        "config-is-a-directory": ["--config", str(root)],
        "yaml-syntax": ["--config", write("syntax.yaml", "mesh: {data: 2\n  bad: [\n")],
        "override-without-value": ["--config", TINY, "train.steps"],
        "unknown-flag": ["--config", TINY, "--bogus"],
        "bad-enum": ["--config", TINY, "train.precision=fp4"],
        "string-for-a-list": ["--config", TINY, "model.remat_names=attention"],
    }
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 64,
              "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "max_position_embeddings": 64}
    from safetensors.numpy import save_file

    def hf_dir(name, *, index=None, config_text=None):
        path = root / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config) if config_text is None else config_text)
        save_file({"model.norm.weight": np.ones(64, np.float32)}, str(path / "model-00001-of-00001.safetensors"))
        if index is not None:
            (path / "model.safetensors.index.json").write_text(json.dumps(index))
        return ["from-hf", "--hf", str(path), "--out", str(root / f"{name}-out")]

    cases |= {
        "hf-index-is-a-list": ("convert", hf_dir("hf_list", index=[1, 2])),
        "hf-weight-map-is-a-list": ("convert", hf_dir("hf_map_list", index={"weight_map": ["a"]})),
        "hf-index-names-a-missing-tensor": ("convert", hf_dir(
            "hf_missing", index={"weight_map": {"lm_head.weight": "model-00001-of-00001.safetensors"}})),
        "hf-config-not-json": ("convert", hf_dir("hf_bad_json", index={}, config_text="{not json")),
        "hf-unknown-model-type": ("convert", hf_dir("hf_type", index={}, config_text=json.dumps(
            {**config, "model_type": "gpt-neox"}))),
    }
    return cases


def test_hostile_inputs_are_each_one_line_exit_2_and_quick(tmp_path, capsys):
    from meshtrain import convert

    cases = _hostile_inputs(tmp_path)
    assert len(cases) >= 40
    failures = []
    for name, argv in cases.items():
        start = time.monotonic()
        tool, argv = (convert.main, argv[1]) if isinstance(argv, tuple) else (main, argv)
        code = tool(argv)
        seconds = time.monotonic() - start
        out = capsys.readouterr()
        lines = out.err.splitlines()
        if not (code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in out.err
                and seconds < 60):
            failures.append((name, code, round(seconds, 1), out.err[-300:]))
    assert failures == []


def test_item8_a_token_file_truncated_while_training_saves_and_stops_in_one_line(tmp_path, monkeypatch, capsys):
    """A memory-mapped file that shrinks would kill the run with SIGBUS on the next read."""
    from meshtrain import loop

    data = tmp_path / "tokens.bin"
    np.random.default_rng(0).integers(0, 128, 50_000).astype(np.uint16).tofile(data)
    real_batch = loop.global_batch

    def truncate_before_step_3(dataset, step, *args):
        if step == 3:
            with data.open("r+b") as f:
                f.truncate(64)
        return real_batch(dataset, step, *args)

    monkeypatch.setattr(loop, "global_batch", truncate_before_step_3)
    run_dir = tmp_path / "run"
    code = main(["--config", TINY, *overrides(run_dir, "data.source=tokens", f"data.path={data}",
                                              "data.token_dtype=uint16", "checkpoint.every=0", steps=6)])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert code == 2 and len(err) == 1, err
    assert f"error: data.path: {data} changed while training (100000 -> 64 bytes); the state after step 3 " \
           f"was saved to {run_dir / CHECKPOINT_DIR / '3'}" in err[0]
    assert complete_steps(run_dir) == [3]


def test_item14_pipeline_verdicts_are_marked_and_verify_overrules(capsys):
    """meshtrain.plan ranked pipeline layouts as "fits" that its own --verify measured at several times
    the estimate: they are marked, and the compiled verdict is printed beside the estimate."""
    from meshtrain import plan as planner
    from meshtrain.config import load_config

    plan = planner.make_plan(load_config(TINY), 8, 80e9, meshes=[(1, 4, 1, 2), (2, 2, 2, 1)], zero_stages=[3],
                             remats=[planner.RematPolicy.FULL])
    text = planner.format_plan(plan, top=10, show_infeasible=0)
    rows = {line.split()[1]: line for line in text.splitlines() if line.strip()[:1].isdigit()}
    assert rows["(1,4,1,2)"].rstrip().endswith("fits?") and rows["(2,2,2,1)"].rstrip().endswith("fits")
    assert "fits? = pipeline temp memory is estimated within" in text and "--verify" in text
    est = next(e for e in plan.estimates if e.candidate.stage == 2)
    measured = {"argument": 1e9, "output": 1e9, "temp": 90e9, "seconds": 1.0}  # what XLA could report
    assert planner.verified_verdict(measured, 80e9) == "does not fit: XLA needs 91 GB"
    assert "does not fit: XLA needs 91 GB" in planner.format_verify([(est, measured)], 8, 80e9)


def test_item14_the_plan_cli_plans_a_plugin_family(capsys):
    from meshtrain import plan as planner

    toy = str(REPO / "tests" / "toy_gpt.yaml")
    assert planner.main(["--config", toy, "--devices", "8", "--device-memory", "1GB", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("model: toy_gpt, ") and "fits" in out


def test_item7_a_full_disk_stops_with_one_line_before_writing_and_keeps_earlier_checkpoints(tmp_path, monkeypatch,
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


@pytest.mark.parametrize("pid", ["own", 10 ** 30], ids=["own-pid-after-a-container-restart", "pid-out-of-range"])
def test_issue38_items4_11_locks_no_live_process_can_hold_are_taken_over(tmp_path, capsys, pid):
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


# --- issue 38 items 5, 6, 9: HF imports, file names inside indexes, JSON nesting ----------------------

def _tiny_hf(path, *, config=None, edit=None, model=()):
    """An HF directory (config.json, model.safetensors) of the Llama that TINY runs here train
    (``overrides()``: embed_dim 32; ``model``: more ``model.*`` overrides), every weight 0.02 and every
    norm 1, written without transformers. ``config``: keys to set in config.json; ``edit(tensors)``:
    changes the tensors before they are saved."""
    import json

    from safetensors.numpy import save_file

    from meshtrain.weights import hf
    from meshtrain.config import load_config
    from meshtrain.parallel.layout import abstract_model
    from models.api import family_of

    cfg = load_config(TINY, ["model.embed_dim=32", *model]).model
    _, abstract = abstract_model(cfg)
    tensors = {name: np.full(tensor_map.hf_shape, 1.0 if "norm" in name else 0.02, np.float32)
               for tensor_map in hf.tensor_maps(family_of(cfg).hf, cfg, abstract)
               for name in tensor_map.hf_tensors(cfg.num_layers)}
    if edit is not None:
        edit(tensors)
    path.mkdir(parents=True)
    (path / hf.CONFIG_FILE).write_text(json.dumps({**hf.hf_config(cfg, dtype="float32"), **(config or {})}))
    save_file(tensors, str(path / hf.SINGLE_FILE), metadata={"format": "pt"})
    return path


def _from_hf(source, out, capsys) -> str:
    """``convert from-hf`` of ``source`` into ``out``: its stderr, once exit 2 and nothing written are checked."""
    from meshtrain import convert

    assert convert.main(["from-hf", "--hf", str(source), "--out", str(out)]) == 2
    assert not out.exists()
    return capsys.readouterr().err


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}


@pytest.mark.parametrize("change, key, shown", [
    ({"rope_theta": math.nan}, "rope_theta", "nan"),
    ({"rms_norm_eps": math.inf}, "rms_norm_eps", "inf"),
    ({"initializer_range": -math.inf}, "initializer_range", "-inf"),  # a key meshtrain does not read
    ({"rope_scaling": {**LLAMA3, "factor": math.nan}}, "rope_scaling.factor", "nan"),
], ids=["rope_theta-NaN", "rms_norm_eps-Infinity", "unread-key--Infinity", "nested-NaN"])
def test_issue38_item5_non_finite_numbers_in_config_json_are_one_line_errors_naming_the_key(tmp_path, capsys,
                                                                                            change, key, shown):
    """Python's json reads NaN and Infinity (json.dumps writes them so); an import took them as the
    model's rope_theta / norm_eps."""
    source = _tiny_hf(tmp_path / "hf", config=change)
    assert "NaN" in (source / "config.json").read_text() or "Infinity" in (source / "config.json").read_text()
    assert _from_hf(source, tmp_path / "out", capsys) == (f"error: config.json:{key}: must be a finite number, "
                                                          f"got {shown}\n")


def test_issue38_item5_a_number_too_large_for_a_float_in_config_json_is_refused(tmp_path, capsys):
    source = _tiny_hf(tmp_path / "hf", config={"rope_theta": 12345.5})
    config = source / "config.json"
    config.write_text(config.read_text().replace("12345.5", "1e999"))  # Python's json reads it as inf
    expected = "error: config.json:rope_theta: must be a finite number, got inf\n"
    assert _from_hf(source, tmp_path / "out", capsys) == expected


@pytest.mark.usefixtures("no_compile")
def test_issue38_item5_a_non_finite_config_json_stops_a_fine_tune_before_it_compiles(tmp_path, capsys):
    source = _tiny_hf(tmp_path / "hf", config={"rms_norm_eps": math.nan})
    assert main(["--config", TINY, *overrides(tmp_path / "run", f"checkpoint.init_from=hf:{source}")]) == 2
    assert capsys.readouterr().err == (f"error: checkpoint.init_from: {source}: config.json:rms_norm_eps: must be a "
                                       "finite number, got nan\n")


@pytest.mark.parametrize("dtype, shown", [(np.int32, "int32"), (np.int64, "int64"), (np.uint8, "uint8"),
                                          (np.bool_, "bool")])
def test_issue38_item5_integer_and_bool_weights_are_one_line_errors_naming_the_tensor(tmp_path, capsys, dtype, shown):
    """They were cast to float without a word (a quantized checkpoint's int8 weights became numbers ~100)."""
    name = "model.layers.1.mlp.down_proj.weight"
    source = _tiny_hf(tmp_path / "hf", edit=lambda tensors: tensors.update({name: tensors[name].astype(dtype)}))
    assert _from_hf(source, tmp_path / "out", capsys) == (
        f"error: --hf: tensor {name} in {source} is {shown}, not floating point; weights must be float32, bfloat16 "
        "or float16 (quantized checkpoints are not supported)\n")


def _poison(name, value, dtype=np.float32):
    def edit(tensors):
        tensors[name] = tensors[name].astype(dtype)
        tensors[name][3, 5] = value
    return edit


@pytest.mark.parametrize("value, dtype", [(math.nan, np.float32), (math.inf, np.float16), (-math.inf, np.float32)],
                         ids=["nan-f32", "inf-f16", "-inf-f32"])
def test_issue38_item5_nan_or_infinite_weights_are_one_line_errors_naming_the_tensor(tmp_path, capsys, value, dtype):
    name = "model.layers.1.self_attn.k_proj.weight"
    source = _tiny_hf(tmp_path / "hf", edit=_poison(name, value, dtype))
    err = _from_hf(source, tmp_path / "out", capsys)
    assert err.count("\n") == 1 and err.startswith(f"error: --hf: tensor {name} in {source} holds NaN or infinite "
                                                   "values (1 of the "), err
    assert err.endswith(" read); the checkpoint is damaged, and no model can be trained or run from it\n"), err


def test_issue38_item5_a_fine_tune_from_nan_weights_is_refused_at_import_not_blamed_on_the_optimizer(tmp_path,
                                                                                                     capsys):
    name = "model.embed_tokens.weight"
    source = _tiny_hf(tmp_path / "hf", edit=_poison(name, math.nan))
    run_dir = tmp_path / "run"
    assert main(["--config", TINY, *overrides(run_dir, f"checkpoint.init_from=hf:{source}", steps=2)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert len(err) == 1 and err[0].startswith(f"error: checkpoint.init_from: tensor {name} in {source} holds NaN "
                                               "or infinite values (1 of the "), err
    assert complete_steps(run_dir) == [] and not (run_dir / "metrics.jsonl").exists()


@pytest.mark.parametrize("where", ["../good/model.safetensors", "{good}/model.safetensors", "sub/model.safetensors",
                                   ".."], ids=["dot-dot", "absolute", "subdirectory", "parent"])
def test_issue38_item6_an_hf_weight_map_naming_a_file_outside_its_directory_is_refused(tmp_path, capsys, where):
    import json
    import shutil

    from meshtrain.weights import hf

    good = _tiny_hf(tmp_path / "good")
    where = where.format(good=good)
    bad = tmp_path / "bad"
    (bad / "sub").mkdir(parents=True)
    shutil.copy(good / hf.CONFIG_FILE, bad / hf.CONFIG_FILE)
    shutil.copy(good / hf.SINGLE_FILE, bad / "sub" / hf.SINGLE_FILE)
    names = json.loads((good / hf.SINGLE_FILE).read_bytes()[8:8 + int.from_bytes(
        (good / hf.SINGLE_FILE).read_bytes()[:8], "little")])  # the safetensors header: every tensor
    names = ["model.embed_tokens.weight", *sorted(set(names) - {"__metadata__", "model.embed_tokens.weight"})]
    (bad / hf.INDEX_FILE).write_text(json.dumps({"weight_map": dict.fromkeys(names, where)}))
    assert _from_hf(bad, tmp_path / "out", capsys) == (
        f"error: --hf: {bad / hf.INDEX_FILE}: weight_map puts model.embed_tokens.weight in {where!r}, which is not "
        f"a plain file name; shards must be files in {bad} (no directory part, not . or ..)\n")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A prepared corpus (one train shard) and its byte-level BPE of 260 ids."""
    from meshtrain.data.corpus import prepare
    from meshtrain.data.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("prepared")
    documents = [f"document {i}: the cat sat on the mat " * (i + 1) for i in range(20)]
    for i, text in enumerate(documents):
        (root / f"doc-{i:02d}.txt").write_text(text)
    tokenizer = train_bpe(documents, 260, root / "tokenizer")
    prepare([str(root / "doc-*.txt")], str(tokenizer), str(root / "good"), progress=False)
    return {"root": root, "tokenizer": tokenizer, "good": root / "good"}


@pytest.mark.usefixtures("no_compile")
@pytest.mark.parametrize("what, key", [("train shard", "shards"), ("tokenizer", "tokenizer")])
def test_issue38_item6_a_prepared_index_naming_a_file_outside_its_directory_is_refused(prepared, tmp_path, capsys,
                                                                                        what, key):
    import json
    import shutil

    from meshtrain.data.prepared import INDEX_FILE

    good = prepared["good"]
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    index = json.loads((bad / INDEX_FILE).read_text())
    outside = f"../../{good.parent.name}/good/{'train-00000.bin' if key == 'shards' else 'tokenizer.json'}"
    assert (bad / outside).is_file()  # it would be read
    if key == "shards":
        index["splits"]["train"]["shards"][0]["file"] = outside
    else:
        index["tokenizer"]["file"] = outside
    (bad / INDEX_FILE).write_text(json.dumps(index))
    argv = ["--config", TINY, *overrides(tmp_path / "run", "data.source=tokens", f"data.path={bad}",
                                         "model.vocab_size=512")]
    assert main(argv) == 2
    assert capsys.readouterr().err == (f"error: data.path: {bad / INDEX_FILE} names {what} file {outside!r}, which is "
                                       "not a plain file name in its directory (no directory part, not . or ..); "
                                       "prepare the corpus again\n")


DEEP = "[" * 100_000 + "]" * 100_000  # a RecursionError in Python's json


@pytest.mark.usefixtures("no_compile")
def test_issue38_item9_deeply_nested_json_is_one_line_in_every_reader(prepared, tmp_path, capsys):
    """Every JSON file a user hands in: a jsonl line (prepare, train-tokenizer), a prepared
    index.json, pipeline.table, an HF config.json and its safetensors index, an export's meshtrain.json."""
    from meshtrain import convert
    from meshtrain.weights import hf
    from meshtrain.weights.export_format import EXPORT_META, PARAMS_DIR
    from meshtrain.data import __main__ as data_cli
    from meshtrain.data.prepared import INDEX_FILE

    jsonl = tmp_path / "deep.jsonl"
    jsonl.write_text('{"text": "one fine document"}\n' + DEEP + "\n")
    index_dir = tmp_path / "prepared"
    index_dir.mkdir()
    (index_dir / INDEX_FILE).write_text(DEEP)
    table = tmp_path / "table.json"
    table.write_text(DEEP)
    config_dir = _tiny_hf(tmp_path / "hf_config")
    (config_dir / hf.CONFIG_FILE).write_text(DEEP)
    index_hf = _tiny_hf(tmp_path / "hf_index")
    (index_hf / hf.INDEX_FILE).write_text(DEEP)
    export = tmp_path / "export"
    (export / PARAMS_DIR).mkdir(parents=True)
    (export / EXPORT_META).write_text(DEEP)
    bounded = "nested more than 64 levels deep"
    pipeline = ["mesh.data=1", "mesh.stage=2", "model.num_layers=4", "train.batch_size=16", "pipeline.schedule=custom"]
    cases = [
        (data_cli.main, ["prepare", "--tokenizer", str(prepared["tokenizer"]), "--input", str(jsonl), "--out",
                         str(tmp_path / "out1"), "--no-progress"],
         f"error: --input: {jsonl}:2 is not a line of JSON (nested too deeply for Python to parse)"),
        (data_cli.main, ["train-tokenizer", "--input", str(jsonl), "--vocab-size", "260", "--out",
                         str(tmp_path / "out2")],
         f"error: --input: {jsonl}:2 is not a line of JSON (nested too deeply for Python to parse)"),
        (main, ["--config", TINY, *overrides(tmp_path / "run1", "data.source=tokens", f"data.path={index_dir}")],
         f"error: data.path: {index_dir / INDEX_FILE} is not JSON ({bounded}); prepare the corpus again"),
        (main, ["--config", TINY, *pipeline, f"pipeline.table={table}"],
         "error: pipeline.table: must be a JSON schedule table {stages, chunks, microbatches, ticks: [[{work: "
         f"F|B|I|W, tasks: [[microbatch, chunk] or null per stage]}}]]}}: ValueError: {bounded}"),
        (convert.main, ["from-hf", "--hf", str(config_dir), "--out", str(tmp_path / "out3")],
         f"error: --hf: {config_dir / hf.CONFIG_FILE} is not valid JSON: {bounded}"),
        (convert.main, ["from-hf", "--hf", str(index_hf), "--out", str(tmp_path / "out4")],
         f"error: --hf: {index_hf / hf.INDEX_FILE} is not a safetensors index (ValueError: {bounded}); expected "
         '{"weight_map": {tensor: file}}'),
        (convert.main, ["to-hf", "--from", str(export), "--out", str(tmp_path / "out5")],
         f"error: --from: cannot read {export / EXPORT_META}: {bounded}"),
    ]
    for tool, argv, expected in cases:
        assert (tool(argv), capsys.readouterr().err) == (2, expected + "\n"), argv


def test_issue38_item9_json_files_are_bounded_like_the_yaml_config_and_jsonl_lines_are_not():
    from meshtrain import jsonio

    assert jsonio.loads("[" * 64 + "]" * 64) is not None
    with pytest.raises(ValueError, match=r"^nested more than 64 levels deep$"):
        jsonio.loads('{"a": ' + "[" * 64 + "]" * 64 + "}")
    assert jsonio.loads('{"text": "x", "meta": ' + "[" * 200 + "]" * 200 + "}", max_depth=None)["text"] == "x"
    with pytest.raises(ValueError, match=r"^nested too deeply for Python to parse$"):
        jsonio.loads(DEEP.encode(), max_depth=None)


def test_issue38_item8_a_second_prepare_into_a_running_ones_out_refuses_and_removes_nothing(prepared, tmp_path,
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
    command = ["prepare", "--tokenizer", str(prepared["tokenizer"]), "--input", str(prepared["root"] / "doc-*.txt"),
               "--out", str(out)]
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


@pytest.mark.parametrize("overrides, field, hint", [
    (["data.mixture=[{path: a, weight: 1.0e+308}, {path: b, weight: 1.0e+308}]"], "data.mixture", "sum to inf"),
    (["data.mixture=[{path: a, weight: 5.0e-324}, {path: b, weight: 1}]"], "data.mixture[0].weight", "underflows"),
], ids=["sum-overflows", "share-underflows"])
def test_issue38_item11_mixture_weights_whose_sum_or_share_is_not_a_float_are_one_line(overrides, field, hint):
    from meshtrain.config import load_config

    with pytest.raises(ConfigError) as info:
        load_config(None, ["data.source=tokens", *overrides])
    assert info.value.field == field and hint in info.value.message, info.value


@pytest.mark.parametrize("stages", ["Infinity", "1e400", "2.5", "true", "-1"])
def test_issue38_item11_a_pipeline_table_with_a_non_integer_count_is_one_line(tmp_path, stages):
    from meshtrain.parallel.schedules import ScheduleTable, gpipe

    text = gpipe(2, 2).to_json().replace('"stages": 2', f'"stages": {stages}', 1)
    assert f'"stages": {stages}' in text
    with pytest.raises(ConfigError) as info:
        ScheduleTable.from_json(text)
    assert info.value.field == "pipeline.table" and "is not an integer >= 0" in info.value.message


@pytest.mark.parametrize("size", [str(2 ** 32 + 1), str(2 ** 31)])
def test_issue38_item11_a_vocabulary_the_tokenizers_library_cannot_train_is_one_line(tmp_path, capsys, size):
    from meshtrain.data.__main__ import main as data_main

    (tmp_path / "a.txt").write_text("some text " * 20)
    assert data_main(["train-tokenizer", "--input", str(tmp_path / "a.txt"), "--vocab-size", size,
                      "--out", str(tmp_path / "tok")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --vocab-size: must be at most 2,147,483,647 (2**31 - 1), got {int(size):,}"], err
    assert not (tmp_path / "tok").exists()


@pytest.mark.usefixtures("no_compile")
@pytest.mark.parametrize("forged", [False, True], ids=["damaged-shard-byte", "forged-index"])
def test_issue38_item2_a_prepared_corpus_with_ids_outside_the_vocabulary_stops_before_training(
        prepared, tmp_path, capsys, forged):
    """A shard byte changed to an id beyond the vocabulary: its SHA-256 no longer matches index.json;
    with the index forged to match, the id itself is found (one pass at start-up, before compiling).
    Either way one line naming data.path and the shard, exit 2."""
    import json
    import shutil

    from meshtrain.data.tokenizer import file_sha256

    corpus = tmp_path / "corpus"
    shutil.copytree(prepared["good"], corpus)
    shard = corpus / "train-00000.bin"
    ids = np.fromfile(shard, np.uint16)
    ids[5] = 60000
    ids.tofile(shard)
    if forged:
        index = json.loads((corpus / "index.json").read_text())
        index["splits"]["train"]["shards"][0]["sha256"] = file_sha256(shard)
        (corpus / "index.json").write_text(json.dumps(index))
    rc = main(["--config", TINY, *overrides(tmp_path / "run"), "data.source=tokens", f"data.path={corpus}",
               "model.vocab_size=300"])
    err = capsys.readouterr().err.strip().splitlines()
    expected = (f"error: data.path: {shard}: token id 60000 is not below the vocabulary size 300; the corpus is "
                "damaged or its index.json forged: prepare it again") if forged else \
        f"error: data.path: {shard}: SHA-256 differs from index.json; the shard changed"
    assert rc == 2 and err == [expected], err


# --- issue 38 item 12: shapes that cannot fit stop before anything is allocated ------------------------

@pytest.mark.usefixtures("no_compile")
@pytest.mark.parametrize("override", ["model.seq_len=2147483648", "model.num_layers=1000000000"],
                         ids=["seq_len-2**31", "num_layers-1e9"])
def test_issue38_item12_a_run_far_beyond_the_device_memory_is_one_line_before_allocating(tmp_path, capsys, override):
    """meshtrain.plan's estimate of the run's own layout against the device memory (host RAM over the
    simulated devices here): more than 4x over is refused before anything is allocated or compiled
    (``no_compile``; the OOM killer took 62 s)."""
    assert main(["--config", TINY, *overrides(tmp_path / "run"), override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: model: this run needs about ") and "per device" in err[0], err
    assert "python -m meshtrain.plan" in err[0]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_issue38_item12_a_kv_cache_beyond_the_device_memory_is_one_line(tmp_path):
    """``generate_tokens`` (what ``meshtrain.generate --max-new-tokens`` calls) sizes the KV cache
    from the prefill's abstract shapes before allocating anything (here 10**9 new tokens)."""
    import jax

    from meshtrain.generate import generate_tokens
    from meshtrain.weights.loading import load_model
    from meshtrain.mesh import MeshConfig, make_mesh
    from meshtrain.parallel.rules import Preset

    mesh = make_mesh(MeshConfig(1, 1, 1, 1), jax.devices()[:1])
    model = load_model(_tiny_hf(tmp_path / "hf"), mesh, Preset.FSDP_TP.rules, field="--hf")
    with pytest.raises(ConfigError) as info:
        generate_tokens(model.graphdef, model.params, np.zeros((1, 2), np.int32), 10 ** 9)
    assert info.value.field == "--max-new-tokens"
    assert info.value.message.startswith("a KV cache of 1,000,000,002 positions needs ") and "ask for fewer" in \
        info.value.message


def test_issue38_item12_plan_devices_are_capped(capsys):
    from meshtrain import plan

    assert plan.main(["--config", TINY, "--devices", str(10 ** 12), "--device-memory", "80GB"]) == 2
    assert capsys.readouterr().err.strip() == \
        "error: --devices: must be an integer in [1, 1,048,576], got 1,000,000,000,000"


# --- issue 38 item 10: the file system's refusals are one line, before the work --------------------------

def test_issue38_item10_outputs_under_a_file_are_one_line_before_any_work(prepared, tmp_path, capsys, monkeypatch):
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
    docs = str(prepared["root"] / "doc-*.txt")

    def no_training(*args, **kwargs):
        raise AssertionError("train-tokenizer trained before checking --out")

    monkeypatch.setattr(Tokenizer, "train_from_iterator", no_training)
    cases = [
        (data_main, ["prepare", "--tokenizer", str(prepared["tokenizer"]), "--input", docs, "--out", str(under)],
         f"error: --out: {under}: a parent of it is a file, not a directory"),
        (data_main, ["train-tokenizer", "--input", docs, "--vocab-size", "300", "--out", str(under)],
         f"error: --out: {under}: a parent of it is a file, not a directory"),
        (convert_main, ["to-hf", "--from", str(prepared["root"]), "--out", str(under)], None),
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


def test_issue38_item10_a_profile_directory_that_is_a_file_stops_before_the_first_step(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "profile").write_text("a file where the traces would go")
    assert main(["--config", TINY, *overrides(run_dir), "train.profile_steps=1-2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"error: train.profile_steps: {run_dir / 'profile'} is a file, not a directory", err
    assert not (run_dir / "metrics.jsonl").exists() or "loss" not in (run_dir / "metrics.jsonl").read_text()


# ----- round 4: planner, XLA flags, MoE -----

@pytest.mark.parametrize("config", ["moe_tiny.yaml", "deepseek_tiny.yaml"])
def test_issue53_item13_an_expert_block_beyond_a_steps_tokens_is_one_line(tmp_path, capsys, config):
    """``model.expert_block=1000000`` made XLA abort (a buffer of experts x block rows): a block larger
    than the tokens of one step (train.batch_size / train.grad_accum x model.seq_len; no expert's rows
    fill it) is refused before anything is built; the largest valid one is accepted."""
    argv = ["--config", str(REPO / "configs" / config), "--print-sharding", "model.dispatch=dropless",
            "train.batch_size=32", "train.grad_accum=2", "model.seq_len=64", f"run.dir={tmp_path / 'run'}"]
    assert main([*argv, "model.expert_block=1000000"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: model.expert_block: 1,000,000 rows per block is more than the 1,024 tokens of one step "
                   "(train.batch_size 32 / train.grad_accum 2 x model.seq_len 64), which no expert's rows can "
                   "fill; use 1 to 1,024, or 0 to choose from the rows"), err
    assert main([*argv, "model.expert_block=1024"]) == 0
    assert "error" not in capsys.readouterr().err

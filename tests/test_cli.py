"""The ``python -m meshtrain.train`` CLI: one-line errors for bad input, an end-to-end run, print flags.

Every bad-input case must fail before anything is compiled: ``Trainer.init_state`` (the first
jitted call of a run) is patched to fail the test if it is ever reached.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import yaml

from meshtrain.config import load_config
from meshtrain.train import main
from meshtrain.trainer import Trainer

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")
BAD_YAML = "mesh: {data: 2\n  bad: [\n"


def _case(overrides, field, *hints, config=TINY, flags=(), id):
    argv = [*flags, *(["--config", config] if config else []), *overrides]
    return pytest.param(argv, field, hints, id=id)


# (argv, field named after "error: ", fragments of the hint the message gives)
BAD_INPUTS = [
    _case(["train.stepz=3"], "train.stepz", "unknown field", "did you mean 'steps'", id="unknown-key"),
    _case(["trian.steps=3"], "trian", "unknown section", "did you mean 'train'", id="section-typo"),
    _case(["train.steps=abc"], "train.steps", "expected int", "'abc'", id="wrong-type"),
    _case(["train.steps=true"], "train.steps", "expected int", "True", id="bool-for-int"),
    _case(["data.mixture={a: 1}"], "data.mixture", "expected a list, got the mapping", id="mapping-for-list"),
    _case(["optimizer.learning_rate=abc"], "optimizer.learning_rate", "expected float",
          id="wrong-type-float"),
    _case(["mesh.data=3", "mesh.fsdp=1"], "mesh", "6 devices", "8 are available", "-1",
          id="mesh-product"),
    _case(["mesh.data=-1", "mesh.fsdp=-1"], "mesh.fsdp", "only one mesh axis may be -1",
          id="two-fills"),
    _case(["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=8"], "mesh.tensor", "kv_heads",
          "does not divide", "[1, 2]", id="heads-vs-tensor"),
    _case(["train.batch_size=6"], "train.batch_size", "data-parallel size 4", id="batch-vs-dp"),
    _case(["train.batch_size=8", "train.grad_accum=4"], "train.batch_size",
          "train.grad_accum 4 = 16", id="batch-vs-dp-accum"),
    _case(["data.source=tokens", "data.path=/nonexistent.bin"], "data.path", "no such file",
          "/nonexistent.bin", id="missing-data-file"),
    _case(["train.steps=-5"], "train.steps", "must be a positive integer", id="negative-steps"),
    _case(["train.precision=fp4"], "train.precision", "'fp4' is not valid", "fp32 | bf16 | fp16 | fp8",
          id="unknown-precision"),
    _case([], "--config", "no such file", config="/nonexistent/run.yaml", id="missing-config"),
    _case([], "--config", "is not valid YAML", "line 2", config="BAD_YAML", id="invalid-yaml"),
    _case(["sharding.preset=zero3"], "sharding.preset", "'zero3' is not valid",
          "dp | fsdp | tp | fsdp_tp", id="unknown-preset"),
    _case(["sharding.rules.vocab={params: model, activations: null}"],
          "sharding.rules.vocab.params", "unknown mesh axes ['model']", "'tensor'",
          id="rule-unknown-mesh-axis"),
    _case(["sharding.rules.vocab={params: null, activation: tensor}"],
          "sharding.rules.vocab.activation", "did you mean 'activations'", id="rule-unknown-field"),
    _case(["sharding.rules.vocabb={params: null}"], "sharding.rules", "unknown logical axes",
          "'vocab'", id="rule-unknown-logical-axis"),
    _case(["model.num_kv_heads=3"], "model.num_kv_heads", "must divide num_heads=4",
          id="kv-heads-vs-heads"),
    _case(["model.remat=everything"], "model.remat", "none | full | dots | named",
          id="unknown-remat"),
    _case(["model.remat_names=attention"], "model.remat_names", "expected a list",
          "[attention]", id="string-for-list"),
    _case([], "--host-devices", "must be an integer in [1, 1024]", flags=("--host-devices", "0"),
          id="host-devices-0"),
    _case(["train.steps"], "train.steps", "section.field=value", id="override-without-equals"),
    _case(["train.steps=[1"], "train.steps", "cannot parse value", id="override-bad-yaml"),
    pytest.param(["--config", TINY, "sharding.rules.vocab={params: [tensor, tensor]}"],
                 "sharding.rules.vocab.params", ("tensor",), id="rule-repeats-mesh-axis"),
    _case([], "arguments", "invalid int value", flags=("--host-devices", "abc"), id="argparse-bad-int"),
    _case(["mesh.stage=4", "mesh.data=1", "mesh.fsdp=1"], "model.num_layers", "cannot be split into mesh.stage=4",
          id="stage-does-not-split-layers"),
]


@pytest.fixture
def no_compile(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("bad input reached Trainer.init_state (compilation) instead of failing early")

    monkeypatch.setattr(Trainer, "init_state", fail)


def _assert_one_line_error(rc: int, stderr: str, field: str, hints) -> None:
    assert rc == 2, stderr
    assert "Traceback" not in stderr
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].strip(), stderr
    assert lines[0].startswith(f"error: {field}: "), lines[0]
    for hint in hints:
        assert hint in lines[0], (hint, lines[0])


@pytest.mark.parametrize("argv, field, hints", BAD_INPUTS)
def test_bad_input_is_one_line_error(argv, field, hints, tmp_path, capsys, no_compile):
    if "BAD_YAML" in argv:
        bad = tmp_path / "bad.yaml"
        bad.write_text(BAD_YAML)
        argv = [str(bad) if arg == "BAD_YAML" else arg for arg in argv]
    rc = main(argv)
    _assert_one_line_error(rc, capsys.readouterr().err, field, hints)


@pytest.mark.parametrize("argv, field, hints", [
    (["--config", TINY, "train.stepz=3"], "train.stepz", ["did you mean 'steps'"]),
    (["--host-devices", "8", "--config", TINY, "mesh.data=3", "mesh.fsdp=1"], "mesh",
     ["8 are available"]),
], ids=["unknown-key", "mesh-product"])
def test_bad_input_subprocess(argv, field, hints):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "meshtrain.train", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    _assert_one_line_error(proc.returncode, proc.stderr, field, hints)
    assert proc.stdout == ""


def test_end_to_end_run(tmp_path):
    argv = ["--config", TINY, "train.steps=3", "train.log_every=1", f"run.dir={tmp_path}",
            "run.tensorboard=true"]
    assert main(argv) == 0

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == [1, 2, 3]
    for record in records:
        for key in ("step", "loss", "grad_norm", "lr", "tokens_per_sec", "step_time_s",
                    "tflops_per_device", "mfu"):
            assert key in record, (key, record)
        assert record["mfu"] is None  # no known peak on CPU
        assert record["loss"] > 0 and record["tokens_per_sec"] > 0
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    for name in ("summary.json", "loss.png", "config.yaml"):
        assert (tmp_path / name).is_file(), name
    assert load_config(tmp_path / "config.yaml") == load_config(TINY, argv[2:])


def test_print_sharding(capsys, no_compile):
    assert main(["--config", TINY, "--print-sharding"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[0] == "parameter"
    assert any(line.split()[0] == "layers.mlp.gate" for line in lines)
    assert lines[-1].split()[0] == "total"


def test_print_config_round_trips(tmp_path, capsys, no_compile):
    overrides = ["mesh.fsdp=-1", "mesh.data=1", "train.precision=bf16",
                 "sharding.rules.vocab={params: null, activations: tensor}",
                 "model.remat_names=[query, attention]"]
    assert main(["--config", TINY, "--print-config", *overrides]) == 0
    printed = capsys.readouterr().out
    assert isinstance(yaml.safe_load(printed), dict)
    (tmp_path / "printed.yaml").write_text(printed)
    assert load_config(tmp_path / "printed.yaml") == load_config(TINY, overrides)


def test_print_config_into_a_closed_pipe_is_quiet(monkeypatch, capsys):
    read, write = os.pipe()
    os.close(read)  # the reader (`head`) is gone
    stdout = os.fdopen(write, "w")
    monkeypatch.setattr(sys, "stdout", stdout)
    assert main(["--config", TINY, "--print-config"]) == 0
    assert "BrokenPipeError" not in capsys.readouterr().err
    stdout.close()


def test_overrides_may_stand_anywhere_among_the_flags():
    """``--config X a.b=1 --host-devices 8 c.d=2``, as MaxText users type them (a fresh process:
    --host-devices must come before JAX starts)."""
    result = subprocess.run(
        [sys.executable, "-m", "meshtrain.train", "--config", TINY, "train.steps=7", "--host-devices", "8",
         "model.embed_dim=32", "--print-config", "optimizer.eps=1e-6"],
        cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)
    assert (printed["train"]["steps"], printed["model"]["embed_dim"], printed["optimizer"]["eps"]) == (7, 32, 1e-6)


def test_an_unknown_flag_among_overrides_is_one_line(capsys, no_compile):
    assert main(["--config", TINY, "train.steps=2", "--no-such-flag", "mesh.data=1"]) == 2
    err = capsys.readouterr().err
    assert err == "error: arguments: unrecognized arguments: --no-such-flag\n"


def test_profile_steps_writes_a_trace_of_those_steps(tmp_path, capsys):
    """train.profile_steps=2-3: a jax.profiler trace (TensorBoard xplane + Perfetto JSON) in
    run.dir/profile whose events include the executions of the train step."""
    import gzip

    assert main(["--config", TINY, "train.steps=4", "train.log_every=1", "train.profile_steps=2-3",
                 "run.tensorboard=false", f"run.dir={tmp_path}"]) == 0
    assert f"profile of steps 2-3 written to {tmp_path / 'profile'}" in capsys.readouterr().err
    (xplane,) = (tmp_path / "profile").rglob("*.xplane.pb")
    (perfetto,) = (tmp_path / "profile").rglob("perfetto_trace.json.gz")
    with gzip.open(perfetto) as stream:
        events = json.load(stream)["traceEvents"]
    assert any("jit_step" in str(event.get("name")) for event in events) and xplane.stat().st_size > 0


@pytest.mark.parametrize("value", ["0", "5-3", "a-b", "2-", "501", "400-600"])  # configs/tiny.yaml: 500 steps
def test_profile_steps_must_be_a_step_or_a_range(capsys, value):
    assert main(["--config", TINY, f"train.profile_steps={value}"]) == 2
    assert capsys.readouterr().err.startswith("error: train.profile_steps: ")


@pytest.mark.parametrize("tool, argv, field", [
    ("generate", ["--run", "nowhere", "--prompt", "a", "--temperature", "nan"], "--temperature"),
    ("generate", ["--run", "nowhere", "--prompt", "a", "--temperature", "inf"], "--temperature"),
    ("generate", ["--run", "nowhere", "--prompt", "a", "--seed", str(10 ** 23)], "--seed"),  # was an OverflowError
    ("logits", ["--model", "nowhere", "--tokens", "ids.npy", "--out", "."], "--out"),
    ("logits", ["--model", "nowhere", "--tokens", "ids.npy", "--out", "logits.bin"], "--out"),
])
def test_tool_arguments_that_would_be_silently_wrong_are_one_line_errors(tool, argv, field, capsys):
    """Issue 38 items 11 and 13: ``generate --temperature nan`` sampled from NaN probabilities and
    ``--seed 10**23`` overflowed in the key; ``logits --out DIR`` wrote ``DIR.npy`` beside the
    directory. All refused before any model is loaded."""
    from meshtrain import generate, logits

    assert {"generate": generate, "logits": logits}[tool].main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {field}: "), err

"""Experiment trackers (``run.loggers``, meshtrain/trackers.py; issue 39 item 1), tested for real.

Weights & Biases runs in offline mode (``WANDB_MODE=offline``, ``WANDB_DIR`` under tmp) and its
``.wandb`` run file is read back with W&B's own reader (``wandb leet inspect --json``); MLflow writes
to a local file store (a ``file://`` tracking URI under tmp) read back with ``MlflowClient``. Each
trains a few steps, checks that the tracker holds every scalar of ``metrics.jsonl`` at its step and
the resolved config as the run's parameters, then resumes the run from its checkpoint and checks
that the resumed run continues the same tracked run. The W&B and MLflow tests skip when their extra
(``pip install -e '.[wandb]'``, ``'.[mlflow]'``) is not installed. Also: the ``run.loggers`` field
(and the deprecated ``run.tensorboard`` it replaced), a logger named but not installed, and a
tracker that cannot start, each one line.
"""

from __future__ import annotations

import json
import math
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
import yaml

from meshtrain.config import load_config, to_dict
from meshtrain.errors import ConfigError
from meshtrain.train import main
from meshtrain.trackers import (TRACKERS_FILE, Logger, Status, check_installed, flat_params, open_trackers,
                                scalars)
from utils import one_line_error

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")
SMALL = ["model.embed_dim=32", "train.batch_size=16", "train.log_every=1", "checkpoint.every=2",
         "checkpoint.async_save=false"]


def metrics_by_step(run_dir: pathlib.Path) -> dict[int, dict[str, float]]:
    """metrics.jsonl's scalars per step (a step's training and evaluation lines merged), as the
    trackers get them: non-finite numbers back from their ``"nan"`` spelling, ``None`` left out."""
    by_step: dict[int, dict[str, float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        step = record.pop("step")
        record = {key: float(value) if value in ("nan", "inf", "-inf") else value for key, value in record.items()}
        by_step.setdefault(step, {}).update(scalars(record))
    return by_step


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def train(argv: list[str]) -> None:
    assert main(["--config", TINY, *SMALL, *argv]) == 0


# --- the run.loggers field ----------------------------------------------------------------------------

def test_loggers_default_to_tensorboard_and_take_a_list():
    assert load_config(None).run.loggers == (Logger.TENSORBOARD,)
    cfg = load_config(None, ["run.loggers=[tensorboard, wandb, mlflow]", "run.project=p", "run.name=n"])
    assert cfg.run.loggers == (Logger.TENSORBOARD, Logger.WANDB, Logger.MLFLOW)
    assert (cfg.run.project, cfg.run.name) == ("p", "n")
    assert load_config(None, ["run.loggers=[]"]).run.loggers == ()
    assert to_dict(cfg)["run"]["loggers"] == ["tensorboard", "wandb", "mlflow"]


@pytest.mark.parametrize("override, hints", [
    ("run.loggers=[wandbb]", ["'wandbb' is not valid (did you mean 'wandb'?)",
                              "use any of tensorboard | wandb | mlflow"]),
    ("run.loggers=wandb", ["expected a list, got the string 'wandb'; write [wandb]"]),
    ("run.loggers=[wandb, wandb]", ["names a logger twice"]),
    ("run.name=''", ["must be a non-empty name, or null for the default"]),
], ids=["misspelt", "a-string", "twice", "empty-name"])
def test_a_bad_loggers_value_is_one_line(capsys, override, hints):
    field = override.split("=")[0]
    one_line_error(main(["--config", TINY, override, "--print-config"]), capsys.readouterr().err, field, *hints)


def test_the_deprecated_tensorboard_field_still_loads_as_loggers(tmp_path):
    assert load_config(None, ["run.tensorboard=false"]).run.loggers == ()
    assert load_config(None, ["run.tensorboard=true"]).run.loggers == (Logger.TENSORBOARD,)
    # agreeing with run.loggers (a base file's tensorboard: false under an override) is fine
    assert load_config(None, ["run.tensorboard=false", "run.loggers=[mlflow]"]).run.loggers == (Logger.MLFLOW,)
    # a config.yaml written before run.loggers (run.dir's, or a checkpoint's) loads
    old = tmp_path / "config.yaml"
    old.write_text(yaml.safe_dump({"run": {"dir": str(tmp_path), "tensorboard": False}}))
    assert load_config(old).run.loggers == ()


def test_the_deprecated_tensorboard_field_contradicting_loggers_is_one_line(capsys):
    rc = main(["--config", TINY, "run.tensorboard=false", "run.loggers=[tensorboard]", "--print-config"])
    one_line_error(rc, capsys.readouterr().err, "run.tensorboard", "false contradicts run.loggers ['tensorboard']",
                   "drop run.tensorboard (deprecated)")
    rc = main(["--config", TINY, "run.tensorboard=no way", "--print-config"])
    one_line_error(rc, capsys.readouterr().err, "run.tensorboard", "write run.loggers: [tensorboard]")


def test_print_config_shows_loggers_where_tensorboard_was_given(capsys):
    assert main(["--config", TINY, "run.tensorboard=false", "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert "tensorboard" not in printed
    (line,) = [line for line in printed.splitlines() if line.strip().startswith("loggers:")]
    assert line.split("#")[0].split() == ["loggers:", "[]"] and line.endswith("# from the command line")


def test_scalars_are_the_numbers_of_a_metrics_line():
    line = {"loss": 2.5, "mfu": None, "lr": np.float32(0.5), "skipped_steps": np.int64(3), "finite": True,
            "expert_share": [0.25, 0.75], "expert_share_max": 0.75, "sample": "text is left out",
            "nan_loss": float("nan")}
    out = scalars(line)
    assert out == {"loss": 2.5, "lr": 0.5, "skipped_steps": 3.0, "finite": 1.0, "expert_share/0": 0.25,
                   "expert_share/1": 0.75, "expert_share_max": 0.75, "nan_loss": out["nan_loss"]}
    assert math.isnan(out["nan_loss"]) and all(type(value) is float for value in out.values())


# --- a logger named but not installed -----------------------------------------------------------------

@pytest.mark.parametrize("logger", ["wandb", "mlflow"])
def test_a_logger_that_is_not_installed_is_one_line_before_anything_runs(tmp_path, capsys, monkeypatch, no_compile,
                                                                         logger):
    monkeypatch.setitem(sys.modules, logger, None)  # importlib.util.find_spec reports it missing
    rc = main(["--config", TINY, f"run.dir={tmp_path / 'run'}", f"run.loggers=[tensorboard, {logger}]"])
    one_line_error(rc, capsys.readouterr().err, "run.loggers", f"lists {logger}, which is not installed",
                   f"pip install 'meshtrain[{logger}]'", f"pip install -e '.[{logger}]'",
                   f"drop {logger} from run.loggers")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("uri", [None, "postgresql+psycopg2://u@db/mlflow"], ids=["default-sqlite", "postgres"])
def test_mlflow_client_only_with_a_database_store_is_one_line_naming_the_extra(tmp_path, capsys, monkeypatch,
                                                                               no_compile, uri):
    """Issue 52, item 3: with the dev extra's mlflow-skinny (no SQLAlchemy), MLflow's default store (a
    SQLite file) or any database URI is one line naming the mlflow extra, before anything runs (it was
    MLflow's 'Model registry functionality is unavailable; got unsupported URI' after start-up)."""
    pytest.importorskip("mlflow")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)  # as mlflow-skinny alone has it (find_spec: None)
    if uri is None:
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    else:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    rc = main(["--config", TINY, f"run.dir={tmp_path / 'run'}", "run.loggers=[tensorboard, mlflow]"])
    store = f"sqlite:///{tmp_path / 'mlflow.db'} (MLflow's default store)" if uri is None else \
        f"{uri} ($MLFLOW_TRACKING_URI)"
    one_line_error(rc, capsys.readouterr().err, "run.loggers", f"lists mlflow, whose tracking store {store}",
                   "(mlflow-skinny, no sqlalchemy", "pip install 'meshtrain[mlflow]'",
                   "or set MLFLOW_TRACKING_URI to a tracking server (http://...)")
    assert not (tmp_path / "run").exists() and not (tmp_path / "mlflow.db").exists()


def test_mlflow_client_only_with_a_file_store_passes_the_check(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    check_installed([Logger.MLFLOW])  # no error: a file store (or a server) needs only the client


# --- Weights & Biases, offline ----------------------------------------------------------------------

def wandb_records(run_path: pathlib.Path) -> tuple[dict, list[dict]]:
    """W&B's own reading of an offline run directory's ``.wandb`` file: ``wandb leet inspect``'s
    summary (run id, state, config, ...) and its records."""
    wandb_cli = shutil.which("wandb", path=str(pathlib.Path(sys.executable).parent))
    if wandb_cli is None or subprocess.run([wandb_cli, "leet", "inspect", "--help"], capture_output=True,
                                           check=False).returncode != 0:
        pytest.skip("this wandb has no `wandb leet inspect`, W&B's reader of .wandb files")
    inspect = lambda *flags: subprocess.run([wandb_cli, "leet", "inspect", "--json", *flags, str(run_path)],
                                            capture_output=True, text=True, check=True, timeout=600).stdout
    return json.loads(inspect("--summary")), [json.loads(line) for line in inspect().splitlines()]


def wandb_history(records: list[dict]) -> dict[int, dict[str, float]]:
    """The history rows of a run's records by step, W&B's own keys (``_step``, ``_runtime``) left out."""
    value = lambda v: float(v) if isinstance(v, (int, float)) else {"NaN": math.nan, "Infinity": math.inf,
                                                                     "-Infinity": -math.inf}[v]
    rows = [record["history"]["item"] for record in records if record["type"] == "history"]
    return {int(row["_step"]): {key: value(v) for key, v in row.items() if not key.startswith("_")} for row in rows}


def without_empty(config: dict) -> dict:
    """``config`` without its empty mappings, at every depth."""
    return {key: without_empty(value) if isinstance(value, dict) else value for key, value in config.items()
            if value != {}}


@pytest.mark.slow
def test_wandb_offline_run_holds_every_scalar_and_the_config_and_resumes(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    wandb_dir, run_dir = tmp_path / "wandb_dir", tmp_path / "run"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    argv = [f"run.dir={run_dir}", "run.loggers=[wandb]", "run.name=tiny-wandb"]
    train([*argv, "train.steps=4"])

    (first,) = (wandb_dir / "wandb").glob("offline-run-*")
    run_id = json.loads((run_dir / TRACKERS_FILE).read_text())["wandb"]["run_id"]
    summary, records = wandb_records(first)
    assert (summary["run_id"], summary["name"], summary["project"], summary["state"]) == (
        run_id, "tiny-wandb", "meshtrain", "finished")
    # W&B keeps no empty sections (sharding.rules: {})
    assert summary["config"] == without_empty(json.loads(json.dumps(to_dict(load_config(run_dir / "config.yaml")))))
    expected, history = metrics_by_step(run_dir), wandb_history(records)
    assert sorted(history) == sorted(expected) == [1, 2, 3, 4]
    for step, values in expected.items():
        assert set(history[step]) == set(values), step
        assert all(same(history[step][key], value) for key, value in values.items()), (step, history[step])
    assert not (run_dir / "tensorboard").exists()

    train([*argv, "train.steps=6"])  # resumes from the checkpoint of step 4
    (second,) = set((wandb_dir / "wandb").glob("offline-run-*")) - {first}
    summary, records = wandb_records(second)
    assert summary["run_id"] == run_id and summary["state"] == "finished"  # the same W&B run, continued
    assert json.loads((run_dir / TRACKERS_FILE).read_text())["wandb"]["run_id"] == run_id
    expected, history = metrics_by_step(run_dir), wandb_history(records)
    assert sorted(history) == [5, 6]
    for step in (5, 6):
        assert set(history[step]) == set(expected[step])
        assert all(same(history[step][key], value) for key, value in expected[step].items())
    assert summary["config"]["train"]["steps"] == 6


# --- MLflow, a local file store -----------------------------------------------------------------------

@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    """A file:// tracking store under tmp_path (MLflow 3 asks to opt in to the file store)."""
    pytest.importorskip("mlflow")
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


@pytest.mark.slow
def test_mlflow_run_holds_every_scalar_and_the_config_and_resumes(tmp_path, mlflow_store, capsys):
    client, run_dir = mlflow_store, tmp_path / "run"
    argv = [f"run.dir={run_dir}", "run.loggers=[tensorboard, mlflow]", "run.project=tiny-experiments",
            "eval.every=2", "eval.batches=1"]
    train([*argv, "train.steps=4"])

    ids = json.loads((run_dir / TRACKERS_FILE).read_text())["mlflow"]
    run = client.get_run(ids["run_id"])
    assert (run.info.status, run.info.run_name) == ("FINISHED", "run")
    assert client.get_experiment(run.info.experiment_id).name == "tiny-experiments"
    config = to_dict(load_config(run_dir / "config.yaml"))
    assert run.data.params == flat_params(config)
    assert run.data.params["train.steps"] == "4" and run.data.params["run.loggers"] == '["tensorboard", "mlflow"]'

    def check_history(steps: list[int]) -> None:
        expected = metrics_by_step(run_dir)
        assert sorted(expected) == steps
        keys = set().union(*expected.values())
        assert "eval_loss" in keys and "grad_norm" in keys
        assert set(client.get_run(ids["run_id"]).data.metrics) == keys
        for key in keys:
            history = {m.step: m.value for m in client.get_metric_history(ids["run_id"], key)}
            want = {step: values[key] for step, values in expected.items() if key in values}
            assert sorted(history) == sorted(want), key
            assert all(same(history[step], value) for step, value in want.items()), (key, history, want)

    check_history([1, 2, 3, 4])
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    capsys.readouterr()

    train([*argv, "train.steps=6"])  # resumes from the checkpoint of step 4, appending to the same run
    assert f"mlflow: run {ids['run_id']} keeps its first params where this config differs (train.steps 4 -> 6)" \
        in capsys.readouterr().err
    assert json.loads((run_dir / TRACKERS_FILE).read_text())["mlflow"] == ids
    assert len(client.search_runs([run.info.experiment_id])) == 1
    assert client.get_run(ids["run_id"]).info.status == "FINISHED"
    check_history([1, 2, 3, 4, 5, 6])


def test_mlflow_ids_are_reused_only_by_a_resumed_run(tmp_path, mlflow_store):
    """open_trackers: a resumed run reopens the kept run (RUNNING again); a run from step 0 starts
    a new one and replaces the kept ids."""
    run_dir, config = tmp_path / "run", to_dict(load_config(None))
    run_dir.mkdir()
    opened = lambda resumed: open_trackers([Logger.MLFLOW], run_dir, config, project=None, name=None,
                                           resumed=resumed)
    (first,) = opened(False)
    first.close(Status.PREEMPTED)
    assert mlflow_store.get_run(first.run_id).info.status == "KILLED"
    (again,) = opened(True)
    assert again.run_id == first.run_id and mlflow_store.get_run(first.run_id).info.status == "RUNNING"
    again.close(Status.FINISHED)
    (fresh,) = opened(False)
    assert fresh.run_id != first.run_id
    assert json.loads((run_dir / TRACKERS_FILE).read_text())["mlflow"]["run_id"] == fresh.run_id
    fresh.close(Status.FAILED)
    assert mlflow_store.get_run(fresh.run_id).info.status == "FAILED"


def test_a_tracker_that_cannot_start_is_one_line(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://nowhere")
    with pytest.raises(ConfigError, match=r"^run\.loggers: mlflow could not start its run: .*nosuchscheme"):
        open_trackers([Logger.MLFLOW], tmp_path, {}, project=None, name=None, resumed=False)


def test_a_tensorboard_directory_that_is_a_file_is_one_line(tmp_path):
    """Issue 53, item 8."""
    (tmp_path / "tensorboard").write_text("a file")
    with pytest.raises(ConfigError, match=r"^run\.loggers: .*tensorboard is a file, not a directory$"):
        open_trackers([Logger.TENSORBOARD], tmp_path, {}, project=None, name=None, resumed=False)


class _StoreGone:
    """A tracker whose store disappears after its first step (an MLflow file store replaced by a file)."""

    name = "mlflow"

    def __init__(self):
        self.logged, self.closed = [], False

    def log(self, step, scalars):
        if self.logged:
            raise OSError(20, "Not a directory: 'mlruns/0/meta.yaml'")
        self.logged.append(step)

    def log_samples(self, step, samples):
        raise AssertionError("dropped trackers get nothing more")

    def close(self, status):
        self.closed = True


def test_a_tracker_that_fails_mid_run_is_dropped_with_one_warning_and_the_run_goes_on(tmp_path, capsys):
    """Issue 53, item 8: metrics.jsonl keeps every step; the failing tracker gets nothing more."""
    from meshtrain.metrics import MetricsLogger

    tracker = _StoreGone()
    with MetricsLogger(tmp_path, 4, is_primary=True, tensorboard=False, trackers=[tracker]) as logger:
        for step in range(1, 5):
            logger.log(step, {"loss": 1.0 / step})
        logger.log_samples(4, [{"prompt": "a", "text": "b"}])
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: run.loggers: mlflow failed at step 2 ([Errno 20] Not a directory: "
                        "'mlruns/0/meta.yaml') and logs nothing more in this run; "
                        f"{tmp_path / 'metrics.jsonl'} keeps every step"]
    assert tracker.logged == [1] and not tracker.closed
    assert sorted(metrics_by_step(tmp_path)) == [1, 2, 3, 4]

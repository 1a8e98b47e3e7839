"""Experiment trackers (``run.loggers``): TensorBoard, Weights & Biases and MLflow.

Each tracker receives every scalar that ``metrics.jsonl`` has, at its step (a list-valued metric as
``<key>/<i>`` beside its ``<key>_max`` and ``<key>_min``; ``None`` and text left out), and the
W&B and MLflow runs get the resolved config as their parameters (W&B's ``config`` as nested
sections, MLflow's params as dotted keys, ``train.steps``).

A run that resumes from a checkpoint in ``run.dir`` continues the same tracked runs: the ids are
kept in ``run.dir/trackers.json`` (W&B's run id, reopened with ``resume="allow"``; MLflow's run id,
set back to RUNNING). A run that starts from step 0 starts new tracked runs.

Where they write:

* ``tensorboard``: ``run.dir/tensorboard`` (tensorboardX, a dependency of meshtrain; the
  ``tensorboard`` extra installs the viewer and its profile plugin).
* ``wandb``: project ``run.project``, else ``$WANDB_PROJECT``, else ``meshtrain``; run name
  ``run.name``, else ``run.dir``'s name; local files in ``$WANDB_DIR``, else ``run.dir/wandb``.
  Everything else is W&B's own settings: ``WANDB_MODE=offline`` writes locally only (``wandb
  sync`` uploads it later), ``WANDB_ENTITY``, ``wandb login``.
* ``mlflow``: the tracking server of ``$MLFLOW_TRACKING_URI`` (MLflow's default when unset: a
  ``mlflow.db`` SQLite store in the working directory), experiment ``run.project``, else
  ``$MLFLOW_EXPERIMENT_NAME``, else ``meshtrain``; run name as W&B's. MLflow params cannot change:
  a resumed run whose config differs keeps the first values and says so in one line.

W&B and MLflow are optional extras (``pip install -e '.[wandb]'``, ``'.[mlflow]'``);
``check_installed`` refuses a config naming a missing one in one line before anything compiles, and
MLflow's client alone (``mlflow-skinny``, the dev extra's) with a database store (MLflow's default SQLite
``mlflow.db`` included), which only the full ``mlflow`` opens.
Only process 0 tracks.
"""

from __future__ import annotations

import enum
import importlib.util
import json
import os
import pathlib
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from meshtrain.errors import ConfigError, writable_directory

TRACKERS_FILE = "trackers.json"  # under run.dir: the tracked runs' ids, reused on resume
TENSORBOARD_DIR = "tensorboard"  # under run.dir: TensorBoard's event files
DEFAULT_PROJECT = "meshtrain"
# MLflow's limits: params per log_batch request, metrics per request, characters in a param's value.
_MLFLOW_PARAMS_PER_BATCH, _MLFLOW_METRICS_PER_BATCH, _MLFLOW_PARAM_VALUE_LENGTH = 100, 1000, 6000


class Logger(str, enum.Enum):
    """A tracker ``run.loggers`` may name."""

    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    MLFLOW = "mlflow"


# The module each logger imports, installed by the pip extra of the logger's name (TensorBoard's
# writer, tensorboardX, is a dependency of meshtrain itself).
_MODULES = {Logger.WANDB: "wandb", Logger.MLFLOW: "mlflow"}


class Status(str, enum.Enum):
    """How a run segment ended, as its trackers record it."""

    FINISHED = "finished"
    FAILED = "failed"  # stopped by an error
    PREEMPTED = "preempted"  # stopped by SIGTERM/SIGINT, saved, to be resumed


class Tracker(Protocol):
    """Where a run's scalars go besides ``metrics.jsonl``."""

    name: str  # the run.loggers entry that opens it

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        """Record ``scalars`` at ``step``."""

    def log_samples(self, step: int, samples: Sequence[Mapping[str, str]]) -> None:
        """Record text samples (``{"prompt", "text"}`` each) the model produced at ``step``."""

    def close(self, status: Status) -> None:
        """End this run segment."""


def check_installed(loggers: Sequence[Logger]) -> None:
    """A one-line ConfigError on ``run.loggers`` for a logger whose library is not installed, or (MLflow)
    whose tracking store needs more of it than is installed."""
    for logger in loggers:
        module = _MODULES.get(logger)
        if module is not None and importlib.util.find_spec(module) is None:
            raise ConfigError("run.loggers", f"lists {logger.value}, which is not installed: {_install(logger)}, "
                              f"or drop {logger.value} from run.loggers")
        if logger is Logger.MLFLOW:
            _check_mlflow_store()


def _install(logger: Logger) -> str:
    return f"pip install 'meshtrain[{logger.value}]' (in a clone: pip install -e '.[{logger.value}]')"


# What MLflow's database stores (sqlite:, postgresql:, mysql:, mssql:) import: the full ``mlflow``
# package has them, its client ``mlflow-skinny`` (the dev extra's) does not.
_MLFLOW_DATABASE_MODULES = ("sqlalchemy", "alembic")


def _check_mlflow_store() -> None:
    """A one-line ConfigError when MLflow's tracking URI (``$MLFLOW_TRACKING_URI``, else MLflow's default,
    a SQLite file) is a database and only MLflow's client (``mlflow-skinny``) is installed."""
    import mlflow
    from mlflow.store.db.db_types import DATABASE_ENGINES

    uri = mlflow.get_tracking_uri()
    scheme = uri.partition(":")[0].partition("+")[0].lower()  # postgresql+psycopg2 -> postgresql
    missing = [name for name in _MLFLOW_DATABASE_MODULES if importlib.util.find_spec(name) is None]
    if scheme in DATABASE_ENGINES and missing:
        where = "$MLFLOW_TRACKING_URI" if os.environ.get("MLFLOW_TRACKING_URI") else "MLflow's default store"
        raise ConfigError("run.loggers", f"lists mlflow, whose tracking store {uri} ({where}) is a database that "
                          f"only the full MLflow opens; this is its client alone (mlflow-skinny, no "
                          f"{' or '.join(missing)}): {_install(Logger.MLFLOW)}, or set MLFLOW_TRACKING_URI to a "
                          "tracking server (http://...)")


def scalars(metrics: Mapping[str, object]) -> dict[str, float]:
    """The numbers among ``metrics`` (a ``metrics.jsonl`` line's values, ``step`` aside), a list's
    components as ``<key>/<i>``; ``None``, text and anything else that is not a number left out."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if isinstance(value, (list, tuple)):
            out.update({f"{key}/{i}": float(v) for i, v in enumerate(value) if _is_number(v)})
        elif _is_number(value):
            out[key] = float(value)
    return out


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating, np.bool_))  # bool is an int


class TensorBoardTracker:
    """Scalars as TensorBoard event files under ``logdir`` (tensorboardX)."""

    name = Logger.TENSORBOARD.value

    def __init__(self, logdir: pathlib.Path):
        # Imported here: tensorboardX imports torch when it is installed (seconds at every start-up
        # of a run that does not want TensorBoard).
        from tensorboardX import SummaryWriter

        self._writer = SummaryWriter(logdir=str(logdir))

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def log_samples(self, step: int, samples: Sequence[Mapping[str, str]]) -> None:
        self._writer.add_text("samples", samples_markdown(samples), step)
        self._writer.flush()

    def close(self, status: Status) -> None:
        self._writer.close()


class WandbTracker:
    """A Weights & Biases run (``wandb.init``); ``run_id`` reopens an earlier one."""

    name = Logger.WANDB.value

    def __init__(self, *, directory: pathlib.Path, project: str, name: str, config: dict, run_id: str | None):
        import wandb

        directory.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project=project, name=name, dir=str(directory), config=config, id=run_id,
                               resume="allow" if run_id is not None else None)
        self.run_id = self._run.id

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self._run.log(dict(scalars), step=step)

    def log_samples(self, step: int, samples: Sequence[Mapping[str, str]]) -> None:
        import wandb

        table = wandb.Table(columns=["step", "prompt", "text"],
                            data=[[step, sample["prompt"], sample["text"]] for sample in samples])
        self._run.log({"samples": table}, step=step)

    def close(self, status: Status) -> None:
        if status is Status.PREEMPTED:
            self._run.mark_preempting()
        self._run.finish(exit_code=1 if status is Status.FAILED else 0)


class MlflowTracker:
    """An MLflow run in experiment ``experiment`` of the tracking server MLflow is configured with
    (``MLFLOW_TRACKING_URI``); ``run_id`` reopens an earlier one. ``params``: the flat config."""

    name = Logger.MLFLOW.value

    def __init__(self, *, experiment: str, name: str, params: dict[str, str], run_id: str | None):
        from mlflow import MlflowClient
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException

        self._client = client = MlflowClient()
        run = None
        if run_id is not None:
            try:
                run = client.get_run(run_id)
            except MlflowException:
                _note(f"mlflow: run {run_id} (from {TRACKERS_FILE}) is not on {client.tracking_uri}; "
                      "starting a new one")
        if run is not None:
            client.update_run(run.info.run_id, status="RUNNING")
            kept = run.data.params
        else:
            found = client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found is not None else client.create_experiment(experiment)
            run, kept = client.create_run(experiment_id, run_name=name), {}
        self.run_id, self.tracking_uri = run.info.run_id, client.tracking_uri
        new = [Param(key, value) for key, value in params.items() if key not in kept]
        for first in range(0, len(new), _MLFLOW_PARAMS_PER_BATCH):
            client.log_batch(self.run_id, params=new[first:first + _MLFLOW_PARAMS_PER_BATCH])
        changed = [key for key, value in params.items() if key in kept and kept[key] != value]
        if changed:
            shown = ", ".join(f"{key} {kept[key]} -> {params[key]}" for key in changed[:4])
            more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
            _note(f"mlflow: run {self.run_id} keeps its first params where this config differs ({shown}{more}); "
                  "MLflow params cannot change")

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for key, value in scalars.items()]
        for first in range(0, len(metrics), _MLFLOW_METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=metrics[first:first + _MLFLOW_METRICS_PER_BATCH])

    def log_samples(self, step: int, samples: Sequence[Mapping[str, str]]) -> None:
        self._client.log_text(self.run_id, samples_markdown(samples), f"samples/step_{step:08d}.md")

    def close(self, status: Status) -> None:
        self._client.set_terminated(self.run_id, status={Status.FINISHED: "FINISHED", Status.FAILED: "FAILED",
                                                         Status.PREEMPTED: "KILLED"}[status])


def samples_markdown(samples: Sequence[Mapping[str, str]]) -> str:
    """Text samples as a Markdown list: each prompt in bold, then its continuation."""
    return "\n\n".join(f"**{sample['prompt']}**{sample['text']}" for sample in samples)


def _note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``config`` (``meshtrain.config.to_dict``'s) as MLflow params: dotted keys, each value as text
    (strings as they are, the rest as JSON: ``true``, ``null``, ``[1, 2]``)."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flat_params(value, name + "."))
        else:
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            flat[name] = text[:_MLFLOW_PARAM_VALUE_LENGTH]
    return flat


def _read_ids(path: pathlib.Path) -> dict[str, dict]:
    """The tracked runs' ids kept in ``path`` (``{}`` when there is none)."""
    if not path.is_file():
        return {}
    try:
        ids = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ConfigError("run.dir", f"cannot read {path} ({err}); delete it to start new tracked runs") from None
    if not isinstance(ids, dict) or not all(isinstance(entry, dict) for entry in ids.values()):
        raise ConfigError("run.dir", f"{path} is not a mapping of logger to run ids; delete it to start new "
                          "tracked runs")
    return ids


def open_trackers(loggers: Sequence[Logger], run_dir: pathlib.Path, config: dict, *, project: str | None,
                  name: str | None, resumed: bool) -> list[Tracker]:
    """The trackers ``loggers`` names for a run writing to ``run_dir`` whose resolved config is
    ``config`` (``to_dict``'s); ``resumed``: the run continues from a checkpoint in ``run_dir``,
    and so continues the tracked runs whose ids ``run_dir/trackers.json`` keeps. A tracker that
    cannot start (W&B not logged in, an MLflow server out of reach) is a ConfigError on
    ``run.loggers``, the trackers already open closed."""
    ids_path = run_dir / TRACKERS_FILE
    ids = _read_ids(ids_path) if resumed else {}
    name = name or run_dir.resolve().name
    trackers: list[Tracker] = []
    try:
        for logger in loggers:
            trackers.append(_open(logger, run_dir, config, project, name, ids.get(logger.value, {})))
            if logger is Logger.WANDB:
                ids[logger.value] = {"run_id": trackers[-1].run_id}
            elif logger is Logger.MLFLOW:
                ids[logger.value] = {"run_id": trackers[-1].run_id, "tracking_uri": trackers[-1].tracking_uri}
        if not resumed:  # a new run: ids a file may keep are an earlier run's
            ids_path.unlink(missing_ok=True)
        if ids:
            partial = ids_path.with_name(ids_path.name + ".tmp")
            partial.write_text(json.dumps(ids, indent=2) + "\n", encoding="utf-8")
            os.replace(partial, ids_path)
    except BaseException:
        close_trackers(trackers, Status.FAILED)
        raise
    return trackers


def _open(logger: Logger, run_dir: pathlib.Path, config: dict, project: str | None, name: str,
          ids: dict) -> Tracker:
    if logger is Logger.TENSORBOARD:
        return TensorBoardTracker(writable_directory(run_dir / TENSORBOARD_DIR, "run.loggers"))
    try:
        if logger is Logger.WANDB:
            directory = pathlib.Path(os.environ.get("WANDB_DIR") or run_dir)
            return WandbTracker(directory=directory, project=project or os.environ.get("WANDB_PROJECT")
                                or DEFAULT_PROJECT, name=name, config=config, run_id=ids.get("run_id"))
        return MlflowTracker(experiment=project or os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_PROJECT,
                             name=name, params=flat_params(config), run_id=ids.get("run_id"))
    except Exception as err:  # the libraries' own errors (wandb.errors.UsageError, MlflowException, ...)
        first = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise ConfigError("run.loggers", f"{logger.value} could not start its run: {first}") from err


def close_trackers(trackers: Sequence[Tracker], status: Status) -> None:
    """Closes each of ``trackers`` (all of them, even when one fails; the first failure is raised)."""
    failure = None
    for tracker in trackers:
        try:
            tracker.close(status)
        except Exception as err:  # noqa: BLE001 - the others still close; the first is raised below
            failure = failure or err
    if failure is not None:
        raise failure


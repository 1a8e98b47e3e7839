"""``python -m meshtrain.train --config configs/tiny.yaml [section.field=value ...]``

Flags: ``--host-devices N`` simulates N CPU devices; ``--print-config`` prints the resolved config;
``--print-sharding`` prints the per-parameter sharding table. Both print flags exit without training.
``--fresh`` refuses to resume from checkpoints already in ``run.dir``.
Bad input prints one ``error: field: what is wrong`` line and exits 2.

A run resumes from the latest complete checkpoint in ``run.dir/checkpoints`` (see
``meshtrain/checkpoint.py``). SIGTERM/SIGINT finish the current step, save, and exit 0 with one line
saying how to resume. With ``train.on_nonfinite=stop`` a non-finite loss or gradient norm saves the
last good state and exits 3; a step that leaves non-finite parameters or moments exits 3 under either
policy, its state not saved.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import math
import os
import pathlib
import re
import shlex
import shutil
import signal
import sys
import threading
import time
from collections.abc import Sequence

import jax
import numpy as np
import yaml
from flax import nnx

from meshtrain import distributed, hf
from meshtrain.checkpoint import (CHECKPOINT_DIR, Restored, RunCheckpoints,
                                  UnreadableCheckpoint, check_params, checkpoint_meta, config_differences, load_params,
                                  SaveFailed, reorder_layers, resolve_restore_path, warn)
from meshtrain.cli import EXIT_USER_ERROR, HOST_MEMORY_MESSAGE, ArgumentParser, use_host_devices
from meshtrain.config import Config, load_config, to_dict
from meshtrain.data import DataChanged, Packing, global_batch, make_dataset
from meshtrain.data.tokenizer import TOKENIZER_FILE
from meshtrain.errors import ConfigError
from meshtrain.evaluation import Evaluator
from meshtrain.mesh import make_mesh, mesh_shape
from meshtrain.metrics import MetricsLogger, format_bytes, mfu, peak_bf16_tflops
from meshtrain.parallel.pipeline import LayerOrder
from meshtrain.parallel.sharding import parameter_table, replicated_parameters
from meshtrain.run_lock import RunLock
from meshtrain.train_config import NonFinitePolicy
from meshtrain.trainer import Metrics, Trainer
from models.api import family_of
from meshtrain.xla_flags import apply_recommended


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(prog="python -m meshtrain.train", description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="YAML config file (default: the dataclass defaults of every section)")
    parser.add_argument("--host-devices", type=int, metavar="N",
                        help="simulate N CPU devices (must be given before JAX starts)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--print-sharding", action="store_true",
                        help="print the per-parameter sharding table and exit")
    parser.add_argument("--fresh", action="store_true",
                        help="refuse to resume: fail if run.dir already holds checkpoints")
    multi = parser.add_argument_group("multi-process (see docs/multihost.md; the distributed section)")
    multi.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's coordinator address")
    multi.add_argument("--num-processes", type=int, metavar="N", help="number of processes of the run")
    multi.add_argument("--process-id", type=int, metavar="I", help="this process's rank, 0..N-1")
    multi.add_argument("--local-device-ids", metavar="I,J,...",
                       help="local accelerators this process uses (among the visible ones)")
    return parser.parse_args(argv)


def _distributed_flags(args: argparse.Namespace, cfg: distributed.DistributedConfig) -> distributed.DistributedConfig:
    """The ``distributed`` section with the multi-process flags applied. The flags stay out of the
    run's config (and so out of the ``config.yaml`` a resume reads): they differ per process."""
    flags = {"coordinator": args.coordinator, "num_processes": args.num_processes, "process_id": args.process_id}
    if args.local_device_ids is not None:
        if not re.fullmatch(r"\d+(,\d+)*", args.local_device_ids):
            raise ConfigError("--local-device-ids", f"must be comma-separated integers, got {args.local_device_ids!r}")
        flags["local_device_ids"] = tuple(int(i) for i in args.local_device_ids.split(","))
    try:
        return dataclasses.replace(cfg, **{key: value for key, value in flags.items() if value is not None})
    except ConfigError as err:
        raise ConfigError("--" + err.field.replace("_", "-"), err.message) from None


def _log(message: str) -> None:
    if jax.process_index() == 0:
        print(message, file=sys.stderr, flush=True)


class NonFiniteStop(Exception):
    """A non-finite step stops the run (exit status 3): ``train.on_nonfinite=stop`` met a non-finite
    loss or gradient norm, or (under either policy) an update left non-finite parameters or moments."""


EXIT_NONFINITE = 3
DOCUMENT_ATTENTION_NOTE = ("packing: documents: attention applies the document mask with XLA's kernel "
                           "(cuDNN's fused kernel takes no segment ids through public JAX, so it is not used)")
# Sections whose changes between a checkpoint and the resumed run change the numbers (warned about).
_NUMERIC_SECTIONS = ("model", "optimizer", "data", "train")
_HARMLESS_FIELDS = ("train.log_every", "train.profile_steps")


def _any_process(flag: bool) -> bool:
    """Whether ``flag`` is set on any process (so that every process takes the same branch)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils
    return bool(np.any(multihost_utils.process_allgather(np.array(flag))))


class _StepReporter:
    """Reads a step's metrics when it is due for logging and adds time, tokens/s, TFLOP/s, MFU."""

    def __init__(self, cfg: Config, logger: MetricsLogger, num_devices: int, peak_tflops: float | None,
                 start: int = 0):
        self.steps, self.log_every, self.logger, self.start = cfg.train.steps, cfg.train.log_every, logger, start
        self.tokens_per_step = cfg.train.batch_size * cfg.model.seq_len
        self.flops_per_step = self.tokens_per_step * family_of(cfg.model).flops_per_token(cfg.model)
        self.num_devices, self.peak_tflops = num_devices, peak_tflops
        self.last_time, self.last_done = time.perf_counter(), start
        self.final_metrics: dict[str, float | list[float]] = {}  # the last logged values (the last step's)

    def exclude(self, seconds: float) -> None:
        """Leaves ``seconds`` spent on other work (an evaluation) out of the step times."""
        self.last_time += seconds

    def report(self, step: int, metrics: dict[str, jax.Array], *, force: bool = False) -> None:
        done = step + 1  # steps completed
        if not (force or step == self.start or done % self.log_every == 0 or done == self.steps):
            return
        if done == self.last_done:  # already logged
            return
        values = {key: value.tolist() if value.ndim else float(value)
                  for key, value in jax.device_get(metrics).items()}
        now = time.perf_counter()
        step_time = (now - self.last_time) / (done - self.last_done)
        self.last_time, self.last_done = now, done
        tflops = self.flops_per_step / step_time / self.num_devices / 1e12
        self.logger.log(done, {**values, "tokens_per_sec": self.tokens_per_step / step_time,
                               "step_time_s": step_time, "tflops_per_device": tflops,
                               "mfu": mfu(tflops, self.peak_tflops)})
        self.final_metrics = values


class _Preemption:
    """SIGTERM/SIGINT set a flag that the loop reads after each step; a second signal aborts at once.

    Python runs a signal's handler only between bytecodes of the main thread, and coalesces signals
    that arrive before it runs; so each delivery is also counted through ``signal.set_wakeup_fd`` (one
    byte per signal, written by the C-level handler at once): two signals that reach the process
    before the handler runs still abort. Only installed from the main thread; elsewhere it does
    nothing.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: str | None = None
        self._previous: dict[int, object] = {}
        self._wakeup: tuple[int, int] | None = None  # (read end, write end)
        self._previous_wakeup = -1

    def __enter__(self) -> _Preemption:
        if threading.current_thread() is threading.main_thread():
            read, write = os.pipe()
            os.set_blocking(read, False)
            os.set_blocking(write, False)
            self._wakeup = (read, write)
            self._previous_wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._restore()

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        if self._wakeup is not None:
            signal.set_wakeup_fd(self._previous_wakeup)
            for fd in self._wakeup:
                os.close(fd)
            self._wakeup = None

    def _deliveries(self, signum: int) -> int:
        """How many times ``signum`` reached the process since the last look."""
        if self._wakeup is None:
            return 1
        try:
            data = os.read(self._wakeup[0], 4096)
        except BlockingIOError:
            data = b""
        return max(1, data.count(bytes([signum])))

    def _handle(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self.received is not None or self._deliveries(signum) > 1:  # a second one aborts at once
            previous = self._previous.get(signum)
            self._restore()
            if callable(previous):  # whoever handled it before us (Python's KeyboardInterrupt, say)
                signal.raise_signal(signum)
            elif signum == signal.SIGINT:  # it was ignored (nohup, a background job) or default
                raise KeyboardInterrupt
            else:
                signal.signal(signum, signal.SIG_DFL)
                signal.raise_signal(signum)
            return
        self.received = name
        _log(f"received {name}: finishing the current step, then saving a checkpoint "
             f"(send {name} again to stop without saving)")

    @property
    def requested(self) -> bool:
        return _any_process(self.received is not None)


PROFILE_DIR = "profile"  # under run.dir: jax.profiler traces (TensorBoard's profile plugin, Perfetto)


class _Profiler:
    """Traces the steps of ``train.profile_steps`` with ``jax.profiler`` into ``run.dir/profile``."""

    def __init__(self, steps: tuple[int, int] | None, log_dir: pathlib.Path, start: int):
        self.steps, self.log_dir, self.active = steps, log_dir, False
        if steps is not None and steps[1] <= start:
            _log(f"train.profile_steps {steps[0]}-{steps[1]}: the run resumes after step {start}; not profiling")
            self.steps = None

    def before(self, step: int) -> None:
        if self.steps is not None and not self.active and step >= self.steps[0]:
            jax.profiler.start_trace(str(self.log_dir), create_perfetto_trace=True)
            self.active = True

    def after(self, step: int, metrics) -> None:
        if self.active and step >= self.steps[1]:
            jax.block_until_ready(metrics)
            self.stop()
            _log(f"profile of steps {self.steps[0]}-{step} written to {self.log_dir} (tensorboard --logdir "
                 f"{self.log_dir}, or open the perfetto_trace.json.gz in ui.perfetto.dev)")
            self.steps = None

    def stop(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False


class _Saver:
    """Decides when to save (every N steps, every M minutes, final, preemption) and writes the meta."""

    def __init__(self, cfg: Config, checkpoints: RunCheckpoints | None, mesh: jax.sharding.Mesh):
        self.cfg, self.checkpoints, self.mesh = cfg, checkpoints, mesh
        self.config_dict = to_dict(cfg)
        self.last_time = time.monotonic()
        self.last_step: int | None = None

    def due(self, done: int) -> bool:
        every, minutes = self.cfg.checkpoint.every, self.cfg.checkpoint.every_minutes
        by_time = minutes > 0 and _any_process(time.monotonic() - self.last_time >= minutes * 60)
        return self.checkpoints is not None and ((every > 0 and done % every == 0) or by_time)

    def save(self, done: int, state, metrics: Metrics) -> pathlib.Path | None:
        """Saves the state after step ``done`` (``metrics``: that step's) unless it is not finite."""
        if self.checkpoints is None:
            return None
        if self.last_step != done:
            self.check_applied(done, metrics)
            self.checkpoints.save(done, state, checkpoint_meta(
                step=done, config=self.config_dict, mesh=self.mesh, batch_size=self.cfg.train.batch_size,
                data_seed=self.cfg.data.seed, train_seed=self.cfg.train.seed))
            self.last_time, self.last_step = time.monotonic(), done
        return self.checkpoints.path(done)

    def save_before_stopping(self, done: int, state, metrics: Metrics, what: str) -> str:
        """Saves step ``done`` and waits for it: ``"<what> was saved to PATH"`` for the one line the
        run stops with (or that nothing was saved)."""
        path = self.save(done, state, metrics)
        if path is None:
            return "nothing was saved (checkpoint.enabled=false)"
        self.checkpoints.wait()
        return f"{what} was saved to {path}"

    def check_applied(self, done: int, metrics: Metrics) -> None:
        """NonFiniteStop, with nothing saved, when step ``done`` left a non-finite parameter or
        moment (waits for that step). Its loss and gradients were finite, so the update was applied
        in place: the optimizer's arithmetic overflowed. The value is replicated, so every process
        takes the same branch."""
        if bool(jax.device_get(metrics["state_finite"])):
            return
        steps = [] if self.checkpoints is None else self.checkpoints.steps()
        kept = (f"the newest checkpoint, {self.checkpoints.path(steps[-1])}, holds the last good state"
                if steps else "no checkpoint was saved")
        raise NonFiniteStop(f"step {done} left non-finite parameters or optimizer moments from a finite loss "
                            f"and gradients (the optimizer's arithmetic overflowed: check the optimizer.* "
                            f"values); its state was not saved and {kept}")


def _restore_from(cfg: Config, trainer: Trainer, config: dict) -> Restored:
    """The state ``checkpoint.restore_from`` names (a step, a run or a checkpoints directory)."""
    field = "checkpoint.restore_from"
    root, step = resolve_restore_path(cfg.checkpoint.restore_from, field=field)
    source = RunCheckpoints(root, read_only=True)
    try:
        if step is None:
            restored = source.restore_latest(trainer.abstract_state(), field=field, config=config,
                                             layer_order=trainer.layer_order, move_unreadable=False)
            if restored is None:
                raise ConfigError(field, f"no complete checkpoint in {cfg.checkpoint.restore_from}")
            return restored
        try:
            return source.restore(step, trainer.abstract_state(), field=field, config=config,
                                  layer_order=trainer.layer_order)
        except UnreadableCheckpoint as err:
            raise ConfigError(field, f"checkpoint {source.path(step)} is unreadable: {err}") from None
    finally:
        source.close()


def _initial_state(cfg: Config, trainer: Trainer, checkpoints: RunCheckpoints | None, run_dir: pathlib.Path,
                   fresh: bool):
    """``(state, start step, restored checkpoint or None, note to log)``: resume from run.dir, else
    ``checkpoint.restore_from``, else a fresh init (with ``checkpoint.init_from`` parameters)."""
    own = run_dir / CHECKPOINT_DIR
    if fresh and own.is_dir() and any(p.name.isdigit() for p in own.iterdir()):
        latest = max(int(p.name) for p in own.iterdir() if p.name.isdigit())
        raise ConfigError("--fresh", f"{run_dir} already holds checkpoints (latest: step {latest}); use "
                          "another run.dir, or drop --fresh to resume from them")
    config = to_dict(cfg)
    restored = None
    if checkpoints is not None and not fresh:
        restored = checkpoints.restore_latest(trainer.abstract_state(), field="run.dir", config=config,
                                              layer_order=trainer.layer_order, move_unreadable=True)
    if restored is None and cfg.checkpoint.restore_from is not None:
        restored = _restore_from(cfg, trainer, config)
    if restored is not None:
        if restored.step > cfg.train.steps:
            raise ConfigError("train.steps", f"is {cfg.train.steps}, but checkpoint {restored.path} is "
                              f"already at step {restored.step}; raise train.steps to continue it")
        differences = [d for d in config_differences(restored.meta.get("config", {}), config, _NUMERIC_SECTIONS)
                       if not d.startswith(_HARMLESS_FIELDS)]
        if differences:
            warn(f"checkpoint {restored.path} was written with another config; continuing with this one "
                 f"({'; '.join(differences)}). train.steps sets the length of the learning-rate schedule")
        note = (f"resumed from {restored.path} (step {restored.step}, written on mesh "
                f"{restored.meta.get('mesh')} with {restored.meta.get('devices')} devices)")
        return restored.state, restored.step, restored, note
    init_from = cfg.checkpoint.init_from
    load = None
    if init_from is not None and init_from.startswith(hf.INIT_PREFIX):  # checked before anything compiles
        load = hf.init_loader(init_from.removeprefix(hf.INIT_PREFIX), trainer)
    elif init_from is not None:  # checked before anything compiles
        target = check_params(init_from, trainer.abstract_params, trainer.param_shardings,
                              model_config=config["model"])
        load = functools.partial(load_params, init_from, target)
    state = trainer.init_state(cfg.train.seed)
    if load is not None:
        jax.tree.map(lambda array: array.delete(), state.params)  # free the fresh ones before loading
        nnx.replace_by_pure_dict(state.params, load())
        # Exported parameters are in model order; an interleaved pipeline stores stage order.
        state = reorder_layers(state, LayerOrder(num_layers=cfg.model.num_layers), trainer.layer_order)
    note = f"parameters initialised from {init_from}" if load is not None else None
    return state, 0, None, note


def _nonfinite(metrics: dict[str, jax.Array]) -> dict[str, float]:
    """The non-finite ones among a step's loss and gradient norm (blocks until the step is done)."""
    keys = ("loss", "grad_norm")
    values = jax.device_get({key: metrics[key] for key in keys})
    return {key: float(values[key]) for key in keys if not math.isfinite(values[key])}


def train(cfg: Config, *, print_sharding: bool = False, fresh: bool = False,
          devices: Sequence[jax.Device] | None = None,
          command: str = "python -m meshtrain.train") -> dict[str, object]:
    """Runs ``cfg`` to completion, resuming from ``run.dir``'s checkpoints; returns the summary.

    Args:
      fresh: refuse to resume (ConfigError when run.dir already holds checkpoints).
      devices: the devices of the mesh (default: all).
      command: how this program was launched, for the resume hint printed on preemption.

    Raises:
      ConfigError: bad input, found before anything is compiled.
      NonFiniteStop: ``train.on_nonfinite=stop`` met a non-finite loss or gradient norm, or a step
        left non-finite parameters or moments (nothing of it saved).
    """
    mesh = make_mesh(cfg.mesh, devices)
    if jax.process_count() > 1:
        distributed.print_startup(mesh)  # one line per process: rank, local devices, global mesh
    rules = cfg.sharding.resolve()
    trainer = Trainer(cfg.model, cfg.train, cfg.optimizer, rules, mesh, cfg.pipeline, cfg.zero, cfg.offload)
    if print_sharding:
        print("\n".join(filter(None, [trainer.pipeline_description,
                                       parameter_table(trainer.abstract_params, trainer.param_shardings)])))
        return {}
    for name in replicated_parameters(trainer.abstract_params, trainer.rules, mesh,
                                      cfg.sharding.replicated_warning_bytes):
        _log(f"warning: {name} stays fully replicated on mesh {dict(mesh.shape)} under rules {rules.name}")
    dataset = make_dataset(cfg.data, vocab_size=cfg.model.vocab_size, seq_len=cfg.model.seq_len)
    evaluator = (Evaluator(cfg.eval, cfg.data, dataset, trainer, vocab_size=cfg.model.vocab_size,
                           seq_len=cfg.model.seq_len) if cfg.eval.every > 0 else None)
    devices = list(mesh.devices.flat)
    # Logged once the checkpoints are checked, so that bad input there stays a one-line error.
    banner = [f"meshtrain: process {jax.process_index()}/{jax.process_count()}, {len(devices)} x "
              f"{devices[0].device_kind}, mesh (data, fsdp, tensor, stage) = {mesh_shape(mesh)}, rules "
              f"{rules.name}, {cfg.model.num_params:,} parameters, precision {cfg.train.precision.value}",
              trainer.pipeline_description, dataset.describe(), evaluator and evaluator.describe(),
              DOCUMENT_ATTENTION_NOTE if cfg.data.packing is Packing.DOCUMENTS else ""]

    run_dir = pathlib.Path(cfg.run.dir)
    lock = _hold(run_dir)  # before anything is written there
    checkpoints = None
    try:
        if cfg.checkpoint.enabled:
            checkpoints = RunCheckpoints(run_dir / CHECKPOINT_DIR, keep=cfg.checkpoint.keep,
                                         async_save=cfg.checkpoint.async_save)
        with _Preemption() as preemption:
            return _run(cfg, trainer, dataset, evaluator, mesh, run_dir, checkpoints, preemption, fresh=fresh,
                        command=command, banner=banner)
    finally:
        try:
            if checkpoints is not None:
                checkpoints.close()  # waits for a save in flight
        finally:
            lock.release()


def _hold(run_dir: pathlib.Path) -> RunLock:
    """``run_dir``'s lock, taken by process 0; every process raises the same one-line error if it is
    held by another live run."""
    lock, error = RunLock(run_dir), None
    if jax.process_index() == 0:
        try:
            lock.acquire()
        except ConfigError as err:
            error = err
    if _any_process(error is not None):
        raise error or ConfigError("run.dir", f"{run_dir} is in use by another run (see process 0)")
    return lock


def _stopped_by(err: DataChanged, saver: _Saver, done: int, state, metrics: Metrics) -> ConfigError:
    """Saves the state after step ``done`` and returns the one-line error to stop with."""
    where = saver.save_before_stopping(done, state, metrics, f"the state after step {done}")
    return ConfigError(err.field, f"{err.message}; {where}; restore the file and resume")


def _record_tokenizer(dataset, run_dir: pathlib.Path) -> None:
    """Copies the tokenizer the data was made with to ``run_dir/tokenizer.json`` (where
    ``meshtrain.generate --tokenizer auto`` looks), replacing an older copy only by a new file."""
    if dataset.tokenizer_file is None:
        return
    target = run_dir / TOKENIZER_FILE
    if not target.is_file() or target.read_bytes() != pathlib.Path(dataset.tokenizer_file).read_bytes():
        partial = target.with_name(target.name + ".tmp")
        shutil.copyfile(dataset.tokenizer_file, partial)
        os.replace(partial, target)


def _run(cfg: Config, trainer: Trainer, dataset, evaluator: Evaluator | None, mesh, run_dir: pathlib.Path,
         checkpoints: RunCheckpoints | None, preemption: _Preemption, *, fresh: bool, command: str,
         banner: list[str]) -> dict[str, object]:
    steps, batch_size = cfg.train.steps, cfg.train.batch_size
    state, start, restored, note = _initial_state(cfg, trainer, checkpoints, run_dir, fresh)
    for line in [*banner, note]:
        if line:
            _log(line)
    if start == steps:
        _log(f"{restored.path} is already at the last step ({steps}); nothing to train")
        return {"steps": steps, "resumed_from": start, "checkpoint": str(restored.path)}
    if jax.process_index() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        _record_tokenizer(dataset, run_dir)

    batch = global_batch(dataset, start, batch_size, trainer.batch_sharding)
    compile_start = time.perf_counter()
    train_step = trainer.train_step.lower(state, batch).compile()
    compile_s = time.perf_counter() - compile_start
    memory = train_step.memory_analysis()
    _log(f"compiled in {compile_s:.1f} s; per device: arguments {format_bytes(memory.argument_size_in_bytes)}, "
         f"temporaries {format_bytes(memory.temp_size_in_bytes)}")

    logger = MetricsLogger(run_dir, steps, is_primary=jax.process_index() == 0,
                           tensorboard=cfg.run.tensorboard)
    devices = list(mesh.devices.flat)
    reporter = _StepReporter(cfg, logger, num_devices=len(devices),
                             peak_tflops=peak_bf16_tflops(devices[0].device_kind), start=start)
    saver = _Saver(cfg, checkpoints, mesh)
    stop_on_nonfinite = cfg.train.on_nonfinite is NonFinitePolicy.STOP
    previous, unchecked, saved, preempted, eval_metrics = None, None, None, False, {}
    with contextlib.ExitStack() as on_exit:
        # Idempotent: the normal path closes it with the summary first; an error path writes
        # summary.json marked as stopped, and prints no normal-looking summary.
        on_exit.callback(logger.close, {"stopped_by_error": True}, print_summary=False)
        profiler = _Profiler(cfg.train.profile_range, run_dir / PROFILE_DIR, start)
        on_exit.callback(profiler.stop)
        for step in range(start, steps):
            profiler.before(step + 1)
            state, metrics = train_step(state, batch)  # dispatched asynchronously
            done = step + 1
            profiler.after(done, metrics)
            if done < steps:
                try:
                    batch = global_batch(dataset, done, batch_size, trainer.batch_sharding)  # overlaps step
                except DataChanged as err:
                    raise _stopped_by(err, saver, done, state, metrics) from None
            if previous is not None:
                reporter.report(*previous)  # reads step N-1 while step N runs
            previous = (step, metrics)
            if unchecked is not None:
                saver.check_applied(*unchecked)  # step N-1 while step N runs
            unchecked = (done, metrics)
            # With `stop`, step N is checked before step N+1 is dispatched, so the state saved is the
            # one the bad step left (its update skipped): the last good parameters and moments.
            bad = _nonfinite(metrics) if stop_on_nonfinite else {}
            if stop_on_nonfinite and _any_process(bool(bad)):
                reporter.report(step, metrics, force=True)
                where = saver.save_before_stopping(done, state, metrics, "the last good state")
                values = ", ".join(f"{key} {value}" for key, value in bad.items()) or "non-finite values"
                raise NonFiniteStop(f"train.on_nonfinite=stop: step {done} had {values}; its update "
                                    f"was skipped and {where}")
            if evaluator is not None and cfg.eval.due(done, steps):
                if previous is not None:
                    reporter.report(*previous)  # the train line of this step first
                    previous = None
                eval_start = time.perf_counter()
                try:
                    eval_metrics = evaluator.run(state.params)
                except DataChanged as err:
                    raise _stopped_by(err, saver, done, state, metrics) from None
                reporter.exclude(time.perf_counter() - eval_start)
                logger.log(done, eval_metrics)
            preempted = done < steps and preemption.requested  # the last step ends the run anyway
            if preempted or done == steps or saver.due(done):
                saved = saver.save(done, state, metrics)
            if preempted:
                reporter.report(step, metrics, force=True)
                previous = None
                break
        if previous is not None:
            reporter.report(*previous)
        if unchecked is not None:
            saver.check_applied(*unchecked)
        if checkpoints is not None:
            checkpoints.wait()

        final = reporter.final_metrics
        summary = {"final_loss": final.get("loss"), "entropy_floor": dataset.entropy_floor,
                   "skipped_steps": int(final.get("skipped_steps", 0)), "compile_s": round(compile_s, 2),
                   "mesh": dict(mesh.shape), "rules": trainer.rules.name, "parameters": cfg.model.num_params,
                   "pipeline": trainer.pipeline_description or None,
                   "argument_bytes_per_device": memory.argument_size_in_bytes,
                   "temp_bytes_per_device": memory.temp_size_in_bytes,
                   "resumed_from": start if restored is not None else None,
                   "checkpoint": None if saved is None else str(saved), "preempted": preempted,
                   **eval_metrics}
        logger.close(summary)
    if preempted:
        done = int(jax.device_get(state.step))
        resume = f"{command} --config {shlex.quote(str(run_dir / 'config.yaml'))} run.dir={shlex.quote(str(run_dir))}"
        where = f"saved to {saved}" if saved is not None else "not saved (checkpoint.enabled=false)"
        _log(f"preempted at step {done} ({where}); resume with: {resume}")
    return summary


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parse_args(argv)
        command = "python -m meshtrain.train"
        if args.host_devices is not None:
            use_host_devices(args.host_devices)
            command += f" --host-devices {args.host_devices}"
        else:  # GPU runs: the recommended XLA flags (meshtrain/xla_flags.py), before backends start
            apply_recommended()
        cfg = load_config(args.config, args.overrides)
        if args.print_config:
            print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
        else:
            distributed.initialize(_distributed_flags(args, cfg.distributed))  # before JAX's backends start
            train(cfg, print_sharding=args.print_sharding, fresh=args.fresh, command=command)
        sys.stdout.flush()  # a closed pipe fails here, inside the handler below, not at exit
    except SaveFailed as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        if err.background:  # orbax's writer threads still fail: leave before they print at shutdown
            sys.stdout.flush()
            os._exit(EXIT_USER_ERROR)
        return EXIT_USER_ERROR
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    except NonFiniteStop as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_NONFINITE
    except MemoryError:
        print(f"error: memory: {HOST_MEMORY_MESSAGE}", file=sys.stderr)
        return EXIT_USER_ERROR
    except BrokenPipeError:  # --print-config / --print-sharding piped into `head`: the reader is done
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())

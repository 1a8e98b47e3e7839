"""The training loop: ``train(cfg)`` runs a config to completion, resuming from ``run.dir``.

The loop owns the order of events only: dispatch step N, fetch batch N+1, then let each policy
(``meshtrain.policies``) handle step N-1 while step N runs on the devices. What happens around the
steps (logging, saving, checks, evaluation, preemption, profiling, and whatever a caller adds) is a
``Policy``. A run resumes from the newest complete checkpoint in ``run.dir/checkpoints``
(``meshtrain.resume``); SIGTERM/SIGINT finish the current step, save, and return
(``summary["preempted"]``); a non-finite step raises ``NonFiniteStop`` (docs/checkpoints.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import shlex
import shutil
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
import yaml

from meshtrain import distributed
from meshtrain.checkpoint import CHECKPOINT_DIR, RunCheckpoints
from meshtrain.config import Config, to_dict
from meshtrain.data import Packing, global_batch, make_dataset
from meshtrain.data.chat_template import CHAT_TEMPLATE_FILE
from meshtrain.data.dataset import TokenDataset
from meshtrain.data.sources import DataChanged
from meshtrain.data.tokenizer import TOKENIZER_FILE
from meshtrain.distributed import log
from meshtrain.errors import ConfigError, writable_directory
from meshtrain.evaluation import Evaluator
from meshtrain.loss import Batch
from meshtrain.mesh import device_memory_bytes, make_mesh, mesh_shape
from meshtrain.metrics import MetricsLogger, format_bytes, peak_bf16_tflops
from meshtrain.parallel.sharding import parameter_table, replicated_parameters
from meshtrain.planner.constants import Compiler
from meshtrain.planner.estimate import layout_estimate
from meshtrain.planner.roofline import Hardware
from meshtrain.policies import (PROFILE_DIR, AppliedStateCheck, Evaluation, NonFiniteGuard, Policy, Preemption,
                                Profiler, Reporter, Run, Saver, SkipLimit, StepOutput, any_process, data_changed)
from meshtrain.resume import initial_state
from meshtrain.run_lock import RunLock
from meshtrain.trackers import Status, check_installed, close_trackers, open_trackers
from meshtrain.train_config import NonFinitePolicy
from meshtrain.trainer import Trainer, TrainState



def run_loop(train_step: Callable, state: TrainState, batch: Batch, next_batch: Callable[[int], Batch],
             run: Run, policies: Sequence[Policy]) -> TrainState:
    """Steps ``run.start`` .. ``run.steps`` (``next_batch(n)``: the batch of step n, 0-based), each
    policy called after each dispatch; returns the last state. A stop a policy asks for ends the run
    after that step: ``on_stop`` of every policy, then ``run.stop.error`` is raised if it has one."""
    for step in range(run.start, run.steps):
        state, metrics = train_step(state, batch)  # dispatched asynchronously
        run.previous, run.current = run.current, StepOutput(step + 1, state, metrics)
        if step + 1 < run.steps:
            try:
                batch = next_batch(step + 1)  # overlaps the step
            except DataChanged as err:
                run.request_stop(data_changed(err, step + 1))
        for policy in policies:
            policy.after_step(run)
        if run.stop is not None:
            for policy in policies:
                policy.on_stop(run)
            if run.stop.error is not None:
                raise run.stop.error(run.where_saved)
            break
    for policy in policies:
        policy.finish(run)
    return state


# A run whose estimated per-device memory (meshtrain.plan's model) exceeds the devices' memory this
# many times is refused before anything is allocated: far beyond the estimate's error (within a
# few tens of percent of XLA), so only shapes that cannot run (seq_len 2**31, 10**9 layers) are.
MEMORY_REFUSAL_FACTOR = 4


def _check_memory(cfg: Config, trainer: Trainer) -> None:
    """One line, before any array is allocated, for a run that could not fit ``MEMORY_REFUSAL_FACTOR``
    times over (``meshtrain.planner.estimate``'s estimate of this layout against the device memory)."""
    device = trainer.mesh.devices.flat[0]
    available = device_memory_bytes(device)
    if available is None:
        return
    est = layout_estimate(trainer.layout, np.dtype(cfg.train.compute_dtype).itemsize,
                          Hardware(compiler=Compiler.of_platform(device.platform)))
    if est.total > MEMORY_REFUSAL_FACTOR * available:
        state, working = est.params + est.grads + est.optimizer, est.activations + est.temporaries
        raise ConfigError("model", f"this run needs about {format_bytes(est.total)} per device ({format_bytes(state)} "
                          f"of parameters, gradients and optimizer state, {format_bytes(working)} of activations) "
                          f"and a device has {format_bytes(available)}; shrink the model, model.seq_len or "
                          "train.batch_size, or find a layout with python -m meshtrain.plan")


def train(cfg: Config, *, print_sharding: bool = False, fresh: bool = False,
          devices: Sequence[jax.Device] | None = None, command: str = "python -m meshtrain.train",
          policies: Sequence[Policy] = ()) -> dict[str, object]:
    """Runs ``cfg`` to completion, resuming from ``run.dir``'s checkpoints; returns the summary.

    Args:
      fresh: refuse to resume (ConfigError when run.dir already holds checkpoints).
      devices: the devices of the mesh (default: all).
      command: how this program was launched, for the resume hint printed on preemption.
      policies: more policies, called after the built-in ones.

    Raises:
      ConfigError: bad input, found before anything is compiled.
      NonFiniteStop: ``train.on_nonfinite=stop`` met a non-finite loss or gradient norm, or a step
        left non-finite parameters or moments (nothing of it saved).
    """
    check_installed(cfg.run.loggers)  # a logger named but not installed: one line, before anything else
    mesh = make_mesh(cfg.mesh, devices)
    if jax.process_count() > 1:
        distributed.print_startup(mesh)  # one line per process: rank, local devices, global mesh
    trainer = Trainer(cfg.layout(mesh.shape), mesh, cfg.optimizer)
    if print_sharding:
        print("\n".join(filter(None, [trainer.pipeline_description,
                                       parameter_table(trainer.abstract_params, trainer.param_shardings)])))
        return {}
    _check_memory(cfg, trainer)
    for name in replicated_parameters(trainer.abstract_params, trainer.rules, mesh,
                                      cfg.sharding.replicated_warning_bytes):
        log(f"warning: {name} stays fully replicated on mesh {dict(mesh.shape)} under rules {trainer.rules.name}")
    kernels = trainer.describe_kernels(packed=cfg.data.packing is Packing.DOCUMENTS)
    dataset = make_dataset(cfg.data, vocab_size=cfg.model.vocab_size, seq_len=cfg.model.seq_len)
    evaluator = (Evaluator(cfg.eval, cfg.data, dataset, trainer, vocab_size=cfg.model.vocab_size,
                           seq_len=cfg.model.seq_len) if cfg.eval.every > 0 else None)
    devices = list(mesh.devices.flat)
    # Logged once the checkpoints are checked, so that bad input there stays a one-line error.
    banner = [f"meshtrain: process {jax.process_index()}/{jax.process_count()}, {len(devices)} x "
              f"{devices[0].device_kind}, mesh (data, fsdp, tensor, stage) = {mesh_shape(mesh)}, rules "
              f"{trainer.rules.name}, {cfg.model.num_params:,} parameters, precision {cfg.train.precision.value}",
              *kernels, dataset.describe(), evaluator and evaluator.describe()]
    setup = _Setup(cfg, trainer, dataset, evaluator, pathlib.Path(cfg.run.dir), banner)
    run_dir = setup.run_dir
    lock = _hold(run_dir)  # before anything is written there
    checkpoints = None
    try:
        if cfg.checkpoint.enabled:
            # A file where the checkpoints go: one line now, not at the first save after training steps.
            writable_directory(run_dir / CHECKPOINT_DIR, "run.dir", create=False)
            checkpoints = RunCheckpoints(run_dir / CHECKPOINT_DIR, keep=cfg.checkpoint.keep,
                                         async_save=cfg.checkpoint.async_save)
        with Preemption() as preemption:
            return _run(setup, checkpoints, preemption, policies, fresh=fresh, command=command)
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
            _refuse_linked_files(run_dir)
        except ConfigError as err:
            lock.release()
            error = err
    if any_process(error is not None):
        raise error or ConfigError("run.dir", f"{run_dir} is in use by another run (see process 0)")
    return lock


def _refuse_linked_files(run_dir: pathlib.Path) -> None:
    """``ConfigError("run.dir")`` if a symbolic link stands in ``run_dir`` where the run writes a file
    (``metrics.jsonl``, ``config.yaml``, ``summary.json``, a plot, a partial file, ...): the run would
    write through it, outside ``run_dir`` (a shared directory, an unpacked archive). A link to a
    directory (``checkpoints`` on another disk) is left alone."""
    for entry in sorted(run_dir.iterdir()):
        if entry.is_symlink() and not entry.is_dir():
            raise ConfigError("run.dir", f"{entry} is a symbolic link (to {os.readlink(entry)}); the run writes "
                              "its files only inside run.dir: remove the link or choose another run.dir")


def _record_tokenizer(dataset: TokenDataset, run_dir: pathlib.Path) -> None:
    """Copies the tokenizer the data was made with to ``run_dir/tokenizer.json`` (where
    ``meshtrain.generate --tokenizer auto`` looks), and the chat template beside it (a corpus
    ``prepare-sft`` made: what ``generate --chat`` renders), replacing an older copy only by a new file."""
    if dataset.tokenizer_file is None:
        return
    source = pathlib.Path(dataset.tokenizer_file)
    for name, origin in ((TOKENIZER_FILE, source), (CHAT_TEMPLATE_FILE, source.parent / CHAT_TEMPLATE_FILE)):
        target = run_dir / name
        if origin.is_file() and (not target.is_file() or target.read_bytes() != origin.read_bytes()):
            partial = target.with_name(target.name + ".tmp")
            shutil.copyfile(origin, partial)
            os.replace(partial, target)


def _open_trackers(cfg: Config, run_dir: pathlib.Path, *, resumed: bool) -> list:
    """Process 0's trackers (``run.loggers``), opened before compiling so that one that cannot start
    (W&B not logged in) says so at once, on every process; a run resumed from a checkpoint continues
    the tracked runs whose ids ``run_dir/trackers.json`` keeps."""
    trackers, error = [], None
    if jax.process_index() == 0:
        try:
            trackers = open_trackers(cfg.run.loggers, run_dir, to_dict(cfg), project=cfg.run.project,
                                     name=cfg.run.name, resumed=resumed)
        except ConfigError as err:
            error = err
    if any_process(error is not None):
        raise error or ConfigError("run.loggers", "a tracker could not start its run (see process 0)")
    return trackers


@dataclasses.dataclass(frozen=True)
class _Setup:
    """What a run is built from, checked before anything is written."""

    cfg: Config
    trainer: Trainer
    dataset: TokenDataset
    evaluator: Evaluator | None
    run_dir: pathlib.Path
    banner: list[str]  # the lines logged once the first state is known


def _run(setup: _Setup, checkpoints: RunCheckpoints | None, preemption: Preemption, extra: Sequence[Policy], *,
         fresh: bool, command: str) -> dict[str, object]:
    """The first state, the compiled step, the policies and the loop; the run's summary."""
    cfg, trainer, dataset, evaluator, run_dir = setup.cfg, setup.trainer, setup.dataset, setup.evaluator, setup.run_dir
    steps, batch_size = cfg.train.steps, cfg.train.batch_size
    start = initial_state(cfg, trainer, checkpoints, run_dir, fresh)
    for line in [*setup.banner, start.note]:
        if line:
            log(line)
    if start.step == steps:
        log(f"{start.restored.path} is already at the last step ({steps}); nothing to train")
        return {"steps": steps, "resumed_from": start.step, "checkpoint": str(start.restored.path)}
    if jax.process_index() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        _record_tokenizer(dataset, run_dir)

    trackers = _open_trackers(cfg, run_dir, resumed=start.restored is not None)
    next_batch = lambda step: global_batch(dataset, step, batch_size, trainer.batch_sharding)
    try:
        batch = next_batch(start.step)
        compile_start = time.perf_counter()
        train_step = trainer.train_step.lower(start.state, batch).compile()
        compile_s = time.perf_counter() - compile_start
    except BaseException:
        close_trackers(trackers, Status.FAILED)
        raise
    memory = train_step.memory_analysis()
    log(f"compiled in {compile_s:.1f} s; per device: arguments {format_bytes(memory.argument_size_in_bytes)}, "
        f"temporaries {format_bytes(memory.temp_size_in_bytes)}")

    mesh = trainer.mesh
    logger = MetricsLogger(run_dir, steps, is_primary=jax.process_index() == 0, tensorboard=False, trackers=trackers,
                           resumed_from=start.step if start.restored is not None else None)
    devices = list(mesh.devices.flat)
    reporter = Reporter(cfg, logger, num_devices=len(devices), peak_tflops=peak_bf16_tflops(devices[0].device_kind),
                        start=start.step)
    saver = Saver(cfg, checkpoints, mesh)
    evaluation = Evaluation(evaluator, cfg, reporter, logger) if evaluator is not None else None
    run = Run(steps, start.step)
    with contextlib.ExitStack() as on_exit:
        # Idempotent: the normal path closes it with the summary first; an error path writes
        # summary.json marked as stopped, and prints no normal-looking summary.
        on_exit.callback(logger.close, {"stopped_by_error": True}, print_summary=False)
        policies = [Profiler(cfg.train.profile_range, run_dir / PROFILE_DIR, start.step), reporter,
                    AppliedStateCheck(checkpoints),
                    NonFiniteGuard() if cfg.train.on_nonfinite is NonFinitePolicy.STOP
                    else SkipLimit(cfg.train.max_consecutive_skips, checkpoints) if cfg.train.max_consecutive_skips
                    else None,
                    evaluation, preemption, saver, *extra]
        policies = [policy for policy in policies if policy is not None]
        for policy in reversed(policies):
            on_exit.callback(policy.close)
        state = run_loop(train_step, start.state, batch, next_batch, run, policies)

        preempted = run.stop is not None and run.stop.preempted
        summary = {"final_loss": reporter.final_metrics.get("loss"), "entropy_floor": dataset.entropy_floor,
                   "skipped_steps": int(reporter.final_metrics.get("skipped_steps", 0)),
                   "compile_s": round(compile_s, 2), "mesh": dict(mesh.shape), "rules": trainer.rules.name,
                   "parameters": cfg.model.num_params, "pipeline": trainer.pipeline_description or None,
                   "argument_bytes_per_device": memory.argument_size_in_bytes,
                   "temp_bytes_per_device": memory.temp_size_in_bytes,
                   "resumed_from": start.step if start.restored is not None else None,
                   "checkpoint": None if saver.saved is None else str(saver.saved), "preempted": preempted,
                   **(evaluation.metrics if evaluation is not None else {})}
        logger.close(summary)
    if preempted:
        done = int(jax.device_get(state.step))
        resume = f"{command} --config {shlex.quote(str(run_dir / 'config.yaml'))} run.dir={shlex.quote(str(run_dir))}"
        where = f"saved to {saver.saved}" if saver.saved is not None else "not saved (checkpoint.enabled=false)"
        log(f"preempted at step {done} ({where}); resume with: {resume}")
    return summary

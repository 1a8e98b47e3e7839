"""The runtime policies of the training loop (``meshtrain.loop``), one object each, and what they see.

Every policy sees the loop through ``Run`` and implements what it needs of ``Policy``:
``after_step`` once step N is dispatched (so that reading step N-1 overlaps step N on the devices),
``on_stop`` when a policy ended the run early, ``finish`` after the last step, ``close`` always. A
new behaviour (a tracker, a sample generator) is a new ``Policy`` passed to ``meshtrain.loop.train``,
not an edit of the loop. ``train`` calls the built-in ones in this order:

    Profiler -> Reporter -> AppliedStateCheck -> NonFiniteGuard | SkipLimit -> Evaluation -> Preemption -> Saver

so a step's log line is written before the check or the evaluation that follows it, and the saver
sees every stop the others asked for.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
import threading
import time
from collections.abc import Callable

import jax
import numpy as np

from meshtrain.checkpoint import RunCheckpoints, checkpoint_meta
from meshtrain.config import Config, to_dict
from meshtrain.data.sources import DataChanged
from meshtrain.distributed import log
from meshtrain.errors import ConfigError, writable_directory
from meshtrain.evaluation import Evaluator
from meshtrain.metrics import MetricsLogger, mfu
from meshtrain.parallel.layer_order import LayerOrder
from meshtrain.trainer import Metrics, TrainState
from models.api import family_of


@dataclasses.dataclass
class StepOutput:
    """A dispatched step: its outputs may still be computing (reading them waits)."""

    done: int  # steps completed with this one
    state: TrainState
    metrics: Metrics


@dataclasses.dataclass
class Stop:
    """Why a run ends before ``train.steps``: the state the last step left is saved (``what`` names
    it in messages; None: nothing is saved), then the run returns (``error`` None) or raises
    ``error(where it was saved)``."""

    what: str | None
    error: Callable[[str], Exception] | None = None
    preempted: bool = False


@dataclasses.dataclass
class Run:
    """What the policies see of the loop: the step just dispatched and the one before it."""

    steps: int  # train.steps
    start: int  # steps done before this run (a resume)
    current: StepOutput | None = None
    previous: StepOutput | None = None
    stop: Stop | None = None
    where_saved: str = ""  # set when a stop's state is saved

    def request_stop(self, stop: Stop) -> None:
        """Ends the run after this step (the first request wins)."""
        if self.stop is None:
            self.stop = stop


class Policy:
    """One runtime behaviour of the loop; each hook does nothing unless overridden."""

    def after_step(self, run: Run) -> None:
        """Step ``run.current`` was dispatched and may still run; ``run.previous`` is done."""

    def on_stop(self, run: Run) -> None:
        """A policy asked to stop (``run.stop``) after ``run.current``."""

    def finish(self, run: Run) -> None:
        """After the last step of the run (also after a preemption)."""

    def close(self) -> None:
        """Always, last, also when the run fails: release what the policy holds."""


class NonFiniteStop(Exception):
    """A non-finite step stops the run (exit status 3): ``train.on_nonfinite=stop`` met a non-finite
    loss or gradient norm, or (under either policy) an update left non-finite parameters or moments."""


def any_process(flag: bool) -> bool:
    """Whether ``flag`` is set on any process (so that every process takes the same branch)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils
    return bool(np.any(multihost_utils.process_allgather(np.array(flag))))


class Reporter(Policy):
    """Logs step N-1's metrics while step N runs, when due (``train.log_every``, the first and the
    last step), with time, tokens/s, TFLOP/s and MFU; a stopped run's last step always."""

    def __init__(self, cfg: Config, logger: MetricsLogger, num_devices: int, peak_tflops: float | None,
                 start: int = 0):
        self.steps, self.log_every, self.logger, self.start = cfg.train.steps, cfg.train.log_every, logger, start
        self.tokens_per_step = cfg.train.batch_size * cfg.model.seq_len
        self.flops_per_step = self.tokens_per_step * family_of(cfg.model).costs(cfg.model).flops_per_token()
        self.num_devices, self.peak_tflops = num_devices, peak_tflops
        self.last_time, self.last_done = time.perf_counter(), start
        self.final_metrics: dict[str, float | list[float]] = {}  # the last logged values (the last step's)
        self.alerts = dict(family_of(cfg.model).alerts)  # warned about once each, then dropped

    def exclude(self, seconds: float) -> None:
        """Leaves ``seconds`` spent on other work (an evaluation) out of the step times."""
        self.last_time += seconds

    def report(self, step: StepOutput | None, *, force: bool = False) -> None:
        """Logs ``step`` if it is due (or ``force``) and not logged yet (blocks until it is done)."""
        if step is None:
            return
        done = step.done
        if not (force or done == self.start + 1 or done % self.log_every == 0 or done == self.steps):
            return
        if done <= self.last_done:  # logged already (or a step before the last logged one)
            return
        values = {key: value.tolist() if value.ndim else float(value)
                  for key, value in jax.device_get(step.metrics).items()}
        now = time.perf_counter()
        step_time = (now - self.last_time) / (done - self.last_done)
        self.last_time, self.last_done = now, done
        tflops = self.flops_per_step / step_time / self.num_devices / 1e12
        self.logger.log(done, {**values, "tokens_per_sec": self.tokens_per_step / step_time,
                               "step_time_s": step_time, "tflops_per_device": tflops,
                               "mfu": mfu(tflops, self.peak_tflops)})
        self.final_metrics = values
        for name in [name for name in self.alerts if values.get(name, 0) > 0]:
            log(f"warning: {name} = {values[name]:.4g} at step {done}: {self.alerts.pop(name)}")

    def after_step(self, run: Run) -> None:
        self.report(run.previous)

    def on_stop(self, run: Run) -> None:
        self.report(run.previous)
        self.report(run.current, force=True)

    def finish(self, run: Run) -> None:
        self.report(run.previous)
        self.report(run.current)


def skipped(step: StepOutput) -> bool:
    """Whether ``step`` skipped its update (a non-finite loss or gradient norm); waits for it."""
    return bool(jax.device_get(step.metrics["update_skipped"]))


def newest_checkpoint(checkpoints: RunCheckpoints | None) -> str:
    """Where the last good state is, for the line a stopped run ends with."""
    steps = [] if checkpoints is None else checkpoints.steps()
    return (f"the newest checkpoint, {checkpoints.path(steps[-1])}, holds the last good state" if steps
            else "no checkpoint was saved")


def check_applied(step: StepOutput, checkpoints: RunCheckpoints | None) -> None:
    """NonFiniteStop, with nothing saved, when ``step`` left a non-finite parameter or moment (waits
    for that step). Its loss and gradients were finite, so the update was applied in place: the
    optimizer's arithmetic overflowed. The value is replicated, so every process takes the same
    branch."""
    if bool(jax.device_get(step.metrics["state_finite"])):
        return
    raise NonFiniteStop(f"step {step.done} left non-finite parameters or optimizer moments from a finite loss "
                        f"and gradients (the optimizer's arithmetic overflowed: check the optimizer.* "
                        f"values); its state was not saved and {newest_checkpoint(checkpoints)}")


class AppliedStateCheck(Policy):
    """Step N-1's ``state_finite``, read while step N runs (``check_applied``); the last step's at the end."""

    def __init__(self, checkpoints: RunCheckpoints | None):
        self.checkpoints = checkpoints

    def after_step(self, run: Run) -> None:
        if run.previous is not None:
            check_applied(run.previous, self.checkpoints)

    def finish(self, run: Run) -> None:
        check_applied(run.current, self.checkpoints)


class NonFiniteGuard(Policy):
    """``train.on_nonfinite=stop``: step N's loss and gradient norm are read before step N+1 is
    dispatched; a non-finite one stops the run, saving the state that step left (its update
    skipped: the last good parameters and moments), exit status 3."""

    KEYS = ("loss", "grad_norm")

    def after_step(self, run: Run) -> None:
        values = jax.device_get({key: run.current.metrics[key] for key in self.KEYS})
        bad = {key: float(values[key]) for key in self.KEYS if not np.isfinite(values[key])}
        if any_process(bool(bad)):
            done = run.current.done
            found = ", ".join(f"{key} {value}" for key, value in bad.items()) or "non-finite values"
            run.request_stop(Stop("the last good state", lambda where: NonFiniteStop(
                f"train.on_nonfinite=stop: step {done} had {found}; its update was skipped and {where}")))


class SkipLimit(Policy):
    """``train.on_nonfinite=skip`` goes on over non-finite steps, but not forever: once
    ``train.max_consecutive_skips`` steps in a row skipped their update (read while the next one
    runs), the run stops, exit 3, saving nothing. The saver writes no checkpoint of a skipped step,
    so checkpoint rotation keeps those from before the run of skips."""

    def __init__(self, limit: int, checkpoints: RunCheckpoints | None):
        self.limit, self.checkpoints, self.in_a_row = limit, checkpoints, 0

    def after_step(self, run: Run) -> None:
        if run.previous is None:
            return
        self.in_a_row = self.in_a_row + 1 if skipped(run.previous) else 0
        if self.in_a_row >= self.limit:
            last, first, limit = run.previous.done, run.previous.done - self.in_a_row + 1, self.limit
            run.request_stop(Stop(None, lambda where: NonFiniteStop(
                f"train.max_consecutive_skips={limit}: steps {first}-{last} all skipped their update (non-finite "
                f"loss or gradients); nothing was saved and {where}; check the data and optimizer.* (or raise "
                "the limit, 0 for none)")))


def data_changed(err: DataChanged, done: int) -> Stop:
    """The stop of a run whose data files changed under it: save the state after step ``done``,
    then one line naming the file."""
    return Stop(f"the state after step {done}",
                lambda where: ConfigError(err.field, f"{err.message}; {where}; restore the file and resume"))


class Evaluation(Policy):
    """Held-out evaluation when ``eval.every`` says, and lm-eval's tasks when ``eval.harness`` says, on
    the state step N left (the step's own train line is logged first; the evaluation's time is left
    out of the step times). ``metrics``: the last value of each."""

    def __init__(self, evaluator: Evaluator, cfg: Config, reporter: Reporter, logger: MetricsLogger):
        self.evaluator, self.cfg, self.reporter, self.logger = evaluator, cfg, reporter, logger
        self.metrics: dict[str, float] = {}  # the last evaluation's

    def after_step(self, run: Run) -> None:
        done = run.current.done
        held_out = self.cfg.eval.due(done, run.steps)
        harness = self.evaluator.harness is not None and self.evaluator.harness.due(done, run.steps)
        if run.stop is not None or not (held_out or harness):
            return
        params = self.evaluator.model_params(run.current.state)
        self.reporter.report(run.current)
        start = time.perf_counter()
        metrics: dict[str, float] = {}
        if held_out:
            try:
                metrics = self.evaluator.run(params)
            except DataChanged as err:
                run.request_stop(data_changed(err, done))
                return
            if self.evaluator.sampler is not None:
                self.logger.log_samples(done, self.evaluator.sampler.run(params, seed=done))
        if harness:
            metrics |= self.evaluator.harness.run(params)
        self.reporter.exclude(time.perf_counter() - start)
        self.logger.log(done, metrics)
        self.metrics = {**self.metrics, **metrics}


class Preemption(Policy):
    """SIGTERM/SIGINT set a flag that the loop reads after each step; a second signal aborts at once.

    Python runs a signal's handler only between bytecodes of the main thread, and coalesces signals
    that arrive before it runs; so each delivery is also counted through ``signal.set_wakeup_fd`` (one
    byte per signal, written by the C-level handler at once): two signals that reach the process
    before the handler runs still abort. Only installed from the main thread; elsewhere it does
    nothing. As a policy: a requested stop ends the run after the current step, saved (exit 0).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: str | None = None
        self._previous: dict[int, object] = {}
        self._wakeup: tuple[int, int] | None = None  # (read end, write end)
        self._previous_wakeup = -1

    def __enter__(self) -> Preemption:
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
        log(f"received {name}: finishing the current step, then saving a checkpoint "
            f"(send {name} again to stop without saving)")

    @property
    def requested(self) -> bool:
        return any_process(self.received is not None)

    def after_step(self, run: Run) -> None:
        done = run.current.done
        if run.stop is None and done < run.steps and self.requested:  # the last step ends the run anyway
            run.request_stop(Stop(f"the state after step {done}", preempted=True))


PROFILE_DIR = "profile"  # under run.dir: jax.profiler traces (TensorBoard's profile plugin, Perfetto)


class Profiler(Policy):
    """Traces the steps of ``train.profile_steps`` (first, last; 1-based) with ``jax.profiler`` into
    ``run.dir/profile``: started before the first is dispatched, stopped once the last is done."""

    def __init__(self, steps: tuple[int, int] | None, log_dir: pathlib.Path, start: int):
        self.steps, self.log_dir, self.active = steps, log_dir, False
        if steps is not None and steps[1] <= start:
            log(f"train.profile_steps {steps[0]}-{steps[1]}: the run resumes after step {start}; not profiling")
            self.steps = None
        if self.steps is not None:
            writable_directory(log_dir, "train.profile_steps")  # before the first step, not mid-run
        self._start_before(start + 1)

    def _start_before(self, step: int) -> None:
        if self.steps is not None and not self.active and step >= self.steps[0]:
            jax.profiler.start_trace(str(self.log_dir), create_perfetto_trace=True)
            self.active = True

    def after_step(self, run: Run) -> None:
        done = run.current.done
        if self.active and done >= self.steps[1]:
            jax.block_until_ready(run.current.metrics)
            self.close()
            log(f"profile of steps {self.steps[0]}-{done} written to {self.log_dir} (tensorboard --logdir "
                f"{self.log_dir}, or open the perfetto_trace.json.gz in ui.perfetto.dev)")
            self.steps = None
        self._start_before(done + 1)

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False


class Saver(Policy):
    """Saves every ``checkpoint.every`` steps, every ``checkpoint.every_minutes``, after the last
    step, and when the run stops early (then waits for the save); writes the meta of each."""

    def __init__(self, cfg: Config, checkpoints: RunCheckpoints | None, mesh: jax.sharding.Mesh):
        self.cfg, self.checkpoints, self.mesh = cfg, checkpoints, mesh
        self.config_dict = to_dict(cfg)
        self.last_time = time.monotonic()
        self.last_step: int | None = None
        self.saved: pathlib.Path | None = None  # the newest checkpoint this run wrote
        self.deferred = False  # a save fell on a skipped step: it waits for the next applied one

    def due(self, done: int) -> bool:
        every, minutes = self.cfg.checkpoint.every, self.cfg.checkpoint.every_minutes
        by_time = minutes > 0 and any_process(time.monotonic() - self.last_time >= minutes * 60)
        return self.checkpoints is not None and ((every > 0 and done % every == 0) or by_time)

    def save(self, step: StepOutput) -> pathlib.Path | None:
        """Saves the state after ``step`` unless it is not finite (NonFiniteStop, nothing saved)."""
        if self.checkpoints is None:
            return None
        if self.last_step != step.done:
            check_applied(step, self.checkpoints)
            layer_order = LayerOrder.of_run(self.mesh.shape["stage"], self.cfg.pipeline.chunks_per_stage,
                                            self.cfg.model.num_layers)
            self.checkpoints.save(step.done, step.state, checkpoint_meta(
                step=step.done, config=self.config_dict, mesh=self.mesh, layer_order=layer_order,
                batch_size=self.cfg.train.batch_size, data_seed=self.cfg.data.seed, train_seed=self.cfg.train.seed))
            self.last_time, self.last_step = time.monotonic(), step.done
        self.saved = self.checkpoints.path(step.done)
        return self.saved

    def after_step(self, run: Run) -> None:
        """Saves when due, except a step that skipped its update: its save waits for the next step
        that applies one (so a run of skipped steps rotates no checkpoint out)."""
        done = run.current.done
        if run.stop is not None or not (self.deferred or done == run.steps or self.due(done)):
            return
        self.deferred = self.checkpoints is not None and skipped(run.current)
        if self.deferred:
            log(f"step {done} skipped its update: its checkpoint waits for the next step that applies one")
        else:
            self.save(run.current)

    def on_stop(self, run: Run) -> None:
        """Saves the state the last step left (unless the stop says not to) and waits for it;
        ``run.where_saved`` says where."""
        if run.stop.what is None:
            run.where_saved = newest_checkpoint(self.checkpoints)
            return
        path = self.save(run.current)
        if path is None:
            run.where_saved = "nothing was saved (checkpoint.enabled=false)"
            return
        self.checkpoints.wait()
        run.where_saved = f"{run.stop.what} was saved to {path}"

    def finish(self, run: Run) -> None:
        if self.deferred:
            log(f"the last step skipped its update: not saved; {newest_checkpoint(self.checkpoints)}")
        if self.checkpoints is not None:
            self.checkpoints.wait()

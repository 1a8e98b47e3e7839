"""Multi-process start-up through JAX's own distributed runtime (``jax.distributed.initialize``).

Where the four numbers come from, first match wins for each:

1. the ``distributed`` config section (or the CLI flags ``--coordinator``, ``--num-processes``,
   ``--process-id``, ``--local-device-ids``, which set it);
2. the environment variables ``JAX_COORDINATOR_ADDRESS`` (host:port) and ``JAX_LOCAL_DEVICE_IDS``,
   which JAX itself reads, and ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``, which JAX 0.10 does *not*
   read and meshtrain reads for it (Kubernetes and other hand-made launches);
3. JAX's cluster detection, in its order: Open MPI (``OMPI_MCA_orte_hnp_uri``), SLURM
   (``SLURM_JOB_ID``, ``SLURM_STEP_NODELIST``, ``SLURM_NTASKS``, ``SLURM_PROCID``,
   ``SLURM_LOCALID``; coordinator = first node of the step, port from the job id or
   ``JAX_COORDINATOR_PORT``), mpi4py (only with ``distributed.cluster_detection=mpi4py``), Cloud TPU,
   Kubernetes (needs the ``kubernetes`` package).

With none of them (no flags, no variables, not inside a multi-task SLURM/MPI job) the run is one
process and nothing is initialised. A SLURM step with one task is one process too.

Failure: every process beats in the coordination service's key-value store (:class:`PeerWatch`). A
process whose beats stop for ``heartbeat_timeout_s`` (killed, hung, host gone) is lost, and so is the
coordinator when a process cannot reach it that long: every other process prints one line naming
them and exits 1, whether it waits in a collective or not (a collective waiting on a killed peer
often never fails). JAX's own heartbeats (at three times the timeout) are the backstop: when they fire, JAX
aborts the process with a multi-line fatal log.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import re
import socket
import sys
import threading
import time

import jax

from meshtrain.errors import ConfigError

# Variables meshtrain reads for JAX (JAX 0.10 reads only the coordinator and JAX_LOCAL_DEVICE_IDS).
NUM_PROCESSES_ENV = "JAX_NUM_PROCESSES"
PROCESS_ID_ENV = "JAX_PROCESS_ID"
COORDINATOR_ENV = "JAX_COORDINATOR_ADDRESS"
_DETECTION_METHODS = ("ompi", "slurm", "mpi4py", "gke_tpu_cluster", "gce_tpu_cluster", "k8s", "deactivate")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """The ``distributed`` section: how this process joins the others (all optional).

    Attributes:
      coordinator: ``host:port`` of process 0's coordinator service (every process gives the same).
      num_processes: how many processes the run has.
      process_id: this process's rank in ``[0, num_processes)``; rank 0 runs the coordinator.
      local_device_ids: the local accelerators this process uses (indices among those that
        ``CUDA_VISIBLE_DEVICES`` leaves visible); default: all of them, or one per process under
        SLURM/Open MPI on GPUs (the task's local rank).
      cluster_detection: force one of JAX's detection methods (``slurm``, ``ompi``, ``mpi4py``,
        ``k8s``, ...), or ``deactivate`` to use only what is given explicitly.
      initialization_timeout_s: how long processes wait for each other at start-up.
      heartbeat_timeout_s: a process silent this long is declared dead and the others exit.
      shutdown_timeout_s: how long a finishing process waits for the others at exit.
    """

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None
    cluster_detection: str | None = None
    initialization_timeout_s: int = 300
    heartbeat_timeout_s: int = 60
    shutdown_timeout_s: int = 60

    def __post_init__(self):
        if self.coordinator is not None and not re.fullmatch(r"\S+:\d{1,5}", self.coordinator):
            raise ConfigError("coordinator", f"must be host:port, got {self.coordinator!r}")
        if self.num_processes is not None and self.num_processes < 1:
            raise ConfigError("num_processes", f"must be a positive integer, got {self.num_processes}")
        if self.process_id is not None and self.process_id < 0:
            raise ConfigError("process_id", f"must be a non-negative integer, got {self.process_id}")
        if (self.process_id is not None and self.num_processes is not None
                and self.process_id >= self.num_processes):
            raise ConfigError("process_id", f"is {self.process_id}, but num_processes is {self.num_processes}; "
                              f"ranks run from 0 to {self.num_processes - 1}")
        if self.local_device_ids is not None and any(i < 0 for i in self.local_device_ids):
            raise ConfigError("local_device_ids", f"must be non-negative, got {list(self.local_device_ids)}")
        if self.cluster_detection is not None and self.cluster_detection not in _DETECTION_METHODS:
            raise ConfigError("cluster_detection", f"{self.cluster_detection!r} is not one of "
                              f"{' | '.join(_DETECTION_METHODS)}")
        for name in ("initialization_timeout_s", "heartbeat_timeout_s", "shutdown_timeout_s"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be at least 1 second, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class Launch:
    """What ``initialize`` decided: the arguments handed to ``jax.distributed.initialize``, or
    ``None`` for a single process, and where they came from."""

    kwargs: dict | None
    source: str


def _env_int(environ, name: str) -> int | None:
    value = environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(name, f"must be an integer, got {value!r}") from None


def _cluster_tasks(environ) -> tuple[str, int] | None:
    """(name, number of tasks) of the SLURM step or Open MPI job this process runs in, if any."""
    if "OMPI_MCA_orte_hnp_uri" in environ and environ.get("OMPI_COMM_WORLD_SIZE"):
        return "Open MPI", int(environ["OMPI_COMM_WORLD_SIZE"])
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    if all(name in environ for name in slurm):
        return "SLURM", int(environ["SLURM_NTASKS"])
    return None


def launch_of(cfg: DistributedConfig, environ=None) -> Launch:
    """Decides, without starting anything, whether and how to call ``jax.distributed.initialize``."""
    environ = os.environ if environ is None else environ
    coordinator = cfg.coordinator or environ.get(COORDINATOR_ENV) or None
    num_processes = cfg.num_processes if cfg.num_processes is not None else _env_int(environ, NUM_PROCESSES_ENV)
    process_id = cfg.process_id if cfg.process_id is not None else _env_int(environ, PROCESS_ID_ENV)
    local_ids = cfg.local_device_ids
    explicit = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
    given = [name for name, value in explicit.items() if value is not None]
    cluster = _cluster_tasks(environ)
    detect = cfg.cluster_detection

    if not given and detect in (None, "deactivate") and (cluster is None or cluster[1] == 1):
        where = f"a {cluster[0]} job with one task" if cluster else "nothing configured"
        return Launch(None, f"single process ({where})")
    if num_processes is not None and process_id is not None and process_id >= num_processes:
        raise ConfigError("distributed.process_id", f"is {process_id}, but num_processes is {num_processes}")
    if num_processes == 1 and not cluster and detect is None:
        return Launch(None, "single process (num_processes=1)")
    missing = [name for name, value in explicit.items() if value is None]
    if missing and (detect == "deactivate" or (cluster is None and detect is None)):
        raise ConfigError(f"distributed.{missing[0]}",
                          f"is not set, but {', '.join(given)} {'is' if len(given) == 1 else 'are'}: give all of "
                          f"coordinator, num_processes and process_id (flags --coordinator, --num-processes, "
                          f"--process-id, or {COORDINATOR_ENV}, {NUM_PROCESSES_ENV}, {PROCESS_ID_ENV}), or run "
                          "under SLURM / Open MPI, whose variables JAX reads")
    kwargs = {"coordinator_address": coordinator, "num_processes": num_processes, "process_id": process_id,
              "initialization_timeout": cfg.initialization_timeout_s,
              "heartbeat_timeout_seconds": JAX_HEARTBEAT_FACTOR * cfg.heartbeat_timeout_s,
              "shutdown_timeout_seconds": cfg.shutdown_timeout_s}
    if local_ids is not None:
        kwargs["local_device_ids"] = list(local_ids)
    if detect is not None:
        kwargs["cluster_detection_method"] = detect
    source = "explicit" if not missing else f"{cluster[0] if cluster else detect} cluster detection"
    return Launch(kwargs, source)


def check_visible_devices(local_device_ids, environ=None) -> None:
    """The ``CUDA_VISIBLE_DEVICES`` trap, caught before the GPU backend gives a cryptic error.

    ``local_device_ids`` index into the GPUs that ``CUDA_VISIBLE_DEVICES`` leaves visible, not into
    the machine's. SLURM with ``--gpus-per-task=1`` (or a launcher that sets ``CUDA_VISIBLE_DEVICES``
    per process) leaves each process exactly one GPU, number 0.
    """
    environ = os.environ if environ is None else environ
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if local_device_ids is None or visible is None or visible.strip() == "":
        return
    count = len([v for v in visible.split(",") if v.strip()])
    bad = [i for i in local_device_ids if i >= count]
    if bad:
        raise ConfigError("distributed.local_device_ids", (
            f"{list(local_device_ids)} asks for GPU {bad[0]}, but CUDA_VISIBLE_DEVICES={visible} leaves this "
            f"process {count} GPU(s), numbered 0..{count - 1}: local_device_ids index into the visible GPUs. "
            "Either drop local_device_ids (or use 0) when the launcher already gives each process its own "
            "GPU, or unset CUDA_VISIBLE_DEVICES and let local_device_ids choose"))


def initialize(cfg: DistributedConfig | None = None, environ=None) -> Launch:
    """Joins the other processes (``jax.distributed.initialize``) when there are any.

    Must run before anything starts JAX's backends (``jax.devices()``, any computation).

    Raises:
      ConfigError: inconsistent settings, backends already started, or the coordinator not reached.
    """
    cfg = cfg or DistributedConfig()
    launch = launch_of(cfg, environ)
    if launch.kwargs is None:
        return launch
    check_visible_devices(launch.kwargs.get("local_device_ids"), environ)
    if jax.distributed.is_initialized():
        return launch
    from jax._src import xla_bridge  # the public initialize() raises the same check, less clearly
    if xla_bridge.backends_are_initialized():
        raise ConfigError("distributed", "JAX's backends already started in this process; "
                          "meshtrain.distributed.initialize must run before any JAX computation")
    try:
        jax.distributed.initialize(**launch.kwargs)
        _install_failure_hook(_watch_peers(cfg.heartbeat_timeout_s))
    except Exception as err:  # noqa: BLE001 - the runtime raises XlaRuntimeError / ValueError with long texts
        address = launch.kwargs.get("coordinator_address") or "the detected coordinator"
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError("distributed", f"could not join the run through {address} "
                          f"({launch.source}): {first}") from None
    return launch


def _stop_line(kind: str, lost: list[int] | None) -> str:
    """The one line a process of a multi-process run prints before it exits on a failure."""
    me, count = jax.process_index(), jax.process_count()
    if lost is None:
        who = "the coordinator (process 0) is unreachable"
    elif lost:
        who = f"lost process{'es' if len(lost) > 1 else ''} {', '.join(map(str, lost))} of {count}"
    else:
        who = f"all {count} processes are still alive, so the error is this process's own"
    return (f"error: process {me}/{count} stops after {kind} ({who}); a multi-process run cannot continue "
            "without all of its processes: resume it from its last checkpoint")


# JAX's own heartbeat timeout, as a multiple of ``heartbeat_timeout_s``: the peer watch (below) must
# see a lost process first, because when JAX's coordination service declares one dead it aborts every
# other process with a multi-line fatal log. A process sends JAX's heartbeats every half of JAX's
# timeout, so JAX can declare a stopped one dead as early as half its timeout after it stopped; the
# watch takes up to its timeout plus two beats (1.2x). At 2x JAX won that race (a SIGSTOPped peer:
# JAX's abort came 11.1 s after the stop at a timeout of 10 s); 3x leaves it 1.5x against 1.2x.
JAX_HEARTBEAT_FACTOR = 3
ALIVE_PREFIX = "meshtrain/alive/"
DONE = "done"


class PeerWatch:
    """Every process writes a beat counter under ``meshtrain/alive/<rank>`` in the coordination
    service's key-value store every ``timeout_s / 10`` and reads everyone's. A peer whose counter has
    not moved for ``timeout_s`` is lost (killed, hung, or its host gone), and so is the coordinator
    when this process cannot reach it for that long: this process prints one line naming them and
    exits 1, whether its main thread waits in a collective that never fails or not. A process that
    ends normally writes ``done`` (``stop``), so the others do not count its exit as a loss.

    Two daemon threads: one talks to the service (its calls may block while the coordinator is
    gone), one judges from what the first saw.
    """

    def __init__(self, client, me: int, count: int, timeout_s: float):
        self.client, self.me, self.timeout_s = client, me, timeout_s
        self.interval_s = max(timeout_s / 10, 0.05)
        start = time.monotonic()
        self.reached = start  # the last time a round trip to the service succeeded
        self.seen = {peer: (None, start) for peer in range(count) if peer != me}  # peer -> (value, when it changed)
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._beat, daemon=True, name="meshtrain-peer-beat"),
                        threading.Thread(target=self._judge, daemon=True, name="meshtrain-peer-judge")]

    def start(self) -> PeerWatch:
        for thread in self.threads:
            thread.start()
        return self

    def beat(self, count: int, now: float) -> None:
        """Write this process's ``count``-th beat and note, at ``now``, which peers' beats moved."""
        try:
            self.client.key_value_set(f"{ALIVE_PREFIX}{self.me}", str(count), allow_overwrite=True)
            values = dict(self.client.key_value_dir_get(ALIVE_PREFIX))
        except Exception:  # noqa: BLE001 - the service is unreachable; the judge counts how long
            return
        self.reached = now
        for peer, (value, _) in self.seen.items():
            latest = values.get(f"{ALIVE_PREFIX}{peer}")
            if latest is not None and latest != value:
                self.seen[peer] = (latest, now)

    def _beat(self) -> None:
        count = 0
        while not self.stopping.is_set():
            count += 1
            self.beat(count, time.monotonic())
            self.stopping.wait(self.interval_s)

    def lost(self, now: float) -> list[int] | None:
        """The peers silent for ``timeout_s`` at ``now`` (None: the service itself was unreachable)."""
        if now - self.reached > self.timeout_s:
            return None
        return [peer for peer, (value, when) in self.seen.items() if value != DONE and now - when > self.timeout_s]

    def _judge(self) -> None:
        while not self.stopping.wait(self.interval_s):
            lost = self.lost(time.monotonic())
            if lost is None or lost:
                kind = "its peers stopped answering" if lost else "the coordination service stopped answering"
                print(_stop_line(kind, lost), file=sys.stderr, flush=True)
                os._exit(1)

    def wait_for_loss(self) -> None:
        """Wait one timeout (and two beats) for a loss to show: the judge exits the process if one does."""
        self.stopping.wait(self.timeout_s + 2 * self.interval_s)

    def stop(self) -> None:
        """This process ends normally: stop judging and tell the others."""
        self.stopping.set()
        for thread in self.threads:
            thread.join(self.interval_s * 4)
        with contextlib.suppress(Exception):  # leaving anyway; JAX's shutdown reports an unreachable service
            self.client.key_value_set(f"{ALIVE_PREFIX}{self.me}", DONE, allow_overwrite=True)


def _watch_peers(timeout_s: float) -> PeerWatch:
    """Start the :class:`PeerWatch` of this process, stopped at exit before JAX's own shutdown
    (``atexit`` runs the later registration first)."""
    from jax._src import distributed as jax_distributed
    watch = PeerWatch(jax_distributed.global_state.client, jax.process_index(), jax.process_count(),
                      timeout_s).start()
    atexit.register(watch.stop)
    return watch


def _install_failure_hook(watch: PeerWatch) -> None:
    """An uncaught error in a multi-process run (typically a collective failing because a peer's
    connection dropped) waits for ``watch`` to judge: if a peer is lost, the watch prints its one line
    and exits; if every process is still alive after one timeout, the error is this process's own, so
    its traceback is printed with the line. Either way the exit is at once with status 1 instead of
    waiting at JAX's shutdown barrier for a dead peer."""
    previous = sys.excepthook

    def hook(kind, value, traceback):
        if issubclass(kind, KeyboardInterrupt):
            previous(kind, value, traceback)
            os._exit(130)
        watch.wait_for_loss()  # does not return when a peer is lost
        previous(kind, value, traceback)
        print(_stop_line(kind.__name__, []), file=sys.stderr, flush=True)
        os._exit(1)

    sys.excepthook = hook


def startup_line(mesh) -> str:
    """The one line every process prints at start-up: rank, host, local devices, global mesh."""
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    ids = ",".join(str(d.id) for d in local)
    shape = ", ".join(f"{axis}={size}" for axis, size in mesh.shape.items())
    return (f"meshtrain: rank {jax.process_index()}/{jax.process_count()} on {socket.gethostname()}: "
            f"{len(local)} local {local[0].platform if local else '?'} devices [{ids}] of "
            f"{mesh.devices.size}, global mesh ({shape})")


def log(message: str) -> None:
    """One line on process 0's stderr (the one printer of the run's notes and warnings)."""
    if jax.process_index() == 0:
        print(message, file=sys.stderr, flush=True)


def print_startup(mesh) -> None:
    print(startup_line(mesh), file=sys.stderr, flush=True)

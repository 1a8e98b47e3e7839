"""Multi-process runs on one machine: ``scripts/launch_local.sh`` starts 2 processes x 4 simulated CPU
devices joined by ``jax.distributed`` (gloo collectives), compared with 1 process x 8 devices in this
process (tests/conftest.py gives it 8 devices).

* the losses of 3 steps equal those of one process (rel 1e-5, fp32), on mesh (2,2,2,1) and on a
  hybrid mesh whose ``data`` axis is laid over the two processes (``mesh.dcn_data=2``);
* the checkpoint the two processes write at step 3 (of 5) restores in one process, which continues
  with the losses of the uninterrupted run;
* killing one of two processes, or stopping it (a hang), makes the other exit non-zero in one line
  naming the lost process, well within 120 s (``distributed.heartbeat_timeout_s=10``).
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from meshtrain import distributed
from meshtrain.errors import ConfigError
from meshtrain.loop import train
from compile_flags import FAST_COMPILE_XLA_FLAG
from utils import REPO, TINY, config, losses, overrides

LAUNCH = str(REPO / "scripts" / "launch_local.sh")
STEPS = 3
RESUMED = 5
MESH_A = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "mesh.stage=1"]
MESH_B = ["mesh.data=2", "mesh.fsdp=4", "mesh.tensor=1", "mesh.stage=1", "mesh.dcn_data=2"]  # data across processes


def _env() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("JAX_", "XLA_"))}
    # Of the session's XLA flags only the compile-speed one (tests/conftest.py).
    return {**env, "PYTHON": sys.executable, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": FAST_COMPILE_XLA_FLAG}


def _launch(run_dir, *extra, steps=STEPS, timeout=600) -> subprocess.CompletedProcess:
    command = [LAUNCH, "2", "--host-devices", "8", "--config", TINY, *overrides(run_dir, *extra, steps=steps)]
    result = subprocess.run(command, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:] + result.stdout[-4000:]
    return result


def _close(actual: dict[int, float], expected: dict[int, float], steps) -> None:
    for step in steps:
        np.testing.assert_allclose(actual[step], expected[step], rtol=1e-5, err_msg=f"step {step}")


@pytest.fixture(scope="module")
def reference_b(tmp_path_factory):
    """The losses of one 8-device process on MESH_B's shape (``dcn_data`` only says where the data
    axis crosses processes: on one process it changes nothing)."""
    run_dir = tmp_path_factory.mktemp("reference-b")
    train(config(run_dir, *MESH_B[:4], "checkpoint.enabled=false", steps=RESUMED))
    return losses(run_dir)


@pytest.mark.slow
def test_two_processes_match_one_and_checkpoint_restores_in_one(tmp_path, reference_b):
    """Two processes on a hybrid mesh (data across them, fsdp within) train as one process does, and
    their checkpoint restores in one process."""
    run_dir, resumed = tmp_path / "two", tmp_path / "resumed"
    result = _launch(run_dir, *MESH_B, "checkpoint.enabled=true", "checkpoint.async_save=false",
                     f"checkpoint.every={STEPS}", steps=RESUMED)
    output = result.stdout
    assert "global mesh (data=2, fsdp=4, tensor=1, stage=1)" in output
    for rank in (0, 1):  # every process prints its start-up line; only process 0 logs the rest
        assert f"[{rank}] meshtrain: rank {rank}/2" in output, output
    assert "[1] meshtrain: process" not in output and "[0] meshtrain: process 0/2" in output
    assert "Gloo" not in output and "peer ranks" not in output  # issue 12 item 16: no Gloo set-up chatter
    _close(losses(run_dir), reference_b, range(1, RESUMED + 1))
    # The 2-process checkpoint of step 3, continued by this single 8-device process.
    summary = train(config(resumed, *MESH_B[:4], "checkpoint.enabled=false",
                           f"checkpoint.restore_from={run_dir / 'checkpoints' / str(STEPS)}", steps=RESUMED))
    assert summary["resumed_from"] == STEPS
    _close(losses(resumed), reference_b, range(STEPS + 1, RESUMED + 1))


@pytest.mark.slow
@pytest.mark.parametrize("failure", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_lost_process_stops_the_other(tmp_path, failure):
    """A killed peer (its connections drop: the survivor's collective fails, or the heartbeats
    stop first) and a hung one (SIGSTOP: the collective waits, only the heartbeats stop) both end the
    survivor with the same one line."""
    port = subprocess.run([sys.executable, "-c", "import socket; s = socket.socket(); "
                           "s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    procs = []
    for rank in (0, 1):
        command = [sys.executable, "-m", "meshtrain.train", "--host-devices", "4", "--coordinator",
                   f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(rank), "--config", TINY,
                   *overrides(tmp_path, *MESH_A, "checkpoint.enabled=false", "distributed.heartbeat_timeout_s=10",
                              steps=100_000)]
        procs.append(subprocess.Popen(command, cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    try:
        metrics = pathlib.Path(tmp_path) / "metrics.jsonl"
        deadline = time.monotonic() + 900  # a hang guard: start-up and compiles take what the machine needs
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert all(p.poll() is None for p in procs), "a process ended before training"
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.2)
        procs[1].send_signal(failure)
        killed = time.monotonic()
        output, _ = procs[0].communicate(timeout=120)
        elapsed = time.monotonic() - killed
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert procs[0].returncode != 0, output[-3000:]
    print(f"survivor exited {elapsed:.1f} s after its peer got {failure.name}")
    assert elapsed < 120
    # Issue 12 item 11: the survivor says so in one line, without a traceback or a normal-looking summary.
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: process 0/2 stops after"), output[-3000:]
    assert "Traceback" not in output and "run summary" not in output, output[-3000:]
    assert "lost process 1 of 2" in output, output[-3000:]


def test_launch_plans():
    env = {}
    assert distributed.launch_of(distributed.DistributedConfig(), env).kwargs is None
    slurm_one = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n1", "SLURM_NTASKS": "1", "SLURM_PROCID": "0",
                 "SLURM_LOCALID": "0"}
    assert distributed.launch_of(distributed.DistributedConfig(), slurm_one).kwargs is None
    launch = distributed.launch_of(distributed.DistributedConfig(), {**slurm_one, "SLURM_NTASKS": "4"})
    assert launch.kwargs["num_processes"] is None and "SLURM" in launch.source  # JAX's detection fills it
    coordinated = {"JAX_COORDINATOR_ADDRESS": "h:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
    launch = distributed.launch_of(distributed.DistributedConfig(heartbeat_timeout_s=5), coordinated)
    assert launch.kwargs["coordinator_address"] == "h:1234" and launch.kwargs["process_id"] == 1
    assert launch.kwargs["heartbeat_timeout_seconds"] == 3 * 5  # JAX's backstop behind meshtrain's peer watch
    with pytest.raises(ConfigError, match=r"distributed.coordinator: is not set"):
        distributed.launch_of(distributed.DistributedConfig(num_processes=2, process_id=0), env)
    with pytest.raises(ConfigError, match="process_id: is 2, but num_processes is 2"):
        distributed.DistributedConfig(num_processes=2, process_id=2)
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES=3 leaves this process 1 GPU"):
        distributed.check_visible_devices([1], {"CUDA_VISIBLE_DEVICES": "3"})
    distributed.check_visible_devices([0], {"CUDA_VISIBLE_DEVICES": "3"})


def test_launcher_rejects_indivisible_devices():
    result = subprocess.run([LAUNCH, "3", "--host-devices", "8"], env=_env(), capture_output=True, text=True)
    assert result.returncode == 2 and "cannot be divided among 3 processes" in result.stderr


class _Store:
    """The coordination service's key-value store, as the peer watch uses it."""

    def __init__(self):
        self.values, self.reachable = {}, True

    def key_value_set(self, key, value, allow_overwrite=False):
        if not self.reachable:
            raise RuntimeError("UNAVAILABLE")
        self.values[key] = value

    def key_value_dir_get(self, prefix):
        if not self.reachable:
            raise RuntimeError("UNAVAILABLE")
        return [(key, value) for key, value in self.values.items() if key.startswith(prefix)]


def test_the_peer_watch_counts_a_silent_peer_lost_but_not_a_finished_one():
    store = _Store()
    watch = distributed.PeerWatch(store, me=0, count=3, timeout_s=10)
    start = watch.reached
    store.values[distributed.ALIVE_PREFIX + "1"] = "1"  # peer 1 beats once; peer 2 never does
    watch.beat(1, start + 1)
    assert store.values[distributed.ALIVE_PREFIX + "0"] == "1"
    assert watch.lost(start + 9) == [] and watch.lost(start + 10.5) == [2]
    store.values[distributed.ALIVE_PREFIX + "2"] = distributed.DONE  # peer 2 ended normally
    watch.beat(2, start + 10.6)
    assert watch.lost(start + 10.9) == [] and watch.lost(start + 11.5) == [1]  # peer 1: silent since + 1
    store.values[distributed.ALIVE_PREFIX + "1"] = "2"
    watch.beat(3, start + 12)
    assert watch.lost(start + 21) == []
    store.reachable = False  # the coordinator is gone: no round trip since + 12
    watch.beat(4, start + 13)
    assert watch.lost(start + 21.5) == [] and watch.lost(start + 22.5) is None

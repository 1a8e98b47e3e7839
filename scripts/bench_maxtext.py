"""Time MaxText's train step on a Llama or Mixtral shape, offline on simulated CPU devices, in MaxText's own venv.

    python scripts/bench_maxtext.py [--shape issue|large|tiny|moe|moe_tiny] [--steps 20] [--warmup 3] [--log FILE]
        [--json FILE]

MaxText (0.2.5, Python >= 3.12, jax 0.11.2) lives in ``.maxtext-venv`` (``scripts/install_maxtext.sh``;
``MAXTEXT_VENV`` points elsewhere). :func:`run_maxtext` runs ``maxtext.trainers.pre_train.train`` with that
venv's python in a subprocess, with ``DECOUPLE_GCLOUD=TRUE``, synthetic data, no packing, ``dot_product``
attention, no checkpointing and no TensorBoard, on fsdp x tensor simulated CPU devices
(``--xla_force_host_platform_device_count``) in mesh fsdp x tensor. A shape with ``experts`` is a Mixtral
(``decoder_block=mixtral``: every layer's MLP ``experts`` SwiGLU experts of ``mlp``, ``top_k`` per token)
run dropless by MaxText's sparse path: ``sparse_matmul=true megablox=false capacity_factor=-1``, i.e.
the tokens sorted by expert and ``jax.lax.ragged_dot`` (the Pallas megablox kernel is TPU's).
MaxText logs ``completed step: N, seconds: S`` for every step: S is the host time between two step
dispatches, which with one step in flight is the device's step time (its step is compiled before step
0); a step that finds the one before it already done can log a few ms and its neighbour twice the time,
so the mean is reported beside the median. The first ``warmup`` steps (step 0 returns at dispatch, step
1 waits for it) are dropped and the median of the next ``steps`` is reported. Without the venv it prints
one line, ``maxtext: not installed (run scripts/install_maxtext.sh)``, and returns None (exit status 0).
The shapes and MaxText's overrides for them are ``meshtrain.measure.maxtext``'s (plain data); nothing
here imports JAX.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from meshtrain.measure.maxtext import SHAPES, Shape, maxtext_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = os.path.join(ROOT, ".maxtext-venv")
NOT_INSTALLED = "maxtext: not installed (run scripts/install_maxtext.sh)"
JAX_VERSION = re.compile(r"Jax Version: (\S+)")
STEP_LINE = re.compile(r"completed step: (\d+), seconds: ([0-9.]+),.*? loss: ([0-9.naif]+)")
def installation(venv: str | None = None) -> tuple[str, str] | None:
    """``(python, MaxText's base.yml)`` of the MaxText venv, or None when it (or MaxText in it) is absent."""
    venv = venv or os.environ.get("MAXTEXT_VENV") or VENV
    python = os.path.join(venv, "bin", "python")
    configs = glob.glob(os.path.join(venv, "lib", "python3*", "site-packages", "maxtext", "configs", "base.yml"))
    return (python, configs[0]) if os.access(python, os.X_OK) and configs else None


def subprocess_env(devices: int) -> dict[str, str]:
    """This environment without JAX/XLA settings or another venv, plus MaxText's offline CPU settings."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("JAX_") and key not in ("XLA_FLAGS", "PYTHONPATH", "VIRTUAL_ENV")}
    env.update({"DECOUPLE_GCLOUD": "TRUE", "JAX_PLATFORMS": "cpu",
                "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"})
    return env


def parse_steps(log: str) -> list[tuple[int, float, float]]:
    """``(step, seconds, loss)`` of each ``completed step`` line of a MaxText log."""
    return [(int(step), float(seconds), float(loss)) for step, seconds, loss in STEP_LINE.findall(log)]


def run_maxtext(shape: Shape, *, steps: int = 20, warmup: int = 3, venv: str | None = None,
                log_path: str | None = None, timeout: float = 1800.0) -> dict | None:
    """Run MaxText's train loop on ``shape``; per-step times, or None (one line printed) if not installed."""
    found = installation(venv)
    if found is None:
        print(NOT_INSTALLED, flush=True)
        return None
    python, config = found
    with tempfile.TemporaryDirectory(prefix="bench-maxtext-") as work:
        cmd = [python, "-m", "maxtext.trainers.pre_train.train", config,
               *maxtext_args(shape, warmup + steps, os.path.join(work, "out"))]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=work, env=subprocess_env(shape.devices), capture_output=True, text=True,
                              timeout=timeout, check=False)
        wall = time.perf_counter() - start
    log = proc.stdout + proc.stderr
    if log_path:
        with open(log_path, "w") as f:
            f.write(log)
    rows = parse_steps(log)
    timed = [row for row in rows if warmup <= row[0] < warmup + steps]
    if proc.returncode != 0 or len(timed) < steps:
        raise RuntimeError(f"MaxText run failed (exit status {proc.returncode}, {len(timed)} of {steps} timed "
                           f"steps logged); the end of its log:\n{log[-4000:]}")
    times = [seconds for _, seconds, _ in timed]
    return {"framework": "maxtext", "shape": dataclasses.asdict(shape), "warmup_steps": warmup,
            "steps_timed": steps, "step_time_s_median": statistics.median(times),
            "step_time_s_mean": statistics.fmean(times), "step_time_s_min": min(times),
            "step_times_s": times, "all_step_times_s": [seconds for _, seconds, _ in rows],
            "loss_first": rows[0][2], "loss_last": rows[-1][2], "wall_s": wall,
            "jax": next(iter(JAX_VERSION.findall(log)), None)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="issue")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the median")
    parser.add_argument("--log", help="also write MaxText's whole log to this file")
    parser.add_argument("--json", dest="json_path", help="also write the result as JSON to this file")
    args = parser.parse_args(argv)
    result = run_maxtext(SHAPES[args.shape], steps=args.steps, warmup=args.warmup, log_path=args.log)
    if result is None:
        return 0
    print(f"maxtext: median {result['step_time_s_median']:.3f} s per step over {args.steps} steps "
          f"(mean {result['step_time_s_mean']:.3f} s, min {result['step_time_s_min']:.3f} s; loss "
          f"{result['loss_first']:.3f} -> {result['loss_last']:.3f}; wall {result['wall_s']:.0f} s)")
    print("json: " + json.dumps(result), flush=True)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The planner beside XLA:GPU: ``meshtrain.compile --json`` reports the planner's estimate of the same
layout (``planned_peak_bytes``) beside XLA:GPU's peak, and ``meshtrain.plan --verify`` compiles with
XLA:GPU when the CUDA plugin is installed and says so. One small compile each (tiny, one H100)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import numpy as np

from meshtrain.config import load_config
from meshtrain.gpu_compile import Target, compile_step, topology
from meshtrain.mesh import make_mesh
from meshtrain.planner.estimate import layout_estimate

ONE_GPU = ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "mesh.stage=1"]


def test_compile_json_reports_the_planned_peak_beside_xla_gpus_peak():
    cfg, devices = load_config("configs/tiny.yaml", ONE_GPU), topology(Target.H100, 1, 1)
    report = json.loads(json.dumps(dataclasses.asdict(compile_step(cfg, devices, Target.H100).report)))  # --json's
    layout = cfg.layout(make_mesh(cfg.mesh, devices).shape)
    planned = layout_estimate(layout, np.dtype(cfg.train.compute_dtype).itemsize).total
    assert report["planned_peak_bytes"] == planned > 0
    assert report["peak_bytes"] >= report["argument_bytes"] + report["temp_bytes"] - report["alias_bytes"] > 0


def test_plan_verify_compiles_on_xla_gpu_and_says_so():
    argv = [sys.executable, "-m", "meshtrain.plan", "--config", "configs/tiny.yaml", "--devices", "1",
            "--device-memory", "80GB", "--gpu", "h100", "--zero", "0", "--remat", "full", "--top", "1",
            "--verify", "1"]
    env = {key: value for key, value in os.environ.items() if key != "TF_CPP_MIN_LOG_LEVEL"}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "for 1 h100 GPUs on 1 host(s) by XLA:GPU" in out and "simulated CPU devices" not in out, out
    (row,) = [line for line in out.splitlines() if re.match(r"1\s+1\s+\(1,1,1,1\)", line)]  # verify's, plan's rank
    assert re.search(r"[0-9.e-]+ / [0-9.e-]+ \([+-][0-9.]+%\)\s+[0-9.]+\s+fits$", row), row  # peak est / xla

"""Compile the train step for NVIDIA GPUs on any machine: ``python -m meshtrain.compile --config X.yaml --target h100``.

    python -m meshtrain.compile --config FILE --target h100|h200|b200 [--hosts N] [--gpus-per-host 8]
                                [--json] [--dump DIR] [--memory-fraction F] [section.field=value ...]

Builds exactly what ``meshtrain.train`` builds (the same config, Layout, Trainer, train step and
XLA flags) on ``hosts x gpus-per-host`` compile-only devices of the target (``meshtrain.gpu_compile``)
and compiles it with XLA:GPU; nothing runs. Prints per device: argument, temp and peak bytes and
whether the step fits the memory JAX's allocator gets (``--memory-fraction``, default
``XLA_PYTHON_CLIENT_MEM_FRACTION`` or JAX's 0.75); the kernels (attention, GEMMs, FP8 GEMMs, the
expert exchange); the collectives per step with their bytes; the matmul FLOPs of the GPU module per
step; the compile time; beside XLA's peak, the planner's estimate of the same layout
(``planned_peak_bytes``). ``--json`` prints the same as one JSON line; ``--dump DIR`` writes the optimized
HLO (``DIR/step.hlo.txt``), the report (``DIR/report.json``) and XLA's own dump (``DIR/xla/``: the
memory-usage report and buffer assignment). Needs the CUDA plugin (``make setup-gpu-compile``; run
as ``.venv-gpu/bin/python -m meshtrain.compile``).

Exit 2 with one ``error: field: ...`` line for bad input, a step XLA refuses (its reason), or a step
that does not fit (after the report).
"""

from __future__ import annotations

import os

# XLA's C++ log (rematerialization warnings, the scheduler's complaints about a program larger than the
# device) is read when jaxlib loads, so it is quieted before anything imports jax: the report says what
# matters, a refusal is one line. TF_CPP_MIN_LOG_LEVEL set by the user wins.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

from meshtrain.cli import ArgumentParser, run  # noqa: E402
from meshtrain.errors import ConfigError, writable_directory  # noqa: E402
from meshtrain.gpu_compile import CompileReport, Target  # noqa: E402
from meshtrain.metrics import format_bytes  # noqa: E402


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(prog="python -m meshtrain.compile", description=__doc__.split("\n")[0])
    p.add_argument("--config", help="YAML config (default: the dataclass defaults)")
    p.add_argument("--target", required=True, help=f"GPU to compile for: {', '.join(t.value for t in Target)}")
    p.add_argument("--hosts", type=int, default=1, help="hosts (processes) of the topology (default 1)")
    p.add_argument("--gpus-per-host", type=int, default=8, help="GPUs per host (default 8)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON line")
    p.add_argument("--dump", metavar="DIR", help="write the optimized HLO, the report and XLA's dump to DIR")
    p.add_argument("--memory-fraction", type=float,
                   help="fraction of device memory the run's allocator gets (default XLA_PYTHON_CLIENT_MEM_FRACTION "
                        "or 0.75)")
    return p.parse_args(argv)


def _gb(n: float) -> str:
    return f"{n / 2 ** 30:.2f} GiB"


def format_report(report: CompileReport) -> str:
    """The human-readable report."""
    verdict = "fits" if report.fits else "DOES NOT FIT"
    gemms = {name: n for name, n in report.custom_calls.items() if "cublas" in name}
    triton = {name: n for name, n in report.fusion_kinds.items() if "triton" in name}
    lines = [
        f"XLA:GPU ({report.target}, jax {report.jax}, jaxlib {report.jaxlib}): {report.devices} devices on "
        f"{report.hosts} host(s), mesh {report.mesh}, compiled in {report.compile_seconds:.1f} s",
        f"per device: arguments {_gb(report.argument_bytes)}, temporaries {_gb(report.temp_bytes)}, "
        f"peak {_gb(report.peak_bytes)} of {_gb(report.usable_memory_bytes)} usable "
        f"({_gb(report.device_memory_bytes)} device memory): {verdict}",
        f"planned peak (meshtrain.plan's estimate of this layout): {_gb(report.planned_peak_bytes)} "
        f"({(report.planned_peak_bytes - report.peak_bytes) / report.peak_bytes:+.1%} of XLA:GPU's)",
        *[f"  {line}" for line in report.kernels],
        f"kernels per step: cuDNN attention {report.cudnn_attention}, cuBLAS GEMMs {gemms or 0}, Triton fusions "
        f"{triton or 0}, FP8 GEMMs {report.fp8_gemms}, ragged_dot left {report.ragged_dots}",
        "collectives per step: " + (", ".join(
            f"{op} {n} ({format_bytes(report.collective_bytes[op])}, {report.async_collectives.get(op, 0)} async)"
            for op, n in report.collectives.items()) or "none"),
        f"matmul FLOPs per device per step: {report.flops / 1e12:.2f} TFLOP",
        "other custom calls: " + (", ".join(f"{name} {n}" for name, n in report.custom_calls.items()
                                            if "cublas" not in name and "cudnn$fmha" not in name) or "none"),
    ]
    return "\n".join(lines)


def _compile(argv: list[str] | None) -> int:
    args = _parse_args(argv)
    try:
        target = Target(args.target.lower())
    except ValueError:
        raise ConfigError("--target", f"unknown GPU {args.target!r}; valid: "
                          f"{', '.join(t.value for t in Target)}") from None
    if args.memory_fraction is not None and not 0 < args.memory_fraction <= 1:
        raise ConfigError("--memory-fraction", f"must be in (0, 1], got {args.memory_fraction}")
    dump = writable_directory(args.dump, "--dump") if args.dump else None
    from meshtrain.gpu_compile import compile_step, start_compile_only, topology
    from meshtrain.xla_flags import apply_recommended, merge_flags

    start_compile_only()
    apply_recommended(force=True)  # what a GPU run of meshtrain.train sets before its backends start
    if dump is not None:
        os.environ["XLA_FLAGS"] = merge_flags(os.environ.get("XLA_FLAGS", ""), [f"--xla_dump_to={dump / 'xla'}"])
    from meshtrain.config import load_config

    cfg = load_config(args.config, args.overrides)
    devices = topology(target, args.hosts, args.gpus_per_host)
    step = compile_step(cfg, devices, target, args.memory_fraction)
    report = step.report
    if dump is not None:
        (dump / "step.hlo.txt").write_text(step.hlo)
        (dump / "report.json").write_text(json.dumps(dataclasses.asdict(report), indent=1) + "\n")
    print(json.dumps(dataclasses.asdict(report)) if args.json else format_report(report), flush=True)
    if not report.fits:
        raise ConfigError("memory", f"the step needs {_gb(report.peak_bytes)} per device, more than the "
                          f"{_gb(report.usable_memory_bytes)} a {target.value} run's allocator gets")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(_compile, argv)


if __name__ == "__main__":
    sys.exit(main())

"""Choose the layout that fits: ``python -m meshtrain.plan --config X.yaml --devices N --gpu h100`` (or
``--device-memory 80GiB``).

The command line of the planner: the search (``meshtrain.planner.search``: every mesh x preset x
ZeRO stage x remat x pipeline schedule and microbatches [x offload] [x accumulation] of N devices,
each estimated by ``meshtrain.planner.estimate``) printed ranked: layouts that fit first, by estimated step
time, a step mostly spent in collectives marked; layouts that cannot run say why; when none fits, the
first single change that does. ``--gpu`` takes the memory, peak FLOP/s and link bandwidths of a
compile target (``meshtrain.gpu_compile.Target``). ``--verify K`` compiles the K best with the real train step
ahead of time, with XLA:GPU for N compile-only GPUs of ``--gpu`` (h100, h200, b200) when the
GPU compile environment is installed (``make setup-gpu-compile``; ``.venv-gpu/bin/python -m
meshtrain.plan``), else with XLA:CPU on N simulated CPU devices, says which, prints XLA's memory
analysis and peak beside the estimate and re-ranks the K by XLA's verdict;
``--write-config FILE`` writes the first row as a config ``meshtrain.train`` runs.

Bad input prints one ``error: field: what is wrong`` line and exits 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import re
import sys
import time
import uuid
from collections.abc import Sequence

import yaml

from meshtrain.cli import ArgumentParser, run
from meshtrain.config import Config, load_config, to_dict
from meshtrain.errors import ConfigError
from meshtrain.gpu_compile import Target, memory_fraction
from meshtrain.metrics import peak_bf16_tflops
from meshtrain.parallel.pipeline import Schedule
from meshtrain.parallel.rules import Preset
from meshtrain.xla_flags import cuda_plugin_installed
from meshtrain.planner.constants import TEMP_MARGIN, Compiler
from meshtrain.planner.estimate import UNRELIABLE, Candidate, Estimate
from meshtrain.planner.roofline import Hardware
from meshtrain.planner.search import (GB, LONG_SEQUENCE, MAX_DEVICES, Change, Plan, make_plan, search_presets,
                                      single_changes)
from models.api import family_of
from models.common import RematPolicy

_UNITS = {"": 1, "b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15,
          "ki": 2 ** 10, "mi": 2 ** 20, "gi": 2 ** 30, "ti": 2 ** 40, "pi": 2 ** 50}


def parse_bytes(text: str, field: str) -> float:
    """``"80GiB"`` -> 85899345920.0; ``40GB``, ``1TiB``, ``512MB``, ``2.5G``, plain bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgtp]i?)?b?\s*", str(text), re.IGNORECASE)
    if not match:
        raise ConfigError(field, f"cannot read {text!r} as a size; use e.g. 80GiB, 40GB, 1TiB or a byte count")
    value = float(match.group(1)) * _UNITS[(match.group(2) or "").lower()]
    if value <= 0:
        raise ConfigError(field, f"must be > 0, got {text!r}")
    return value


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(prog="python -m meshtrain.plan", description=__doc__.split("\n")[0])
    p.add_argument("--config", help="YAML config (default: the dataclass defaults)")
    p.add_argument("--devices", type=int, required=True, help="number of devices N")
    p.add_argument("--gpu", help="the GPU, one of " + ", ".join(t.value for t in Target) + ": its memory (as much as "
                   "JAX's allocator takes of it), dense bf16 peak and link bandwidths, and the target --verify "
                   "compiles for; the flags below override its figures")
    p.add_argument("--device-memory", help="memory per device, e.g. 80GiB or 40GB (required without --gpu)")
    p.add_argument("--host-memory", help="pinned host memory available to each device for optimizer offload "
                   "(a node's host memory divided by its devices), e.g. 128GiB")
    p.add_argument("--verify", type=int, default=0, metavar="K",
                   help="compile the K best layouts (XLA:GPU for --gpu when the GPU compile environment is "
                   "installed, else XLA:CPU on N simulated CPU devices), compare and re-rank")
    p.add_argument("--top", type=int, default=20, help="rows of layouts that fit to print")
    p.add_argument("--show-infeasible", type=int, default=8, metavar="K",
                   help="rows of layouts that do not fit (and distinct structural reasons) to print")
    p.add_argument("--mesh", action="append", default=[], metavar="D,F,T,S",
                   help="only this mesh (data,fsdp,tensor,stage); repeatable")
    p.add_argument("--zero", default="0,1,2,3", help="ZeRO stages to consider (comma list)")
    p.add_argument("--remat", default="none,full,dots", help="remat policies to consider (comma list)")
    p.add_argument("--schedule", help="pipeline schedules to consider (comma list of gpipe, 1f1b, interleaved "
                   "(over 2 virtual stages), zb_h1; default: all)")
    p.add_argument("--preset", help="sharding presets to consider (comma list of "
                   f"{', '.join(p.value for p in Preset)}; default: the config's, and when that is fsdp_tp or "
                   f"one of its sequence variants also fsdp_tp_sp and, from seq_len {LONG_SEQUENCE}, fsdp_cp, "
                   "fsdp_tp_cp and fsdp_cp_ring)")
    p.add_argument("--device-kind", help="device for the peak FLOP/s table (meshtrain.metrics; default: --gpu's, "
                   "else H100)")
    p.add_argument("--peak-tflops", type=float, help="dense bf16 peak TFLOP/s per device (overrides --device-kind)")
    p.add_argument("--intra-node-bandwidth",
                   help="bytes/s per device over links inside a node (NVLink; default: --gpu's, else 450GB)")
    p.add_argument("--inter-node-bandwidth",
                   help="bytes/s per device across nodes (default: --gpu's, else 50GB: one 400 Gb/s NIC per GPU)")
    p.add_argument("--node-size", type=int, default=8,
                   help="devices per node (default 8); a mesh with tensor > node size is refused in one line")
    p.add_argument("--write-config", metavar="FILE",
                   help="write the config with the best layout applied, for meshtrain.train --config FILE")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --write-config FILE")
    return p.parse_args(argv)


def _parse_list(text: str, field: str, parse) -> list:
    try:
        return [parse(item.strip()) for item in text.split(",") if item.strip()]
    except (ValueError, KeyError):
        raise ConfigError(field, f"cannot read {text!r}; give a comma-separated list") from None

def _gb(nbytes: float) -> str:
    """GB with 3 significant digits (``0.00352`` for tiny models, ``40.1`` for large ones)."""
    return f"{nbytes / GB:.3g}" if nbytes < 100 * GB else f"{nbytes / GB:.0f}"


COMM_BOUND = "*"  # beside the comm s of a layout whose step is mostly collectives (``comm_bound``)


def comm_bound(est: Estimate) -> bool:
    """Whether the estimated step is mostly collectives: their time exceeds the compute's."""
    return sum(est.comm_s.values()) > est.compute_s


def _preset(cfg: Config, candidate: Candidate) -> str:
    return (candidate.preset or cfg.sharding.preset).value


def _row(cfg: Config, rank: str, est: Estimate, verdict: str) -> list[str]:
    lay = est.candidate
    piped = lay.stage > 1 and est.in_flight
    return [rank, lay.label(), _preset(cfg, lay), str(lay.zero), lay.remat.value, str(lay.grad_accum),
            lay.schedule_label,
            str(lay.microbatches) if lay.stage > 1 else "-", str(est.loss_chunk or "all"),
            f"{est.bubble:.1%}" if piped else "-", str(est.in_flight) if piped else "-",
            "yes" if lay.offload else "-", _gb(est.params), _gb(est.grads),
            _gb(est.optimizer),
            _gb(est.activations), _gb(est.temporaries + est.batch), _gb(est.update), _gb(est.total),
            _gb(est.optimizer_host) if lay.offload else "-", f"{est.step_s:.3g}", f"{est.compute_s:.3g}",
            f"{sum(est.comm_s.values()):.3g}" + (COMM_BOUND if comm_bound(est) else ""), verdict]


HEADER = ["#", "mesh d,f,t,s", "preset", "zero", "remat", "acc", "schedule", "mb", "chunk", "bubble", "flight", "offl",
          "params", "grads", "optim", "activ", "temps", "update", "total GB", "host GB", "step s", "comp s", "comm s",
          "verdict"]


LEFT_ALIGNED = {HEADER.index(name) for name in ("mesh d,f,t,s", "preset", "remat", "schedule", "verdict")}


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i in LEFT_ALIGNED else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in rows)


def _mesh_of(est: Estimate) -> tuple[int, ...]:
    return tuple(est.candidate.mesh.values())


def format_plan(plan: Plan, top: int, show_infeasible: int, requested_meshes: Sequence[tuple[int, ...]] = (),
                memory_note: str = "") -> str:
    """The ranked table: the ``top`` layouts that fit, the ``show_infeasible`` smallest that do not and
    as many distinct reasons why others cannot be built; each of ``requested_meshes`` (``--mesh``)
    shows at least its best row (or why it cannot be built) beyond those counts; ``memory_note``:
    where the device memory comes from (``device_memory_of``)."""
    fit, big, broken = plan.ranked()
    shown_meshes = {_mesh_of(e) for e in fit[:top] + big[:show_infeasible]}
    missing = [mesh for mesh in dict.fromkeys(requested_meshes) if mesh not in shown_meshes]
    best_of_mesh: dict[tuple[int, ...], Estimate] = {}
    for est in fit + big:
        best_of_mesh.setdefault(_mesh_of(est), est)
    extra = [best_of_mesh[mesh] for mesh in missing if mesh in best_of_mesh]
    fit_shown = [(rank, e) for rank, e in enumerate(fit, 1) if rank <= top or any(e is x for x in extra)]
    big_shown = [e for i, e in enumerate(big) if i < show_infeasible or any(e is x for x in extra)]
    m = plan.cfg.model
    hw = plan.hardware
    lines = [f"model: {family_of(m).name}, {m.num_params / 1e9:.2f}B parameters ({m.num_layers} layers, embed "
             f"{m.embed_dim}, vocab {m.vocab_size}); batch "
             f"{plan.cfg.train.batch_size} x {m.seq_len} tokens, grad_accum {plan.cfg.train.grad_accum}, "
             f"{plan.cfg.train.precision.value}, pipeline {plan.cfg.pipeline.schedule.value}",
             f"devices: {plan.devices} x {plan.device_memory / GB:.4g} GB"
             + (f" ({memory_note})" if memory_note else "")
             + (f", host {plan.host_memory / GB:.4g} GB per device" if plan.host_memory is not None else ""),
             f"roofline: {hw.peak_flops / 1e12:.0f} TFLOP/s per device, {hw.intra_node_bandwidth / GB:.0f} GB/s "
             f"inside a node of {hw.node_size}, {hw.inter_node_bandwidth / GB:.0f} GB/s across nodes; "
             "step = compute / (1 - bubble) + collectives (no overlap); bubble and flight (peak chunk "
             "activations a stage holds) from the pipeline schedule's table",
             f"layouts: {len(plan.estimates)} enumerated, {len(fit)} fit, {len(big)} need too much memory, "
             f"{len(broken)} cannot be built",
             "chunk = positions per row in each chunk of the head and loss ("
             + (f"train.loss_chunk={plan.cfg.train.loss_chunk}" if plan.cfg.train.loss_chunk is not None else
                "chosen per layout for these devices' memory")
             + "; all = one pass, whose backward recomputes nothing)",
             f"per device, GB, as {hw.compiler.value} holds them (activ = what the backward keeps: in fp32, or in a"
             " pipeline the stash in the compute dtype with its cut and buffers; temps = the"
             " compute copy and the gradients the backward writes, then the larger of the loss phase and one"
             " layer's backward, and the batch; update = the fp32 gradients and one fp32 step per optimizer"
             " element, or an offloaded optimizer state's moments brought to the device; temp bytes = the"
             " larger of activ + temps and update; optim = resting on the device, host GB = offloaded):",
             ""]
    rows = [HEADER] + [_row(plan.cfg, str(rank), e, "fits" if plan.certain(e) else "fits?") for rank, e in fit_shown]
    rows += [_row(plan.cfg, "-", e, "; ".join(plan.problems(e))) for e in big_shown]
    if len(rows) > 1:
        lines.append(_table(rows))
    if any(comm_bound(e) for e in [e for _, e in fit_shown] + big_shown):
        lines.append(f"{COMM_BOUND} (comm s) = comm-bound: the estimated collectives take longer than the compute, "
                     "the step is mostly communication")
    if any(not e.reliable for _, e in fit_shown):
        lines.append(f"fits? = {UNRELIABLE}")
    if any(e.reliable and not plan.certain(e) for _, e in fit_shown):
        lines.append(f"fits? (no pipeline) = fits only without the {TEMP_MARGIN:.0%} margin on temp bytes the planner "
                     "keeps above its estimate (its largest shortfall measured against XLA:CPU is smaller: "
                     "scripts/plan_accuracy.py); confirm with --verify")
    reasons = {_broken_reason(plan.cfg, est): _mesh_of(est) for est in broken}
    first = list(reasons)[:show_infeasible]
    unbuilt = [mesh for mesh in missing if mesh not in best_of_mesh]
    asked = [reason for reason, mesh in reasons.items() if mesh in unbuilt and reason not in first]
    if first or asked:
        lines.append(f"\ncannot be built ({len(reasons)} distinct, first {len(first)}"
                     + (", and those of the --mesh asked for" if asked else "") + "):")
        lines += [f"  {reason}" for reason in first + asked]
    return "\n".join(lines)


def format_changes(plan: Plan, changes: list[Change]) -> str:
    """What to change when nothing fits, in one or two lines: the first of ``changes`` (``single_changes``)
    that fits with its best layout, and what the ones tried before it still need."""
    def layout(est: Estimate) -> str:
        lay = est.candidate
        return (f"{lay.label()} {_preset(plan.cfg, lay)} ZeRO-{lay.zero} {lay.remat.value} acc {lay.grad_accum}, "
                f"{_gb(est.total)} GB, step {est.step_s:.3g} s")

    fitting = changes[-1] if changes and changes[-1].best is not None else None
    missed = [f"{c.flag}: {_gb(c.needed)} GB" for c in changes if c is not fitting]
    head = (f"\nnothing fits; the first single change that does (gradient accumulation is searched already): "
            f"{fitting.flag}: {layout(fitting.best)}" if fitting else
            "\nnothing fits, nor with any single change tried (gradient accumulation is searched already)")
    return head + (f"\n  tried{' before it' if fitting else ''}, still too big: {'; '.join(missed)}" if missed else "")


def _broken_reason(cfg: Config, est: Estimate) -> str:
    return f"{est.candidate.label()} {_preset(cfg, est.candidate)}: {'; '.join(est.reasons)}"


def _start_devices(count: int) -> None:
    """N simulated CPU devices for --verify, set before JAX's backends start."""
    import jax

    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        pass
    if len(jax.devices()) < count or jax.devices()[0].platform != "cpu":
        raise ConfigError("--verify", f"JAX already started with {len(jax.devices())} "
                          f"{jax.devices()[0].platform} devices; run the plan in a fresh process")


@dataclasses.dataclass(frozen=True)
class GpuTopology:
    """The compile-only GPUs ``--verify`` compiles for with XLA:GPU: ``hosts`` x ``gpus_per_host`` of ``target``."""

    target: Target
    hosts: int
    gpus_per_host: int
    devices: list


def start_verify(devices: int, target: Target | None, node_size: int) -> tuple[GpuTopology | None, str]:
    """Prepares this process for ``--verify`` before JAX's backends start: XLA:GPU's compile-only devices
    of ``target`` (``--gpu``; nodes of ``node_size``) when the GPU compile environment (a JAX CUDA
    plugin) is installed, else ``devices`` simulated CPU devices for XLA:CPU. -> (the GPUs, or None
    with why XLA:CPU compiles)."""
    if not cuda_plugin_installed() or target is None:
        _start_devices(devices)
        return None, ("the GPU compile environment is not installed: make setup-gpu-compile, then run "
                      ".venv-gpu/bin/python -m meshtrain.plan" if not cuda_plugin_installed() else
                      f"no --gpu given ({', '.join(t.value for t in Target)})")
    from meshtrain.gpu_compile import start_compile_only, topology
    from meshtrain.xla_flags import apply_recommended

    start_compile_only()
    apply_recommended(force=True)  # what a GPU run of meshtrain.train sets before its backends start
    hosts, per_host = (devices // node_size, node_size) if devices % node_size == 0 else (1, devices)
    return GpuTopology(target, hosts, per_host, topology(target, hosts, per_host)), ""


def verify(config_path: str | None, overrides: list[str], est: Estimate, devices: int,
           gpus: GpuTopology | None = None) -> dict:
    """XLA's memory analysis of the real train step of ``est.candidate`` (AOT, abstract shapes), per
    device: compiled by XLA:GPU for ``gpus`` (``peak``: XLA:GPU's peak, ``meshtrain.compile``'s), else
    by XLA:CPU on ``devices`` simulated CPU devices."""
    import jax

    # The head in the chunk the plan estimated (chosen for its --device-memory where the config leaves it).
    cfg = load_config(config_path, [*overrides, *est.candidate.overrides(), f"train.loss_chunk={est.loss_chunk}"])
    if gpus is not None:
        from meshtrain.gpu_compile import compile_step

        report = compile_step(cfg, gpus.devices, gpus.target).report
        return {"argument": report.argument_bytes, "output": report.output_bytes, "temp": report.temp_bytes,
                "peak": report.peak_bytes, "seconds": report.compile_seconds}
    from meshtrain.mesh import make_mesh
    from meshtrain.trainer import Trainer

    mesh = make_mesh(cfg.mesh, jax.devices()[:devices])
    start = time.perf_counter()
    trainer = Trainer(cfg.layout(mesh.shape), mesh, cfg.optimizer)
    analysis = trainer.train_step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile() \
        .memory_analysis()
    return {"argument": analysis.argument_size_in_bytes, "output": analysis.output_size_in_bytes,
            "temp": analysis.temp_size_in_bytes, "host": est.optimizer_host, "seconds": time.perf_counter() - start}


def verified_peak(xla: dict) -> float:
    """The device bytes XLA's memory analysis needs per device: XLA:GPU's peak where it gives one, else
    arguments + temporaries (outputs alias the donated state) less ``host``: XLA:CPU has no host memory
    space, so it counts the optimizer moments a layout offloads to the host among its arguments."""
    return xla.get("peak", xla["argument"] + xla["temp"] - xla.get("host", 0))


def verified_verdict(xla: dict, device_memory: float) -> str:
    """The verdict XLA's memory analysis gives (``verified_peak``) against the device memory. It
    overrules the estimate's."""
    needed = verified_peak(xla)
    return "fits" if needed <= device_memory else f"does not fit: XLA needs {needed / GB:.3g} GB"


def format_verify(results: list[tuple[Estimate, dict]], devices: int, device_memory: float,
                  cfg: Config | None = None, gpus: GpuTopology | None = None, why_cpu: str = "") -> str:
    """The verify table, re-ranked: the layouts XLA says fit first, by estimated step time, then the
    rest by what XLA needs (``plan #``: the row's rank in the plan); ``cfg`` names the preset of the
    rows that keep the config's (``-`` without it); ``gpus``: the GPUs XLA:GPU compiled for (None:
    XLA:CPU, because ``why_cpu``)."""
    def cell(estimated: float, measured: float) -> str:
        err = (estimated - measured) / measured if measured else float("nan")
        return f"{_gb(estimated)} / {_gb(measured)} ({err:+.1%})"

    ranked = sorted(enumerate(results, 1), key=lambda r: (verified_peak(r[1][1]) > device_memory, r[1][0].step_s,
                                                           verified_peak(r[1][1])))
    rows = [["#", "plan #", "mesh d,f,t,s", "preset", "zero", "remat", "mb", "argument GB est / xla",
             "output GB est / xla", "temp GB est / xla", "peak GB est / xla", "compile s", "verdict (xla)"]]
    for i, (rank, (est, xla)) in enumerate(ranked):
        lay = est.candidate
        preset = _preset(cfg, lay) if cfg is not None else (lay.preset.value if lay.preset else "-")
        rows.append([str(i + 1), str(rank), lay.label(), preset, str(lay.zero), lay.remat.value,
                     str(lay.microbatches) if lay.stage > 1 else "-", cell(est.argument_bytes, xla["argument"]),
                     cell(est.output_bytes, xla["output"]), cell(est.temp_bytes, xla["temp"]),
                     cell(est.total, verified_peak(xla)), f"{xla['seconds']:.1f}",
                     verified_verdict(xla, device_memory)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    table = "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
    if gpus is not None:
        import jax

        where = (f"for {devices} {gpus.target.value} GPUs on {gpus.hosts} host(s) by XLA:GPU (compile-only "
                 f"devices, jax {jax.__version__}; memory_analysis and peak, per device)")
    else:
        where = f"on {devices} simulated CPU devices by XLA:CPU (memory_analysis, per device)"
    legend = ("\n(XLA:CPU's peak = argument + temp less the optimizer moments an offloaded layout keeps on the host, "
              "the plan's host GB: XLA:CPU has no host memory space and counts them among its arguments)"
              if gpus is None and any(xla.get("host") for _, xla in results) else "")
    return (f"\nverify: the real train step compiled ahead of time {where}, re-ranked by XLA's verdict:\n"
            + (f"(XLA:CPU, not XLA:GPU: {why_cpu})\n" if gpus is None and why_cpu else "") + table + legend)


def target_of(name: str | None) -> Target | None:
    """The GPU ``--gpu`` names (None without one); one-line ``ConfigError`` naming the valid ones."""
    if name is None:
        return None
    try:
        return Target(name.strip().lower())
    except ValueError:
        raise ConfigError("--gpu", f"unknown GPU {name!r}; use one of {', '.join(t.value for t in Target)}") from None


def device_memory_of(text: str | None, target: Target | None) -> tuple[float, str]:
    """The memory per device: ``--device-memory`` ``text`` where given, else what JAX's allocator takes of
    ``target``'s memory (its spec's, times ``XLA_PYTHON_CLIENT_MEM_FRACTION`` or 0.75: the compile tool's
    ``usable_memory_bytes``). -> (bytes, where they come from: '' for ``text``)."""
    if text is not None:
        return parse_bytes(text, "--device-memory"), ""
    if target is None:
        raise ConfigError("--device-memory", "give the memory per device (e.g. 80GiB) or --gpu "
                          f"({', '.join(t.value for t in Target)})")
    fraction = memory_fraction()
    return (target.memory_bytes() * fraction,
            f"{target.value}: {target.memory_bytes() / GB:.4g} GB x {fraction:g} for JAX's allocator, "
            "XLA_PYTHON_CLIENT_MEM_FRACTION")


def hardware_of(args: argparse.Namespace, target: Target | None) -> Hardware:
    """The roofline's figures: ``target``'s (``Target``: dense bf16 peak, NVLink and inter-node
    bandwidths), else an H100's (``Hardware()``), each overridden by its flag (``--peak-tflops`` or
    ``--device-kind``, ``--intra-node-bandwidth``, ``--inter-node-bandwidth``)."""
    base = Hardware() if target is None else Hardware(target.peak_flops, target.nvlink_bandwidth,
                                                        target.inter_node_bandwidth)
    peak = base.peak_flops
    if args.peak_tflops is not None:
        if args.peak_tflops <= 0:
            raise ConfigError("--peak-tflops", f"must be > 0, got {args.peak_tflops}")
        peak = args.peak_tflops * 1e12
    elif args.device_kind is not None:
        if (tflops := peak_bf16_tflops(args.device_kind)) is None:
            raise ConfigError("--device-kind", f"no peak FLOP/s known for {args.device_kind!r}; give --peak-tflops")
        peak = tflops * 1e12
    bandwidth = lambda text, flag, default: default if text is None else parse_bytes(text, flag)
    return Hardware(peak, bandwidth(args.intra_node_bandwidth, "--intra-node-bandwidth", base.intra_node_bandwidth),
                    bandwidth(args.inter_node_bandwidth, "--inter-node-bandwidth", base.inter_node_bandwidth),
                    args.node_size)


def _plan(argv: list[str] | None) -> None:
    args = _parse_args(argv)
    if not 1 <= args.devices <= MAX_DEVICES:
        raise ConfigError("--devices", f"must be an integer in [1, {MAX_DEVICES:,}], got {args.devices:,}")
    for name in ("top", "show_infeasible", "verify", "node_size"):
        if getattr(args, name) < (1 if name in ("top", "node_size") else 0):
            raise ConfigError(f"--{name.replace('_', '-')}", f"must be a positive integer, got "
                              f"{getattr(args, name)}")
    target = target_of(args.gpu)
    device_memory, memory_note = device_memory_of(args.device_memory, target)
    host_memory = None if args.host_memory is None else parse_bytes(args.host_memory, "--host-memory")
    hardware = hardware_of(args, target)
    meshes = None
    if args.mesh:
        meshes = [tuple(_parse_list(text, "--mesh", int)) for text in args.mesh]
        if any(len(m) != 4 or min(m) < 1 for m in meshes):
            raise ConfigError("--mesh", f"give four positive sizes data,fsdp,tensor,stage; got {args.mesh}")
    zeros = _parse_list(args.zero, "--zero", int)
    if not zeros or any(z not in (0, 1, 2, 3) for z in zeros):
        raise ConfigError("--zero", f"ZeRO stages are 0, 1, 2, 3; got {args.zero!r}")
    remats = _parse_list(args.remat, "--remat", RematPolicy)
    schedules = None if args.schedule is None else _parse_list(args.schedule, "--schedule", Schedule)
    if schedules is not None and (not schedules or Schedule.CUSTOM in schedules):
        raise ConfigError("--schedule", f"give some of gpipe, 1f1b, interleaved, zb_h1; got {args.schedule!r}")
    presets = None if args.preset is None else _parse_list(args.preset, "--preset", Preset)
    if presets is not None and not presets:
        raise ConfigError("--preset", f"give some of {', '.join(p.value for p in Preset)}; got {args.preset!r}")
    if args.write_config:
        check_write_config(pathlib.Path(args.write_config), args.config, args.overwrite)
    gpus, why_cpu = start_verify(args.devices, target, args.node_size) if args.verify else (None, "")
    if args.verify and gpus is None:  # compared against XLA:CPU: its fitted constants, not XLA:GPU's
        hardware = dataclasses.replace(hardware, compiler=Compiler.XLA_CPU)
    cfg = load_config(args.config, args.overrides)
    presets = search_presets(cfg) if presets is None else presets
    plan = make_plan(cfg, args.devices, device_memory, host_memory, hardware=hardware, meshes=meshes,
                     zero_stages=zeros, remats=remats, schedules=schedules,
                     presets=presets,
                     progress=(progress := ProgressLine()))
    progress.finish()
    print(format_plan(plan, args.top, args.show_infeasible, meshes or (), memory_note), flush=True)
    fit = plan.ranked()[0]
    if not fit:
        print(format_changes(plan, single_changes(plan, zeros, remats, presets, meshes)), flush=True)
    if args.write_config:
        write_config(plan, args.config, args.overrides, pathlib.Path(args.write_config), args.overwrite)
    if args.verify and not fit:
        print("\nverify: nothing to verify: no layout fits")
    elif args.verify:
        results = [(est, verify(args.config, args.overrides, est, args.devices, gpus)) for est in fit[:args.verify]]
        print(format_verify(results, args.devices, device_memory, cfg, gpus, why_cpu))


class ProgressLine:
    """The search's progress on stderr, for a search longer than a second: one line rewritten in
    place on a terminal (else a line every 2 s), ``planning: N layouts estimated (T s)``."""

    def __init__(self):
        self.started = self.last = time.perf_counter()
        self.shown = False

    def __call__(self, count: int) -> None:
        now = time.perf_counter()
        interval = 0.2 if sys.stderr.isatty() else 2.0
        if now - self.started < 1.0 or now - self.last < interval:
            return
        self.last = now
        end = "\r" if sys.stderr.isatty() else "\n"
        print(f"planning: {count:,} layouts estimated ({now - self.started:.1f} s)", end=end, file=sys.stderr,
              flush=True)
        self.shown = True

    def finish(self) -> None:
        """Ends a rewritten line (so that what follows starts on its own)."""
        if self.shown and sys.stderr.isatty():
            print(file=sys.stderr, flush=True)


def check_write_config(path: pathlib.Path, config: str | None, overwrite: bool) -> None:
    """Refuses a ``--write-config`` target that is a symbolic link, not a regular file, the ``--config``
    file itself, or (without ``overwrite``) an existing file."""
    if path.is_symlink():
        raise ConfigError("--write-config", f"{path} is a symbolic link; give the path of a regular file "
                          "(nothing is written through a link)")
    if not path.exists():
        return
    if not path.is_file():
        raise ConfigError("--write-config", f"{path} is not a regular file; give a file name")
    if config is not None and pathlib.Path(config).exists() and path.samefile(config):
        raise ConfigError("--write-config", f"{path} is the --config file; write the planned config to another file")
    if not overwrite:
        raise ConfigError("--write-config", f"{path} exists; pass --overwrite to replace it, or give a new file name")


def write_config(plan: Plan, config: str | None, overrides: list[str], path: pathlib.Path,
                 overwrite: bool = False) -> None:
    """Writes ``config`` with ``overrides`` and the best layout of ``plan`` applied (its mesh, ZeRO
    stage, remat, accumulation, microbatches, offload) to ``path`` as YAML that ``meshtrain.train
    --config`` runs as is, whole or not at all (a new file in the same directory renamed over it); a
    one-line error, nothing written, when no layout fits or ``check_write_config`` refuses ``path``."""
    fit = plan.ranked()[0]
    if not fit:
        raise ConfigError("--write-config", f"no layout fits on {plan.devices} devices; nothing written to {path}")
    check_write_config(path, config, overwrite)
    chosen = load_config(config, [*overrides, *fit[0].candidate.overrides()])
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        # O_EXCL: a file of its own, never one (or a link) already at that name.
        stream = os.fdopen(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "w")
    except OSError as error:
        raise ConfigError("--write-config", f"cannot write {path}: {error.strerror}") from None
    try:
        with stream:
            stream.write(yaml.safe_dump(to_dict(chosen), sort_keys=False))
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except OSError as error:
        temporary.unlink(missing_ok=True)
        raise ConfigError("--write-config", f"cannot write {path}: {error.strerror}") from None
    print(f"wrote {path}: layout 1, {' '.join(fit[0].candidate.overrides())}", flush=True)


def main(argv: list[str] | None = None) -> int:
    return run(_plan, argv)


if __name__ == "__main__":
    sys.exit(main())

"""Compile-only NVIDIA GPUs on any host: XLA:GPU's compiler run without a GPU or a driver.

With a JAX CUDA plugin installed (``make setup-gpu-compile``) and ``jax_platforms`` set to ``cpu``
before JAX's backends start, ``jax.experimental.topologies`` gives compile-only devices of a target
GPU (``Target``: its ``GpuTargetConfigProto``, the text spec XLA itself keeps for that card, shipped
in ``meshtrain/gpu_targets/``). A mesh over them compiles the real train step with XLA:GPU: its
memory analysis, optimized HLO and serialized executable are the GPU's, nothing executes.

What deviceless compilation cannot do, and what this module does about it:
- XLA sizes CUB's radix sort's scratch by asking the CUDA runtime for a device, which fails
  (``cudaErrorInvalidDevice``; seen on jaxlib 0.10.2 and 0.11.2): ``DEVICELESS_FLAGS`` turn that
  sort off, so a compile-only program sorts with XLA's own sort kernel (the dropless MoE dispatch's
  argsort) where a GPU run would use CUB's.
- jax's cuDNN attention asks the default backend (the CPU here) for the GPU's compute capability at
  trace time; ``answered_for`` answers it from the mesh's devices while a step is traced.
- no autotuning: GEMM tilings are XLA's defaults; cuDNN workspaces count 0 bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import importlib.resources
import os
import re
import time
from collections.abc import Iterator, Sequence

from meshtrain.errors import ConfigError, cut
from meshtrain.metrics import peak_bf16_tflops
from meshtrain.xla_flags import cuda_plugin_installed, merge_flags

INSTALL_HINT = ("compiling for GPUs needs a JAX CUDA plugin: run `make setup-gpu-compile`, then "
                "`.venv-gpu/bin/python -m meshtrain.compile ...`")
# XLA flags every deviceless compile needs (module docstring).
DEVICELESS_FLAGS = ("--xla_gpu_enable_cub_radix_sort=false",)
# Fields of XLA's current target specs that an older jaxlib's GpuTargetConfigProto lacks (dropped
# when the full spec does not parse): 0.10.2 rejects collective_memory_granularity.
NEWER_SPEC_FIELDS = ("collective_memory_granularity",)


class Target(str, enum.Enum):
    """A GPU to compile for and plan on: the spec file under ``meshtrain/gpu_targets/`` (its memory)
    and ``LINKS`` (its NVLink and inter-node bandwidths); its dense bf16 peak is ``meshtrain.metrics``'s
    (the table MFU reads)."""

    H100 = "h100"  # H100 SXM, 80 GB HBM3 (79 GiB)
    H200 = "h200"  # H200, 141 GiB HBM3e
    B200 = "b200"  # B200, 178 GiB HBM3e as its spec declares

    @property
    def device_kind(self) -> str:
        """The ``device_kind`` jax gives the card (what ``meshtrain.metrics.peak_bf16_tflops`` reads)."""
        return {"h100": "NVIDIA H100 80GB HBM3", "h200": "NVIDIA H200", "b200": "NVIDIA B200"}[self.value]

    @property
    def peak_flops(self) -> float:
        """Dense bf16 peak FLOP/s per GPU (``meshtrain.metrics``: NVIDIA's datasheets)."""
        return peak_bf16_tflops(self.device_kind) * 1e12

    @property
    def nvlink_bandwidth(self) -> float:
        """Bytes/s per GPU and direction over NVLink, inside a node (``LINKS``)."""
        return LINKS[self][0]

    @property
    def inter_node_bandwidth(self) -> float:
        """Bytes/s per GPU and direction across nodes (``LINKS``)."""
        return LINKS[self][1]

    def spec_text(self) -> str:
        """The target's ``GpuTargetConfigProto`` text, as shipped."""
        return importlib.resources.files("meshtrain").joinpath("gpu_targets", f"{self.value}.txtpb").read_text()

    def memory_bytes(self) -> int:
        """The device memory the spec declares (``device_memory_size``)."""
        for line in self.spec_text().splitlines():
            if line.strip().startswith("device_memory_size:"):
                return int(line.split(":")[1])
        raise ValueError(f"{self.value}'s spec declares no device_memory_size")


# Per GPU and direction, bytes/s: (NVLink inside a node, the network across nodes). NVIDIA's
# datasheets: H100 SXM and H200 SXM, NVLink 4 at 900 GB/s both directions (450 each); B200, NVLink 5
# at 1.8 TB/s (900 each). Across nodes, one 400 Gb/s ConnectX-7 NIC per GPU (DGX H100, H200 and
# B200): 50 GB/s.
LINKS: dict[Target, tuple[float, float]] = {
    Target.H100: (450e9, 50e9),
    Target.H200: (450e9, 50e9),
    Target.B200: (900e9, 50e9),
}


def without_fields(spec: str, fields: Sequence[str]) -> str:
    """``spec`` without the scalar lines setting any of ``fields``."""
    return "\n".join(line for line in spec.splitlines() if line.strip().split(":")[0] not in fields) + "\n"


def start_compile_only() -> None:
    """Prepares this process for compile-only GPUs; call before JAX's backends start. The CUDA
    plugin registers its topologies only when ``jax_platforms`` is ``cpu`` (on a machine without a
    GPU it fails its CUDA checks otherwise); JAX's own devices stay the host CPU. Adds
    ``DEVICELESS_FLAGS`` to ``XLA_FLAGS``. ``ConfigError`` without a plugin or once JAX started."""
    if not cuda_plugin_installed():
        raise ConfigError("--target", INSTALL_HINT)
    import jax

    os.environ["XLA_FLAGS"] = merge_flags(os.environ.get("XLA_FLAGS", ""), list(DEVICELESS_FLAGS))
    try:
        jax.config.update("jax_platforms", "cpu")
    except RuntimeError as err:
        raise ConfigError("--target", f"JAX already started its backends ({err}); compile in a fresh process") \
            from None


def topology(target: Target, hosts: int = 1, gpus_per_host: int = 8) -> list:
    """``hosts * gpus_per_host`` compile-only devices of ``target``, with the process index of the
    host each belongs to (after ``start_compile_only``)."""
    from jax.experimental import topologies

    if hosts < 1 or gpus_per_host < 1:
        raise ConfigError("--hosts" if hosts < 1 else "--gpus-per-host", "must be a positive integer")
    shape = f"1x{hosts}x{gpus_per_host}"
    spec = target.spec_text()
    try:
        description = topologies.get_topology_desc(platform="cuda", target_config=spec, topology=shape)
    except Exception as err:  # noqa: BLE001 - the plugin raises XlaRuntimeError / ValueError by version
        if "parse" not in str(err).lower():
            raise ConfigError("--target", f"XLA gives no {target.value} topology {shape}: {str(err)[:300]}; "
                              f"{INSTALL_HINT}") from None
        description = topologies.get_topology_desc(platform="cuda", target_config=without_fields(
            spec, NEWER_SPEC_FIELDS), topology=shape)
    return list(description.devices)


@contextlib.contextmanager
def answered_for(devices: Sequence) -> Iterator[None]:
    """While a step is traced for ``devices``, jax's cuDNN attention checks (head width, packed
    layouts, latent attention) read the compute capability of ``devices``, not of the default
    backend. Nothing changes when the default backend is those devices' own."""
    import jax
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

    device = devices[0]
    if device.platform != "gpu" or jax.devices()[0].platform == "gpu":  # the checks' own answer is right
        yield
        return
    capability = tuple(int(x) for x in device.compute_capability.split("."))
    parse = lambda text: tuple(int(x) for x in text.split("."))
    answers = {"check_compute_capability": lambda wanted: capability >= parse(wanted),
               "is_cuda_compute_capability_equal": lambda wanted: capability == parse(wanted)}
    saved = {name: getattr(cudnn_attention, name) for name in answers}
    try:
        for name, answer in answers.items():
            setattr(cudnn_attention, name, answer)
        yield
    finally:
        for name, original in saved.items():
            setattr(cudnn_attention, name, original)


# JAX's GPU allocator takes this fraction of the device's memory unless XLA_PYTHON_CLIENT_MEM_FRACTION says.
JAX_DEFAULT_MEMORY_FRACTION = 0.75


def memory_fraction() -> float:
    """The fraction of a GPU's memory a run's allocator gets (``XLA_PYTHON_CLIENT_MEM_FRACTION``)."""
    text = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    try:
        value = float(text) if text else JAX_DEFAULT_MEMORY_FRACTION
    except ValueError:
        raise ConfigError("XLA_PYTHON_CLIENT_MEM_FRACTION", f"must be a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise ConfigError("XLA_PYTHON_CLIENT_MEM_FRACTION", f"must be in (0, 1], got {text!r}")
    return value


def refusal(message: str, limit: int = 400) -> str:
    """XLA's reason for refusing a program, on one line: the exception a Python callback raised
    inside XLA (a custom partitioner's traceback) where there is one, else XLA's own message."""
    raised = re.findall(r"\b\w+(?:Error|Exception): [^\n]+", message) if "Traceback" in message else []
    return cut(raised[-1] if raised else " ".join(message.split()), limit)


@dataclasses.dataclass
class CompileReport:
    """What XLA:GPU made of one train step, per device (``compile_step``)."""

    target: str
    devices: int
    hosts: int
    mesh: dict[str, int]
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    peak_bytes: int
    planned_peak_bytes: int  # meshtrain.plan's estimate of the same layout (``Estimate.total``)
    device_memory_bytes: int
    usable_memory_bytes: int
    fits: bool
    custom_calls: dict[str, int]
    fusion_kinds: dict[str, int]
    collectives: dict[str, int]
    collective_bytes: dict[str, int]
    async_collectives: dict[str, int]
    fp8_gemms: int
    ragged_dots: int
    flops: float
    compile_seconds: float
    kernels: list[str]  # the start-up lines of meshtrain.train (Trainer.describe_kernels)
    jax: str
    jaxlib: str

    @property
    def cudnn_attention(self) -> int:
        return sum(n for target, n in self.custom_calls.items() if target.startswith("__cudnn$fmha"))


@dataclasses.dataclass
class CompiledStep:
    """The compiled executable, its optimized HLO text and its report."""

    compiled: object
    hlo: str
    report: CompileReport


def compile_step(cfg, devices: Sequence, target: Target, fraction: float | None = None) -> CompiledStep:
    """The train step ``meshtrain.train`` builds for ``cfg`` (its Layout, Trainer, step and XLA
    options), compiled by XLA:GPU for the compile-only ``devices`` of ``target``; the report sets the
    planner's estimate of the same layout beside XLA's peak.
    ``ConfigError`` on ``compile`` with XLA's reason when XLA refuses it."""
    import jax
    import jaxlib
    import numpy as np

    from meshtrain.data import Packing
    from meshtrain.measure.hlo import Module, footprint_bytes, memory_of
    from meshtrain.mesh import make_mesh
    from meshtrain.planner.estimate import layout_estimate
    from meshtrain.trainer import Trainer

    device_memory = target.memory_bytes()
    usable = int(device_memory * (memory_fraction() if fraction is None else fraction))
    mesh = make_mesh(cfg.mesh, devices)
    # A chunk left to the devices is chosen for what a run's allocator gets on them, as on a real GPU.
    trainer = Trainer(cfg.layout(mesh.shape), mesh, cfg.optimizer, device_memory=usable)
    packed = cfg.data.packing is Packing.DOCUMENTS
    kernels = trainer.describe_kernels(packed)
    planned = layout_estimate(trainer.layout, np.dtype(cfg.train.compute_dtype).itemsize).total
    start = time.perf_counter()
    try:
        with answered_for(devices):
            lowered = trainer.train_step.lower(trainer.abstract_state(), trainer.abstract_batch(packed))
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as err:
        raise ConfigError("compile", f"XLA:GPU refused the step for {target.value}: {refusal(str(err))}") from None
    seconds = time.perf_counter() - start
    memory = memory_of(compiled)
    hlo = compiled.as_text()
    census = Module(hlo).census()
    peak = max(memory["peak_memory_bytes"] or 0, footprint_bytes(memory))
    whole = lambda counter: {key: round(value) for key, value in sorted(counter.items())}
    report = CompileReport(
        target=target.value, devices=len(devices), hosts=len({d.process_index for d in devices}),
        mesh=dict(mesh.shape), argument_bytes=memory["argument_bytes"], output_bytes=memory["output_bytes"],
        alias_bytes=memory["alias_bytes"], temp_bytes=memory["temp_bytes"], peak_bytes=peak,
        planned_peak_bytes=planned,
        device_memory_bytes=device_memory, usable_memory_bytes=usable, fits=peak <= usable,
        custom_calls=whole(census.custom_calls), fusion_kinds=whole(census.fusion_kinds),
        collectives=whole(census.collectives), collective_bytes=whole(census.collective_bytes),
        async_collectives=whole(census.async_collectives), fp8_gemms=round(census.fp8_gemms),
        ragged_dots=round(census.ragged_dots), flops=census.flops, compile_seconds=round(seconds, 2),
        kernels=kernels, jax=jax.__version__, jaxlib=jaxlib.__version__)
    return CompiledStep(compiled, hlo, report)


# The line of a shipped config that documents the GPU layout it is meant for, as the compile tool's
# arguments and an optional remark in parentheses: ``# gpu layout: --target h100 --hosts 8 (a remark)``.
GPU_LAYOUT_PREFIX = "# gpu layout:"


def documented_gpu_layout(config: str | os.PathLike) -> list[str] | None:
    """The ``meshtrain.compile`` arguments a config's ``# gpu layout:`` line documents (None without one)."""
    import pathlib
    import shlex

    for line in pathlib.Path(config).read_text().splitlines():
        if line.startswith(GPU_LAYOUT_PREFIX):
            return shlex.split(line[len(GPU_LAYOUT_PREFIX):].split("(")[0])
    return None

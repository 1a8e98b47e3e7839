"""Recommended XLA flags for GPU training runs, each with the reason it is set, and the arms that
``scripts/gpu_check.py`` times against each other.

``apply_recommended(layout)`` appends ``recommended_set(layout)`` to ``XLA_FLAGS`` before JAX's
backends start, only when the run can land on a CUDA GPU (a CUDA plugin is installed and
``jax_platforms`` does not exclude it), and never overrides a flag the user already put in
``XLA_FLAGS``. ``MESHTRAIN_XLA_FLAGS=0`` turns it off. The flags only steer XLA:GPU's scheduler,
fusion and launch choices; numerics are unchanged.

What depends on the layout (``meshtrain.parallel.layout.Layout``; none of it starts a backend):
- the collective combine thresholds (``combine_thresholds``), from the per-device bytes of one
  stacked layer's parameters and gradients, so that a layer's many per-parameter all-gathers and
  reduce-scatters become one each instead of pieces (fixed 128 MiB thresholds split an 8B layer's
  gather: its weights are ~436 MB in bf16);
- collective matmul (windowed einsum), only when ``tensor`` is the mesh's one split axis: it overlaps
  the tensor-parallel all-gather / reduce-scatter of activations with the matmul that consumes or
  makes them (nothing to overlap without tensor parallelism; beside FSDP or DP, XLA:GPU refuses to
  compile it: ``collective_matmul``).
Without a layout the thresholds stay at the fixed 128 MiB and collective matmul is off.

Arms (``Arm``): FIXED is the set before the derived one (fixed thresholds, XLA's own command buffers),
DERIVED this set, O1 this set compiled at ``jax_optimization_level=O1``. Flags are read once, when a
backend starts, so an arm is given per compile as the XLA debug options that differ between arms
(``arm_setting``; ``lowered.compile(compiler_options=...)``, which sets the same debug options, see
tests/test_xla_flags.py), with the optimization level as a compile option too (``compile_arm``).
On one device there are no collectives: there the arms differ in command buffers and the
optimization level only.

None of these has been measured on a GPU by this project yet (docs/benchmarks.md): the first GPU
session's gpu_check table decides the default. An unknown flag makes XLA abort at start-up, so every
flag is parsed by the installed jaxlib in the tests; ``meshtrain.cli.check_xla_flags`` refuses the user's
unknown ones (and tokens that are no flag) in one line before a backend starts.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import importlib.metadata
import math
import os
import pkgutil
import re
from collections.abc import Callable
from typing import Any

DISABLE_ENV = "MESHTRAIN_XLA_FLAGS"
# The first jaxlib whose XLA spells the collective-pipelining switches as enums
# (``--xla_gpu_pipeline_all_gather=on``); earlier ones know only ``--xla_gpu_enable_pipelined_*=true``,
# which later ones still accept as deprecated aliases in XLA_FLAGS (not as compile options).
PIPELINE_ENUMS_SINCE = (0, 11)

MIB = 1 << 20
# The fixed combine thresholds (the FIXED arm, and the set without a layout).
FIXED_COMBINE_BYTES = 128 * MIB
# Derived thresholds never go below XLA's own default (31,457,287 bytes on jaxlib 0.10.2 and 0.11.2).
COMBINE_FLOOR_BYTES = 32 * MIB
# The widest dtype a layer's parameters or gradients move in: the fp32 master weights and their
# gradients. Whether XLA gathers before or after the cast to the compute dtype is its choice (XLA:CPU
# gathers f32 here); a threshold sized for fp32 holds one layer either way, and inside the scanned
# layer loop there is only that layer's collectives to combine, so the margin costs nothing there.
WIDEST_BYTES = 4
# XLA's default command-buffer capture set, by jaxlib (read from XLA dumps of jaxlib 0.10.2, 0.11.2
# and 0.12.0.1; the FIXED arm restores it; tests/test_xla_flags.py checks it against the installed
# jaxlib): 0.12 adds the collectives' kernels.
XLA_DEFAULT_COMMAND_BUFFERS = {(0, 10): "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,DYNAMIC_SLICE_FUSION",
                               (0, 12): "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,DYNAMIC_SLICE_FUSION,"
                                        "COLLECTIVES_KERNEL"}
# XLA's effort levels (ExecutionOptions' EFFORT_O0..O3), by jax_optimization_level's names.
EFFORT_LEVELS = {"O0": 9, "O1": 19, "O2": 29, "O3": 39}
# XLA's default windowed-einsum threshold (MiB): in effect off.
XLA_DEFAULT_WINDOWED_EINSUM_MIB = 100000

ALL_GATHER = "xla_gpu_all_gather_combine_threshold_bytes"
REDUCE_SCATTER = "xla_gpu_reduce_scatter_combine_threshold_bytes"
ALL_REDUCE = "xla_gpu_all_reduce_combine_threshold_bytes"
COMMAND_BUFFER = "xla_gpu_enable_command_buffer"
WINDOWED_EINSUM = "xla_gpu_threshold_for_windowed_einsum_mib"
MULTI_STREAMED_EINSUM = "xla_gpu_multi_streamed_windowed_einsum"
# The flags whose values differ between arms (each arm sets all of them per compile).
ARM_FLAGS = (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, COMMAND_BUFFER, WINDOWED_EINSUM)


def xla_default_command_buffers() -> str:
    """The installed jaxlib's default ``xla_gpu_enable_command_buffer`` (``XLA_DEFAULT_COMMAND_BUFFERS``:
    the entry of the newest version at or below it)."""
    version = jaxlib_version()[:2]
    return XLA_DEFAULT_COMMAND_BUFFERS[max(v for v in XLA_DEFAULT_COMMAND_BUFFERS if v <= version)]


def jaxlib_version() -> tuple[int, ...]:
    """The installed jaxlib's version as integers (``(0, 11, 2)``), read without importing it."""
    version = importlib.metadata.version("jaxlib")
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def pipelining_flag(collective: str, why: str, version: tuple[int, ...]) -> tuple[str, str, str]:
    """The flag that pipelines ``collective`` (all_gather, reduce_scatter, all_reduce) out of the
    scanned layer loop, as jaxlib ``version``'s XLA spells it."""
    if version >= PIPELINE_ENUMS_SINCE:
        return f"xla_gpu_pipeline_{collective}", "on", why
    return f"xla_gpu_enable_pipelined_{collective}", "true", why


@dataclasses.dataclass(frozen=True)
class LayerBytes:
    """Per device, of one stacked layer (the largest over the model's stacks: ``layers`` and each
    ``STACKED`` axis), at ``WIDEST_BYTES`` per element: ``gathered``, its ZeRO-sharded weights as
    all-gathered for compute (the all-gathers' results); ``reduce_scattered``, those weights'
    gradients as reduce-scattered (the results: the gradient shards); ``reduced``, its gradients as
    stored that an all-reduce sums: those whose stored spec leaves out a mesh axis (of size > 1) that
    splits the batch (data parallelism; fsdp too when the ZeRO stage keeps gradients whole)."""

    gathered: int
    reduce_scattered: int
    reduced: int


def layer_bytes(layout) -> LayerBytes:
    """``LayerBytes`` of ``layout``, from its specs: at rest (the ZeRO stage's parameters and
    gradients) and in compute (``ZeroStage.NONE``), each parameter's elements per device and per
    layer being the product of its non-stacked dimensions over the ways its spec splits them."""
    from flax import nnx

    from meshtrain.parallel.rules import mesh_axes_of
    from meshtrain.parallel.zero import ZeroStage
    from models.api import AxisRole
    from models.common import logical_axes_of

    stacks = {"layers"} | {axis for axis, role in layout.family.axis_roles.items() if role is AxisRole.STACKED}
    batch = {axis for axis in layout.batch_axes if layout.mesh_shape[axis] > 1}
    state = layout.state_specs()
    tables = [{path: variable.get_value() for path, variable in nnx.to_flat_state(tree)}
              for tree in (state.params, state.grads, layout.state_specs(ZeroStage.NONE).params)]
    per_stack = collections.defaultdict(lambda: [0.0, 0.0, 0.0])  # stack -> gathered, reduce-scattered, reduced

    for path, variable in nnx.to_flat_state(layout.abstract_params):
        axes = logical_axes_of(variable)
        if not axes or axes[0] not in stacks:
            continue
        stored, grads, compute = (_per_layer(layout, variable.shape, table[path]) for table in tables)
        totals = per_stack[axes[0]]
        totals[0] += compute if stored < compute else 0.0
        totals[1] += grads if grads < compute else 0.0
        grads_axes = {axis for entry in tables[1][path] for axis in mesh_axes_of(entry)}
        totals[2] += grads if batch - grads_axes else 0.0
    largest = [max((totals[i] for totals in per_stack.values()), default=0.0) for i in range(3)]
    return LayerBytes(*(math.ceil(elements * WIDEST_BYTES) for elements in largest))


def _per_layer(layout, shape: tuple[int, ...], spec) -> float:
    """Elements per device of one layer of a stacked parameter of ``shape`` laid out by ``spec``."""
    ways = layout.ways(spec) + [1] * (len(shape) - len(spec))
    return math.prod(shape[1:]) / math.prod(ways[1:])


@dataclasses.dataclass(frozen=True)
class CombineThresholds:
    """XLA:GPU's combine thresholds (bytes): collectives of one kind are merged while the sum of
    their results stays within the threshold."""

    all_gather: int
    reduce_scatter: int
    all_reduce: int


def _threshold(nbytes: int) -> int:
    return max(COMBINE_FLOOR_BYTES, math.ceil(nbytes / MIB) * MIB)


def combine_thresholds(layout=None) -> CombineThresholds:
    """The combine thresholds of ``layout`` (``FIXED_COMBINE_BYTES`` each without one)::

        all_gather     = max(32 MiB, ceil_MiB(4 B x one layer's ZeRO-sharded weights, gathered, per device))
        reduce_scatter = max(32 MiB, ceil_MiB(4 B x those weights' gradient shards, per device))
        all_reduce     = max(32 MiB, ceil_MiB(4 B x one layer's all-reduced gradients as stored, per device))

    "One layer": the largest over the model's stacks of layers (``LayerBytes``); 4 B: fp32, the
    widest dtype they move in (``WIDEST_BYTES``); 32 MiB: never below XLA's own default. XLA compares
    each collective's result size with the threshold (an all-gather's gathered array, a
    reduce-scatter's shard), so one layer's collectives of each kind fit one combined op. Across
    layers nothing is combined anyway: each iteration of the scanned loop holds one layer's."""
    if layout is None:
        return CombineThresholds(FIXED_COMBINE_BYTES, FIXED_COMBINE_BYTES, FIXED_COMBINE_BYTES)
    layer = layer_bytes(layout)
    return CombineThresholds(_threshold(layer.gathered), _threshold(layer.reduce_scattered),
                             _threshold(layer.reduced))


def collective_matmul(layout) -> bool:
    """Whether ``layout`` gets the collective-matmul (windowed einsum) flags: only when ``tensor > 1``
    is the one axis splitting the mesh. Beside FSDP or data parallelism XLA:GPU refuses the step
    under these flags (jaxlib 0.11.2, compile-only H100: FSDP x TP fails shape inference of a
    windowed dot, DP x TP + SP the verifier of an async GEMM; tests_gpu compiles both layouts)."""
    if layout is None:
        return False
    shape = layout.mesh_shape
    return shape["tensor"] > 1 and all(size == 1 for axis, size in shape.items() if axis != "tensor")


def recommended_set(layout=None, version: tuple[int, ...] | None = None) -> tuple[tuple[str, str, str], ...]:
    """The recommended flags as (flag, value, why), for ``layout`` (see the module docstring) and
    jaxlib ``version`` (default: the installed one)."""
    version = jaxlib_version() if version is None else version
    thresholds = combine_thresholds(layout)
    derived = "one layer's" if layout is not None else "fixed 128 MiB, no layout given:"
    flags = [
        ("xla_gpu_enable_latency_hiding_scheduler", "true",
         "schedule async collectives (FSDP all-gathers, gradient reduce-scatters) to overlap compute"),
        ("xla_gpu_enable_triton_gemm", "false",
         "use cuBLAS(Lt) for the large bf16 GEMMs of a transformer; Triton GEMM autotuning is slower there"),
        ("xla_gpu_enable_highest_priority_async_stream", "true",
         "run collectives on a high-priority stream so they are not starved by compute kernels"),
        (ALL_REDUCE, str(thresholds.all_reduce),
         f"combine the per-parameter gradient all-reduces (DP) of one layer into one ({derived} gradients)"),
        (ALL_GATHER, str(thresholds.all_gather),
         f"combine FSDP's per-parameter all-gathers of one layer into one ({derived} gathered weights)"),
        (REDUCE_SCATTER, str(thresholds.reduce_scatter),
         f"combine FSDP's per-parameter gradient reduce-scatters of one layer into one ({derived} gradient "
         "shards)"),
        *(pipelining_flag(collective, why, version) for collective, why in (
            ("all_gather", "inside the scanned layer loop, gather the next layer's weights while this layer computes"),
            ("reduce_scatter", "inside the scanned backward loop, reduce-scatter a layer's gradients during the next "
                               "layer"),
            ("all_reduce", "the same overlap for all-reduced gradients (DP, and TP's row-parallel outputs)"))),
        ("xla_gpu_enable_while_loop_double_buffering", "true",
         "double-buffer the layer scan's carries so the pipelined collectives above have room to overlap"),
        (COMMAND_BUFFER, "",
         "no CUDA-graph command buffers, as MaxText's Hopper (A3, H100) training recipes set and JAX's GPU "
         "tips ask for auto-PGLE and pipeline parallelism; XLA's default captures fusions and GEMMs (the "
         "FIXED arm): gpu_check times both"),
    ]
    if collective_matmul(layout):
        flags += [
            (WINDOWED_EINSUM, "0",
             "tensor > 1: collective matmul for every TP matmul: split it into chunks, each chunk's "
             "all-gather / reduce-scatter overlapping the next chunk's GEMM"),
            (MULTI_STREAMED_EINSUM, "true", "run collective matmul's chunks on several streams"),
        ]
    return tuple(flags)


# The set without a layout: fixed thresholds, no collective matmul.
RECOMMENDED_GPU_FLAGS: tuple[tuple[str, str, str], ...] = recommended_set()


def recommended_flags(layout=None) -> list[str]:
    """The flags as ``--name=value`` strings."""
    return [f"--{name}={value}" for name, value, _ in recommended_set(layout)]


class Arm(str, enum.Enum):
    """One flag set timed by scripts/gpu_check.py."""

    FIXED = "fixed"  # the set before the derived one: 128 MiB thresholds, XLA's command buffers, no collective matmul
    DERIVED = "derived"  # recommended_set(layout)
    O1 = "o1"  # recommended_set(layout), compiled at jax_optimization_level=O1


@dataclasses.dataclass(frozen=True)
class ArmSetting:
    """What one arm sets per compile: XLA debug options (``compiler_options``) and
    ``jax_optimization_level`` (None: JAX's default)."""

    options: dict[str, str]
    optimization_level: str | None = None


def arm_setting(arm: Arm, layout=None) -> ArmSetting:
    """The compile options of ``arm`` for ``layout``: every flag of ``ARM_FLAGS``, with XLA's
    default where the arm's set leaves a flag out."""
    defaults = {COMMAND_BUFFER: xla_default_command_buffers(), WINDOWED_EINSUM: str(XLA_DEFAULT_WINDOWED_EINSUM_MIB)}
    if arm is Arm.FIXED:
        values = {ALL_GATHER: str(FIXED_COMBINE_BYTES), REDUCE_SCATTER: str(FIXED_COMBINE_BYTES),
                  ALL_REDUCE: str(FIXED_COMBINE_BYTES)}
    else:
        values = {name: value for name, value, _ in recommended_set(layout) if name in ARM_FLAGS}
    return ArmSetting({name: values.get(name, defaults.get(name)) for name in ARM_FLAGS},
                      "O1" if arm is Arm.O1 else None)


def compile_options(setting: ArmSetting) -> dict[str, str | int]:
    """``setting`` as ``compiler_options``: its debug options, and its optimization level as the
    build option ``optimization_level`` that ``jax_optimization_level`` sets (an integer: XLA's effort
    enum, as jax 0.10's ``EffortLevel`` and 0.11's ``CompilerEffortLevel`` number it). Given here, not
    through ``jax.config``, because the level is no part of the key of JAX's in-memory compile cache:
    a second compile of the same program under another ``jax_optimization_level`` returns the first
    executable (seen on jax 0.10.2 and 0.11.2)."""
    if setting.optimization_level is None:
        return dict(setting.options)
    return {**setting.options, "optimization_level": EFFORT_LEVELS[setting.optimization_level]}


def compile_arm(lower: Callable[[], Any], setting: ArmSetting):
    """``lower()`` (a ``jax.stages.Lowered``) compiled under ``setting``."""
    return lower().compile(compiler_options=compile_options(setting))


# The recommended flags whose values depend on the layout.
LAYOUT_FLAGS = (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, WINDOWED_EINSUM, MULTI_STREAMED_EINSUM)


def step_compiler_options(layout) -> dict[str, str | bool]:
    """The recommended flags that depend on ``layout`` (``LAYOUT_FLAGS``: the combine thresholds of
    its layers' bytes, collective matmul when ``tensor > 1``) as ``compiler_options`` for its step's
    compile. ``XLA_FLAGS`` are read when the backend starts, before a run has built its layout, so
    ``apply_recommended`` can only set the layout-free defaults there; this refines them per compile.
    A flag ``XLA_FLAGS`` sets to anything but that default is the user's and is left alone; nothing
    under ``MESHTRAIN_XLA_FLAGS=0``. XLA:CPU ignores these (GPU) options."""
    if os.environ.get(DISABLE_ENV, "1").lower() in ("0", "false", "no", "off"):
        return {}
    defaults = {name: value for name, value, _ in recommended_set(None)}
    given = dict(re.findall(r"--([\w.]+)=(\S*)", os.environ.get("XLA_FLAGS", "")))
    boolean = {"true": True, "false": False}
    return {name: boolean.get(value, value) for name, value, _ in recommended_set(layout)
            if name in LAYOUT_FLAGS and given.get(name, defaults.get(name)) == defaults.get(name)}


def merge_flags(existing: str, flags: list[str]) -> str:
    """``existing`` XLA_FLAGS plus each of ``flags`` whose name it does not already set."""
    present = {part.lstrip("-").split("=", 1)[0] for part in existing.split()}
    added = [flag for flag in flags if flag.lstrip("-").split("=", 1)[0] not in present]
    return " ".join(filter(None, [existing.strip(), *added]))


def cuda_plugin_installed() -> bool:
    """Whether a JAX CUDA plugin (``jax_plugins.xla_cuda*``) can be loaded, without starting JAX."""
    try:
        import jax_plugins
    except ImportError:
        return False
    return any("cuda" in module.name for module in pkgutil.iter_modules(jax_plugins.__path__))


def _platforms_requested() -> str:
    """``jax_platforms`` as configured so far ('' when JAX will choose)."""
    import jax

    return (jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS", "") or "").lower()


def gpu_run_expected() -> bool:
    """Whether JAX will start on a CUDA GPU: a plugin is installed and the platforms allow it."""
    platforms = _platforms_requested()
    if platforms and not any(name in platforms for name in ("cuda", "gpu")):
        return False
    return cuda_plugin_installed()


def apply_recommended(layout=None, *, force: bool = False) -> list[str]:
    """Add the recommended flags of ``layout`` (see ``recommended_set``) to ``XLA_FLAGS`` for a GPU
    run; returns the flags added.

    Must be called before JAX's backends start (flags are read once). Does nothing when the run will
    not be on a CUDA GPU (unless ``force``), or when ``MESHTRAIN_XLA_FLAGS=0``.
    """
    if os.environ.get(DISABLE_ENV, "1").lower() in ("0", "false", "no", "off"):
        return []
    if not (force or gpu_run_expected()):
        return []
    before = os.environ.get("XLA_FLAGS", "")
    after = merge_flags(before, recommended_flags(layout))
    os.environ["XLA_FLAGS"] = after
    return after[len(before):].split()

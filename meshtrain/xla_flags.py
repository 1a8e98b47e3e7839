"""Recommended XLA flags for GPU training runs, each with the reason it is set.

``apply_recommended()`` appends these to ``XLA_FLAGS`` before JAX's backends start, only when the run
can land on a CUDA GPU (a CUDA plugin is installed and ``jax_platforms`` does not exclude it), and
never overrides a flag the user already put in ``XLA_FLAGS``. ``MESHTRAIN_XLA_FLAGS=0`` turns it off.
The flags only steer XLA:GPU's scheduler and fusion choices; numerics are unchanged.

None of these has yet been measured on a GPU by this project (see docs/benchmarks.md); an unknown
flag makes XLA abort at start-up, so the list is checked against the pinned jaxlib in the tests.
"""

from __future__ import annotations

import importlib.metadata
import os
import pkgutil
import re

DISABLE_ENV = "MESHTRAIN_XLA_FLAGS"
# The first jaxlib whose XLA spells the collective-pipelining switches as enums
# (``--xla_gpu_pipeline_all_gather=on``); earlier ones know only ``--xla_gpu_enable_pipelined_*=true``,
# which later ones still accept as deprecated aliases.
PIPELINE_ENUMS_SINCE = (0, 11)


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


# (flag, value, why)
RECOMMENDED_GPU_FLAGS: tuple[tuple[str, str, str], ...] = (
    ("xla_gpu_enable_latency_hiding_scheduler", "true",
     "schedule async collectives (FSDP all-gathers, gradient reduce-scatters) to overlap compute"),
    ("xla_gpu_enable_triton_gemm", "false",
     "use cuBLAS(Lt) for the large bf16 GEMMs of a transformer; Triton GEMM autotuning is slower there"),
    ("xla_gpu_enable_highest_priority_async_stream", "true",
     "run collectives on a high-priority stream so they are not starved by compute kernels"),
    ("xla_gpu_all_reduce_combine_threshold_bytes", "134217728",
     "combine the many small per-parameter gradient all-reduces (DP) into 128 MiB ones"),
    ("xla_gpu_all_gather_combine_threshold_bytes", "134217728",
     "combine FSDP's per-parameter all-gathers of one layer into fewer, larger ones"),
    ("xla_gpu_reduce_scatter_combine_threshold_bytes", "134217728",
     "combine FSDP's per-parameter gradient reduce-scatters of one layer"),
    *(pipelining_flag(collective, why, jaxlib_version()) for collective, why in (
        ("all_gather", "inside the scanned layer loop, gather the next layer's weights while this layer computes"),
        ("reduce_scatter", "inside the scanned backward loop, reduce-scatter a layer's gradients during the next "
                           "layer"),
        ("all_reduce", "the same overlap for all-reduced gradients (DP, and TP's row-parallel outputs)"))),
    ("xla_gpu_enable_while_loop_double_buffering", "true",
     "double-buffer the layer scan's carries so the pipelined collectives above have room to overlap"),
)


def recommended_flags() -> list[str]:
    """The flags as ``--name=value`` strings."""
    return [f"--{name}={value}" for name, value, _ in RECOMMENDED_GPU_FLAGS]


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


def apply_recommended(*, force: bool = False) -> list[str]:
    """Add the recommended flags to ``XLA_FLAGS`` for a GPU run; returns the flags added.

    Must be called before JAX's backends start (flags are read once). Does nothing when the run will
    not be on a CUDA GPU (unless ``force``), or when ``MESHTRAIN_XLA_FLAGS=0``.
    """
    if os.environ.get(DISABLE_ENV, "1").lower() in ("0", "false", "no", "off"):
        return []
    if not (force or gpu_run_expected()):
        return []
    before = os.environ.get("XLA_FLAGS", "")
    after = merge_flags(before, recommended_flags())
    os.environ["XLA_FLAGS"] = after
    return after[len(before):].split()

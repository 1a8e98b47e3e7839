"""tokamax's Pallas Mosaic-GPU flash attention (NVIDIA sm90 / sm100) for ``AttentionKernel.TOKAMAX``
(models/kernels/attention.py; docs/kernels.md for the comparison that chose it): causal, with documents
and the sliding window as each query's first visible key (``k_start`` of tokamax's mask), values of
their own width. tokamax needs jax >= 0.11 (the gpu-compile extra); it is imported only when used.

Shapes: q [batch, length, heads, head_dim]; k [batch, length, kv_heads, head_dim]; v [batch, length,
kv_heads, value_dim]; segments int [batch, length] (a document is a run of equal ids, as the packer
makes them) or None.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def tokamax_missing() -> str:
    """Why tokamax's kernels cannot be used here: '' where tokamax is installed."""
    if importlib.util.find_spec("tokamax") is None:
        return "tokamax is not installed (pip install tokamax==0.0.17 beside jax >= 0.11: the gpu-compile extra)"
    return ""


def tokamax_refusal(dtype: Any) -> str:
    """Why tokamax's flash attention cannot run inputs of ``dtype`` here ('' where it can): its
    Mosaic-GPU forward casts fp32 to bf16 and its backward refuses fp32."""
    if missing := tokamax_missing():
        return f"here: {missing}"
    if np.dtype(dtype) not in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16)):
        return f"on {np.dtype(dtype).name} inputs (it takes fp16 and bf16)"
    return ""


def first_visible_keys(segments: jax.Array | None, window: int, length: int) -> jax.Array | None:
    """int [batch or 1, 1, length]: the first key each query sees, ``k_start`` of tokamax's mask
    (which is causal besides): the start of the query's document (a run of equal ``segments``, int
    [batch, length]) and, with a window, no earlier than W - 1 positions back. None: from 0."""
    index = jnp.arange(length, dtype=jnp.int32)[None]
    first = None if not window else index - (window - 1)
    if segments is not None:
        boundary = jnp.concatenate([jnp.ones_like(segments[:, :1], bool), segments[:, 1:] != segments[:, :-1]], 1)
        starts = jax.lax.cummax(jnp.where(boundary, index, 0), axis=1)
        first = starts if first is None else jnp.maximum(starts, first)
    return None if first is None else first[:, None, :]


def tokamax_attention(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None, window: int,
                      operation: Any = None) -> jax.Array:
    """tokamax's Mosaic-GPU flash attention (``operation`` None; or another tokamax attention op, e.g.
    its XLA reference ``base.DotProductAttention()``) of q [batch, length, heads, head_dim], k [batch,
    length, kv_heads, head_dim], v [batch, length, kv_heads, value_dim] -> [batch, length, heads,
    value_dim] in q's dtype: causal, each query from its ``first_visible_keys`` on. Backward: the op's
    own VJP kernels (the output and log-sum-exp kept, the scores recomputed).

    The kernels are built for the GPU generation of JAX's default device when this is traced (the
    backward's too), their hardware checks skipped: the kernel was chosen from the mesh's devices,
    which a CPU host may only compile for. The op's kernels are called below its own ``custom_vjp``
    (whose remat optimisation would trace them later, outside that device's context), under ours.
    Under a mesh it runs on each device's rows and heads (the framework's ``shard_map``: XLA does
    not partition a kernel's custom call)."""
    if operation is None:
        from tokamax._src.ops.attention.pallas_mosaic_gpu import PallasMosaicGpuFlashAttention

        operation = PallasMosaicGpuFlashAttention()
    return _tokamax(operation, jax.config.jax_default_device, window, q, k, v, segments)


def _tokamax_target(device) -> contextlib.ExitStack:
    """tokamax told to build its kernels for ``device``'s GPU, its hardware checks skipped."""
    import tokamax

    stack = contextlib.ExitStack()
    stack.enter_context(tokamax.config.cross_compile(True))
    stack.enter_context(jax.default_device(device))
    return stack


def _tokamax_bound(operation, q, k, v, segments, window: int, **kwargs):
    """``operation``'s arguments as its ``bind`` makes them: the causal mask from each query's
    ``first_visible_keys``, tokamax's defaults for the rest, ``kwargs`` (``return_residuals``)."""
    from tokamax._src.ops.attention.base import Mask

    mask = Mask(k_start=first_visible_keys(segments, window, q.shape[1]), is_causal=True)
    return operation.bind(q, k, v, mask=mask, **kwargs)


def _tokamax_run(operation, bound):
    """``operation``'s own computation (its kernels, below its ``custom_vjp``) of ``bound`` arguments."""
    return operation._fwd(*bound.args, config=bound.default_config, **bound.kwargs)  # noqa: SLF001


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _tokamax(operation, device, window, q, k, v, segments):
    with _tokamax_target(device):
        return _tokamax_run(operation, _tokamax_bound(operation, q, k, v, segments, window))[0]


def _tokamax_forward(operation, device, window, q, k, v, segments):
    with _tokamax_target(device):
        bound = _tokamax_bound(operation, q, k, v, segments, window, return_residuals=True)
        out, softmax = _tokamax_run(operation, bound)
    return out, (q, k, v, segments, out, softmax)


def _tokamax_backward(operation, device, window, residuals, d_out):
    from tokamax._src.ops.attention.base import DotProductAttentionVjp

    q, k, v, segments, out, softmax = residuals
    backward = operation.vjp or DotProductAttentionVjp()  # tokamax's XLA reference has none: autodiff's
    with _tokamax_target(device):
        forward = {**_tokamax_bound(operation, q, k, v, segments, window).kwargs, "return_residuals": False}
        grads = _tokamax_run(backward, backward.bind(softmax, out, d_out, q, k, v, **forward))[0]
    return grads["q"], grads["k"], grads["v"], None


_tokamax.defvjp(_tokamax_forward, _tokamax_backward)

"""Grouped matmuls: rows [m, in], each belonging to one group (an expert), times their group's
weights [groups, in, out], at the cost of the rows that exist (not ``groups`` times it).

Two kernels (``GroupedKernel``):

* ``ragged``: ``jax.lax.ragged_dot`` over the rows sorted by group, forward and both backward
  products. Where the backend has a grouped GEMM (TPU) this is it; XLA:CPU expands it into a
  dense masked product over every group (``groups`` times the FLOPs and a ``[groups, m, in]``
  temporary: 355 MB against capacity mode's 55 MB on the 128-expert step of
  tests/test_moe_dispatch.py).
* ``blocked``: the rows sorted by group into ``[blocks, block, in]``, each group's rows padded to a
  whole number of blocks (``BlockSlots``), then one ``[block, in] x [in, out]`` matmul per block
  with its group's weights, in a scan (``blocked_matmul``, whose backward is written out so that
  the weight gradient accumulates in place instead of as one weight-sized cotangent per block).
  The scan has a static length, ``(m + groups * (block - 1)) // block`` blocks, but skips the
  blocks past the used ones at run time (``lax.cond``): the work is the rows of a group rounded up
  to whole blocks, for the rows that belong to a group (under expert parallelism most rows of a
  worst-case exchange buffer are padding of no group and cost no matmul); memory is the padded
  buffer. The FLOP counter (``meshtrain/measure/flops.py``) counts every block, an upper bound.

* ``tokamax``: NVIDIA GPUs' grouped GEMM, tokamax's Pallas Mosaic-GPU ``ragged_dot`` (sm90 / sm100
  kernels; docs/kernels.md for the comparison that chose it): over the rows sorted by group, forward and
  both backward products (``tokamax_matmul``), each one kernel of exactly the rows' FLOPs, no buffer
  that grows with the groups. It takes bf16 / fp16 rows (fp32 accumulation) and needs tokamax (jax >=
  0.11; the ``gpu-compile`` extra has it); it reads the GPU's generation from JAX's default
  device, which the expert exchange sets to the mesh's (``meshtrain.parallel.experts``).

``GroupedKernel.AUTO`` is ``ragged`` on TPUs, ``tokamax`` on GPUs for bf16 / fp16 rows where tokamax
is installed, and ``blocked`` elsewhere (XLA:GPU's ragged_dot is a dense GEMM over every group:
docs/gpu.md; on jax < 0.11, where tokamax does not install, GPUs run ``blocked``).

FP8 (``models.kernels.fp8.Fp8Weight`` weights): ``fp8_blocked_matmul``, the blocked kernel with E4M3 rows and
weights forward and an E5M2 output gradient backward, one per-tensor scale for all the groups'
weights (the layer's expert stack), amaxes over the mesh axes ``Fp8Weight.amax_axes`` names.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from models.kernels.attention import varying_axes
from models.kernels.tokamax_attention import tokamax_missing
from models.kernels.fp8 import Fp8Weight, observed_cotangents, quantize_gradient, quantize_operands


class GroupedKernel(str, enum.Enum):
    """``model.grouped_matmul``: which kernel runs the experts' grouped matmuls (module docstring)."""

    AUTO = "auto"
    RAGGED = "ragged"
    BLOCKED = "blocked"
    TOKAMAX = "tokamax"

    def resolve(self, platform: str, dtype: Any = None) -> GroupedKernel:
        """The kernel that runs on ``platform`` ("cpu", "gpu", "tpu") for rows of ``dtype`` (None: not
        checked). ``ValueError`` (one line) for ``tokamax`` where it cannot run."""
        if self is GroupedKernel.AUTO:
            if platform == "tpu":
                return GroupedKernel.RAGGED
            return GroupedKernel.TOKAMAX if platform == "gpu" and not tokamax_refusal(dtype) else GroupedKernel.BLOCKED
        if self is GroupedKernel.TOKAMAX and (reason := (
                "" if platform == "gpu" else f"it runs on NVIDIA GPUs, this mesh's devices are {platform}")
                or tokamax_refusal(dtype)):
            raise ValueError(f"model.grouped_matmul=tokamax cannot run: {reason}; use auto, blocked or ragged")
        return self


def tokamax_refusal(dtype: Any = None) -> str:
    """Why tokamax's grouped GEMM cannot run rows of ``dtype`` here ('' where it can)."""
    if missing := tokamax_missing():
        return missing
    if dtype is not None and jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"its Mosaic-GPU kernel takes bf16 / fp16 rows, not {jnp.dtype(dtype).name}"
    return ""


@dataclasses.dataclass(frozen=True)
class GroupedSpec:
    """The kernel, and the blocked kernel's rows per block (0: ``auto_block``)."""

    kernel: GroupedKernel = GroupedKernel.AUTO
    block: int = 0

    def describe(self, platform: str, dtype: Any = None) -> str:
        """The start-up line: the kernel that runs on ``platform`` for rows of ``dtype``, and why
        ``auto`` chose the blocked kernel on GPUs. ``ValueError`` (one line) where it cannot run."""
        kernel = self.kernel.resolve(platform, dtype)
        why = f" ({tokamax_refusal(dtype)})" if platform == "gpu" and kernel is GroupedKernel.BLOCKED else ""
        return f"experts' grouped matmul: {kernel.value}{why}"

    def resolved(self, platform: str, dtype: Any = None) -> GroupedSpec:
        """This spec with the kernel that runs on ``platform`` for rows of ``dtype`` (``GroupedKernel.resolve``)."""
        return dataclasses.replace(self, kernel=self.kernel.resolve(platform, dtype))


def auto_block(rows: int, groups: int) -> int:
    """Rows per block for ``rows`` rows in ``groups`` groups: the largest power of two at most
    ``rows / (8 * groups)`` (padding then adds at most 1/8 to the rows), within [8, 512]."""
    block = 8
    while block * 2 <= min(512, rows / (8 * groups)):
        block *= 2
    return block


def _dot(x: jax.Array, w: jax.Array, equation: str) -> jax.Array:
    """``einsum(equation)`` summed and returned in fp32."""
    return jnp.einsum(equation, x, w, preferred_element_type=jnp.float32)


def _stacked(blocks: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """A scan's stacked fp32 block results [blocks, block, width] in ``dtype``. The scans stack in
    fp32 and cast once: XLA:CPU upcasts a bf16 ``dynamic-update-slice`` to fp32, so a bf16 stack
    would be converted whole, both ways, in every iteration (blocks x the buffer's traffic)."""
    return blocks.astype(dtype)


def _varying_as(value: jax.Array, *references: jax.Array) -> jax.Array:
    """``value`` made varying over every manual mesh axis the ``references`` vary over (inside a
    ``shard_map``; its transpose sums the gradient over them), else unchanged."""
    missing = sorted({a for r in references for a in varying_axes(r)} - varying_axes(value))
    return jax.lax.pcast(value, tuple(missing), to="varying") if missing else value


def _summed_as(value: jax.Array, reference: jax.Array) -> jax.Array:
    """``value`` summed over the manual mesh axes it varies over and ``reference`` does not."""
    extra = tuple(sorted(varying_axes(value) - varying_axes(reference)))
    return jax.lax.psum(value, extra) if extra else value


def _if_used(group: jax.Array, compute: Callable[[], Any], skipped: Callable[[], Any]) -> Any:
    """``compute()`` for a block of a group (``group`` >= 0), ``skipped()`` for a block past the used
    ones: a ``lax.cond``, so that a skipped block costs no matmul at run time (the scan's length is
    static, the rows that arrive are not: under expert parallelism most of a worst-case exchange
    buffer is padding)."""
    return jax.lax.cond(group >= 0, compute, skipped)


@jax.custom_vjp
def blocked_matmul(x: jax.Array, w: jax.Array, block_group: jax.Array) -> jax.Array:
    """x [blocks, block, in], w [groups, in, out], int ``block_group`` [blocks] -> [blocks, block,
    out]: each block times its group's weights, summed in fp32, in x's dtype; zero for a block of
    group -1 (skipped, ``BlockSlots``). The scan stacks its blocks in fp32 and casts once after
    (``_stacked``)."""

    def step(_, xs):
        xb, group = xs
        zeros = lambda: _varying_as(jnp.zeros((xb.shape[0], w.shape[-1]), jnp.float32), xb, w)
        return None, _if_used(group, lambda: _dot(xb, w[group], "bi,io->bo"), zeros)

    return _stacked(jax.lax.scan(step, None, (x, block_group))[1], x.dtype)


def _blocked_forward(x, w, block_group):
    return blocked_matmul(x, w, block_group), (x, w, block_group)


def _blocked_backward(residuals, dy):
    x, w, block_group = residuals

    def step(dw, xs):
        xb, dyb, group = xs
        used = lambda: (dw.at[group].add(_dot(xb, dyb, "bi,bo->io")), _dot(dyb, w[group], "bo,io->bi"))
        return _if_used(group, used, lambda: (dw, _varying_as(jnp.zeros(xb.shape, jnp.float32), dyb, w)))

    dw, dx = jax.lax.scan(step, _varying_as(jnp.zeros(w.shape, jnp.float32), x, dy, w), (x, dy, block_group))
    # Inside a shard_map each cotangent is summed over the axes its primal is the same on.
    return _summed_as(_stacked(dx, x.dtype), x), _summed_as(dw, w).astype(w.dtype), None


blocked_matmul.defvjp(_blocked_forward, _blocked_backward)


def fp8_blocked_matmul(x: jax.Array, w: Fp8Weight, block_group: jax.Array) -> jax.Array:
    """``blocked_matmul`` with FP8 operands (module docstring): x [blocks, block, in], w.weight
    [groups, in, out] -> [blocks, block, out] in x's dtype; the gradient of ``w.observed`` is the
    amaxes of the rows, the weights and the output gradient (``models.kernels.fp8.OPERANDS``)."""
    return _fp8_blocked(w.margin, w.amax_axes, jnp.dtype(x.dtype), jnp.dtype(w.weight.dtype), x, w.weight,
                        block_group, w.observed, w.history)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _fp8_blocked(margin, axes, x_dtype, w_dtype, x, w, block_group, observed, history):
    return _fp8_blocked_forward(margin, axes, x_dtype, w_dtype, x, w, block_group, observed, history)[0]


def _fp8_blocked_forward(margin, axes, x_dtype, w_dtype, x, w, block_group, observed, history):
    del w_dtype, observed
    q = quantize_operands(x, w, history, margin, axes)
    product = lambda xb, group: _dot(xb, q.q_w[group], "bi,io->bo") * (q.scale_x * q.scale_w)
    zeros = lambda xb: _varying_as(jnp.zeros((xb.shape[0], q.q_w.shape[-1]), jnp.float32), xb, q.q_w, q.scale_x,
                                   q.scale_w)
    y = _stacked(jax.lax.scan(lambda _, xs: (None, _if_used(xs[1], lambda: product(*xs), lambda: zeros(xs[0]))),
                              None, (q.q_x, block_group))[1], x_dtype)
    return y, (q, block_group, history)


def _fp8_blocked_backward(margin, axes, x_dtype, w_dtype, residuals, dy):
    q, block_group, history = residuals
    q_g, scale_g, amax_g = quantize_gradient(dy, history, margin, axes)

    def step(dw, xs):
        xb, gb, group = xs

        used = lambda: (dw.at[group].add(_dot(xb, gb, "bi,bo->io")),
                        _dot(gb, q.q_w[group], "bo,io->bi") * (scale_g * q.scale_w))
        zeros = lambda: _varying_as(jnp.zeros(xb.shape, jnp.float32), gb, q.q_w, scale_g, q.scale_w)
        return _if_used(group, used, lambda: (dw, zeros()))

    dw, dx = jax.lax.scan(step, _varying_as(jnp.zeros(q.q_w.shape, jnp.float32), q.q_x, q_g, q.q_w),
                          (q.q_x, q_g, block_group))
    dw = _summed_as(dw * (q.scale_x * scale_g), q.q_w).astype(w_dtype)
    return (_summed_as(_stacked(dx, x_dtype), q.q_x), dw, None, *observed_cotangents(q, amax_g, history))


_fp8_blocked.defvjp(_fp8_blocked_forward, _fp8_blocked_backward)


def grouped_product(x: jax.Array, w: jax.Array | Fp8Weight, block_group: jax.Array) -> jax.Array:
    """``blocked_matmul``, or ``fp8_blocked_matmul`` for an ``Fp8Weight``."""
    return fp8_blocked_matmul(x, w, block_group) if isinstance(w, Fp8Weight) else blocked_matmul(x, w, block_group)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class BlockSlots:
    """Where each of m rows sits in a ``[blocks, block, width]`` buffer sorted by group.

    slot: int [m], the row's index in the flattened buffer (at least ``blocks * block``, distinct,
    for a row of no group: an id >= groups). block_group: int [blocks], the group of each block; -1 for the blocks
    past the used ones (zero rows, skipped by the kernels at run time).
    """

    slot: jax.Array
    block_group: jax.Array
    block: int = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def of(cls, ids: jax.Array, groups: int, block: int) -> BlockSlots:
        """The slots of rows whose groups are ``ids`` [m] (ids >= ``groups``: no group)."""
        m = ids.shape[0]
        blocks = (m + groups * (block - 1)) // block  # sum over groups of ceil(size / block), at most
        sizes = jnp.bincount(ids, length=groups)
        per_group = -(-sizes // block)
        first_block = jnp.cumsum(per_group) - per_group
        first_row = jnp.cumsum(sizes) - sizes
        order = jnp.argsort(ids, stable=True)
        ordered = ids[order]
        group = jnp.minimum(ordered, groups - 1)
        rank = jnp.arange(m) - first_row[group]
        # A row of no group gets a slot of its own past the buffer: every slot is distinct, so the
        # scatter into the buffer is unique (its transpose a plain gather).
        slot_sorted = jnp.where(ordered < groups, first_block[group] * block + rank, blocks * block + jnp.arange(m))
        slot = jnp.zeros(m, jnp.int32).at[order].set(slot_sorted.astype(jnp.int32), unique_indices=True)
        # The last group starting at or before each block (groups of no blocks start where the next does).
        starts = jnp.zeros(blocks, jnp.int32).at[first_block].add(1, mode="drop")
        block_group = jnp.clip(jnp.cumsum(starts) - 1, 0, groups - 1)
        block_group = jnp.where(jnp.arange(blocks) < jnp.sum(per_group), block_group, -1).astype(jnp.int32)
        return cls(slot=slot, block_group=block_group, block=block)

    @property
    def blocks(self) -> int:
        return self.block_group.shape[0]

    def gather(self, rows: jax.Array) -> jax.Array:
        """rows [m, width] -> the buffer [blocks, block, width] (padding rows zero)."""
        buffer = jnp.zeros((self.blocks * self.block, rows.shape[-1]), rows.dtype)
        return buffer.at[self.slot].set(rows, mode="drop", unique_indices=True).reshape(self.blocks, self.block, -1)

    def scatter(self, buffer: jax.Array) -> jax.Array:
        """The buffer [blocks, block, width] -> rows [m, width] (zero for a row of no group)."""
        flat = buffer.reshape(self.blocks * self.block, -1)
        found = jnp.take(flat, jnp.minimum(self.slot, flat.shape[0] - 1), axis=0)
        return jnp.where((self.slot < flat.shape[0])[:, None], found, 0)


def ragged_matmul(rows: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """rows [m, in] sorted by group, w [groups, in, out], ``group_sizes`` [groups] -> [m, out]
    (``jax.lax.ragged_dot``, summed in fp32, in the rows' dtype; rows past the sizes' sum: zero)."""
    return jax.lax.ragged_dot(rows, w, group_sizes, preferred_element_type=jnp.float32).astype(rows.dtype)


def _tokamax(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, numbers=None, device=None) -> jax.Array:
    """tokamax's Mosaic-GPU ``ragged_dot_general`` (default numbers: ``jax.lax.ragged_dot``'s), in fp32,
    for the GPU generation of ``device`` (None: JAX's default device). The hardware checks are skipped:
    the kernel was chosen from the mesh's devices, which a CPU host may only compile for."""
    import tokamax
    from tokamax._src.ops.ragged_dot.base import DEFAULT_RAGGED_DOT_DIM_NUMS

    with tokamax.config.cross_compile(True), jax.default_device(device or jax.config.jax_default_device):
        out = tokamax.ragged_dot_general(lhs, rhs, group_sizes, numbers or DEFAULT_RAGGED_DOT_DIM_NUMS,
                                         preferred_element_type=jnp.float32, implementation="mosaic_gpu")
    return _varying_as(out, lhs, rhs)  # inside a shard_map the kernel's result varies as its operands do


def _in_groups(rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """[m, 1]: whether each row lies within the groups (rows past the sizes' sum are padding)."""
    return (jnp.arange(rows.shape[0]) < jnp.sum(group_sizes))[:, None]


def tokamax_matmul(rows: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """rows [m, in] sorted by group (bf16 / fp16), w [groups, in, out], ``group_sizes`` [groups] ->
    [m, out] in the rows' dtype, summed in fp32; rows past the sizes' sum: zero (the kernel leaves
    them unwritten). Backward: dx by the same kernel over w transposed, dw by tokamax's ragged-
    contracting kernel, both in fp32, summed over the manual mesh axes their primal is the same on.
    The GPU generation is JAX's default device's when this is traced, for the backward too."""
    return _tokamax_matmul(jax.config.jax_default_device, rows, w, group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tokamax_matmul(device, rows, w, group_sizes):
    return _tokamax_forward(device, rows, w, group_sizes)[0]


def _tokamax_forward(device, rows, w, group_sizes):
    valid = _in_groups(rows, group_sizes)
    x, weights = _varying_as(jnp.where(valid, rows, 0), w), _varying_as(w, rows)
    y = _tokamax(x, weights, group_sizes, device=device)
    return jnp.where(valid, y, 0).astype(rows.dtype), (rows, w, group_sizes)


def _tokamax_backward(device, residuals, dy):
    from tokamax._src.ops.ragged_dot.base import RAGGED_CONTRACTING_DOT_DIM_NUMS

    rows, w, group_sizes = residuals
    valid = _in_groups(rows, group_sizes)
    dy = _varying_as(jnp.where(valid, dy, 0).astype(rows.dtype), rows, w)
    dx = jnp.where(valid, _tokamax(dy, jnp.swapaxes(_varying_as(w, dy), 1, 2), group_sizes, device=device), 0)
    dw = _tokamax(_varying_as(jnp.where(valid, rows, 0), dy), dy, group_sizes, RAGGED_CONTRACTING_DOT_DIM_NUMS,
                  device=device)
    return _summed_as(dx, rows).astype(rows.dtype), _summed_as(dw, w).astype(w.dtype), None


_tokamax_matmul.defvjp(_tokamax_forward, _tokamax_backward)

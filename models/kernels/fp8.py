"""FP8 matmuls with per-tensor scaling, and the weight the framework hands a layer to ask for one.

A family tags each weight that one matmul of its layers consumes with a ``MatmulGroup``
(``models.common.logical_param(..., group=...)``). Under ``train.precision: fp8`` the framework
passes the groups its recipe names as ``Fp8Weight`` values instead of arrays, and
``models.common.matmul`` runs them here; the model's code does not change.

The matmul ``x @ w`` (any two-operand einsum): each operand is divided by its scale, saturated to
the format's largest value and cast, forward operands to E4M3 (``FORWARD_DTYPE``, largest 448) and
the output gradient to E5M2 (``GRADIENT_DTYPE``, largest 57344); the products are summed in fp32
and multiplied back by the two scales. A scale is ``amax * 2**margin / largest`` (1 where amax is 0),
from this matmul's own amax (``|x|``'s maximum: current scaling) or from the largest amax of earlier
steps (delayed scaling: ``Fp8Weight.history``; this step's amax where the history is still all zero).
The backward saves the FP8 operands (not the wide ones) and computes both of its products with
the E5M2 gradient against the saved E4M3 operand.

What the framework needs back leaves through autodiff: the gradient of ``Fp8Weight.observed`` (zeros
in the forward) is this matmul's amax of its input, weight and output gradient, in ``OPERANDS``
order. A tagged weight must be consumed by exactly one matmul per forward pass (else the gradients
of its ``observed`` add up).
"""

from __future__ import annotations

import enum
import functools

import jax
import jax.numpy as jnp
from flax import struct

from models.kernels.attention import varying_axes


class MatmulGroup(str, enum.Enum):
    """The kinds of layer matmul a family tags its weights with (``train.fp8.matmuls`` names them)."""

    ATTENTION = "attention"  # attention's input and output projections (query, key, value, latent, out)
    MLP = "mlp"  # a dense feed-forward block's gate, up and down projections (shared experts too)
    EXPERTS = "experts"  # routed experts' stacked weights, where their matmuls go through ``matmul``


FORWARD_DTYPE = jnp.float8_e4m3fn  # the input and the weight: 3 mantissa bits, largest 448
GRADIENT_DTYPE = jnp.float8_e5m2  # the output gradient: wider range, largest 57344
# The operands whose amaxes ``Fp8Weight.observed`` and ``Fp8Weight.history`` hold, in this order.
OPERANDS = ("input", "weight", "grad")


@struct.dataclass
class Fp8Weight:
    """A weight to be multiplied in FP8 (``fp8_matmul``).

    weight: the weight in the compute dtype (its gradient is the weight's gradient).
    observed: fp32 [..., 3] zeros, whose gradient is the step's amax of each operand (``OPERANDS``).
    history: fp32 [..., 3, steps] amaxes of earlier steps, newest first, whose largest sets the scale
        (delayed scaling); None: each scale from this matmul's own amax (current scaling).
    The leading ``...`` are the weight's stacked-layer axes (a scan over layers slices all three).
    ``amax_axes``: see the field.
    """

    weight: jax.Array
    observed: jax.Array
    history: jax.Array | None = None
    margin: int = struct.field(pytree_node=False, default=0)
    # Inside a ``shard_map`` that splits the matmul's operands (expert parallelism's exchange), the
    # manual mesh axes the framework names here make every amax a maximum over them (``amax``).
    amax_axes: tuple[str, ...] = struct.field(pytree_node=False, default=())

    def __getitem__(self, index):
        """Itself for ``[...]``: how a model reads a parameter (``self.query[...]``)."""
        if index is not Ellipsis:
            raise TypeError(f"an Fp8Weight is read whole ([...]), not at {index!r}")
        return self

    def plus(self, other: Fp8Weight) -> Fp8Weight:
        """This gradient node and ``other`` (another microbatch's or pipeline chunk's) combined: the
        weight gradients and histories summed, the amaxes (``observed``) by maximum."""
        history = None if self.history is None else self.history + other.history
        return self.replace(weight=self.weight + other.weight.astype(self.weight.dtype),
                            observed=jnp.maximum(self.observed, other.observed), history=history)


def largest(dtype: jnp.dtype) -> float:
    """The largest finite value of an FP8 ``dtype``."""
    return float(jnp.finfo(dtype).max)


def amax(x: jax.Array, axes: tuple[str, ...] = ()) -> jax.Array:
    """f32 []: the largest magnitude in ``x``, over the manual mesh axes ``axes`` too (those ``x``
    varies over inside a ``shard_map``): the same value on every device."""
    local = jnp.max(jnp.abs(x)).astype(jnp.float32)
    over = tuple(a for a in axes if a in varying_axes(x))
    return jax.lax.pmax(local, over) if over else local


def scale_of(current: jax.Array, history: jax.Array | None, dtype: jnp.dtype, margin: int) -> jax.Array:
    """f32 []: the dequantisation scale of an operand whose amax is ``current`` in this matmul, with
    ``history`` ([steps] of earlier amaxes, or None for current scaling): ``amax * 2**margin /
    largest(dtype)``, 1 where the amax is 0."""
    used = current if history is None else jnp.where(jnp.max(history) > 0, jnp.max(history), current)
    return jnp.where(used > 0, used * (2.0 ** margin / largest(dtype)), 1.0)


def quantize(x: jax.Array, scale: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """``x / scale`` in fp32, saturated to ``dtype``'s range and cast to it (round to nearest even)."""
    bound = largest(dtype)
    return jnp.clip(x.astype(jnp.float32) / scale, -bound, bound).astype(dtype)


def _scaled_product(equation: str, a: jax.Array, b: jax.Array, scale: jax.Array, dtype: jnp.dtype) -> jax.Array:
    return (jnp.einsum(equation, a, b, preferred_element_type=jnp.float32) * scale).astype(dtype)


def _row(history: jax.Array | None, operand: int) -> jax.Array | None:
    return None if history is None else history[..., operand, :]


@struct.dataclass
class QuantizedOperands:
    """The forward's E4M3 input and weight with their scales and amaxes (what a backward keeps)."""

    q_x: jax.Array
    q_w: jax.Array
    scale_x: jax.Array
    scale_w: jax.Array
    amax_x: jax.Array
    amax_w: jax.Array


def quantize_operands(x: jax.Array, w: jax.Array, history: jax.Array | None, margin: int,
                      axes: tuple[str, ...]) -> QuantizedOperands:
    """``x`` and ``w`` in E4M3, each by its scale (``scale_of`` with its history row, or current)."""
    amax_x, amax_w = amax(x, axes), amax(w, axes)
    scale_x = scale_of(amax_x, _row(history, 0), FORWARD_DTYPE, margin)
    scale_w = scale_of(amax_w, _row(history, 1), FORWARD_DTYPE, margin)
    return QuantizedOperands(quantize(x, scale_x, FORWARD_DTYPE), quantize(w, scale_w, FORWARD_DTYPE),
                             scale_x, scale_w, amax_x, amax_w)


def quantize_gradient(grad: jax.Array, history: jax.Array | None, margin: int, axes: tuple[str, ...]
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The output gradient in E5M2: (it, its scale, its amax)."""
    amax_g = amax(grad, axes)
    scale_g = scale_of(amax_g, _row(history, 2), GRADIENT_DTYPE, margin)
    return quantize(grad, scale_g, GRADIENT_DTYPE), scale_g, amax_g


def observed_cotangents(operands: QuantizedOperands, amax_g: jax.Array, history: jax.Array | None
                        ) -> tuple[jax.Array, jax.Array | None]:
    """The gradients of ``Fp8Weight.observed`` (the step's three amaxes) and of its history (zero)."""
    return jnp.stack([operands.amax_x, operands.amax_w, amax_g]), jax.tree.map(jnp.zeros_like, history)


def fp8_matmul(equation: str, x: jax.Array, w: Fp8Weight, result_dtype: jnp.dtype) -> jax.Array:
    """``jnp.einsum(equation, x, w.weight)`` (two operands) with FP8 operands and fp32 sums, in
    ``result_dtype``; the gradient of ``x`` in ``x``'s dtype and of the weight in its own."""
    inputs, out = equation.replace(" ", "").split("->")
    lhs, rhs = inputs.split(",")
    return _fp8_einsum(lhs, rhs, out, jnp.dtype(result_dtype), jnp.dtype(x.dtype), jnp.dtype(w.weight.dtype),
                       w.margin, w.amax_axes, x, w.weight, w.observed, w.history)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5, 6, 7))
def _fp8_einsum(lhs, rhs, out, result_dtype, x_dtype, w_dtype, margin, axes, x, w, observed, history):
    return _forward(lhs, rhs, out, result_dtype, x_dtype, w_dtype, margin, axes, x, w, observed, history)[0]


def _forward(lhs, rhs, out, result_dtype, x_dtype, w_dtype, margin, axes, x, w, observed, history):
    del x_dtype, w_dtype, observed
    q = quantize_operands(x, w, history, margin, axes)
    y = _scaled_product(f"{lhs},{rhs}->{out}", q.q_x, q.q_w, q.scale_x * q.scale_w, result_dtype)
    return y, (q, history)


def _backward(lhs, rhs, out, result_dtype, x_dtype, w_dtype, margin, axes, residuals, grad):
    del result_dtype
    q, history = residuals
    q_g, scale_g, amax_g = quantize_gradient(grad, history, margin, axes)
    d_x = _scaled_product(f"{out},{rhs}->{lhs}", q_g, q.q_w, scale_g * q.scale_w, x_dtype)
    d_w = _scaled_product(f"{lhs},{out}->{rhs}", q.q_x, q_g, q.scale_x * scale_g, w_dtype)
    return (d_x, d_w, *observed_cotangents(q, amax_g, history))


_fp8_einsum.defvjp(_forward, _backward)

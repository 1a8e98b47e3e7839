"""Building blocks shared by the model zoo: logical-axis parameters, activation constraints, remat.

Models name only logical axes (the framework's ``batch, length, embed, vocab, layers`` and their
family's own, declared in its ``models.api.ModelFamily``). The framework decides what those names
mean on a mesh and hands the model an ``ActivationSharding`` callable; a model never sees a mesh axis.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import typing
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from models.kernels.attention import AttentionSpec, attend, cudnn_refusal
from models.kernels.tokamax_attention import tokamax_refusal
from models.kernels.fp8 import Fp8Weight, MatmulGroup, fp8_matmul
from models.kernels.lora import LoraWeight, low_rank_equations

LogicalAxes = tuple[str | None, ...]


class InvalidField(ValueError):
    """A model config field with an invalid value; ``field`` is relative to the model section."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


def check_positive(cfg: Any, *names: str) -> None:
    """``InvalidField`` for the first of ``names`` whose value in ``cfg`` is not a positive integer."""
    for name in names:
        if getattr(cfg, name) <= 0:
            raise InvalidField(name, f"must be a positive integer, got {getattr(cfg, name)}")


def check_non_negative(cfg: Any, *names: str) -> None:
    """``InvalidField`` for the first of ``names`` whose value in ``cfg`` is below 0."""
    for name in names:
        if getattr(cfg, name) < 0:
            raise InvalidField(name, f"must be >= 0, got {getattr(cfg, name)}")


def check_finite(cfg: Any, *names: str, positive: bool) -> None:
    """``InvalidField`` for the first of ``names`` whose value in ``cfg`` is not a finite number
    above 0 (``positive``) or at least 0."""
    for name in names:
        value = getattr(cfg, name)
        if not ((value > 0 if positive else value >= 0) and math.isfinite(value)):
            raise InvalidField(name, f"must be a finite number {'>' if positive else '>='} 0, got {value}")


def coerce_enums(config: Any, error: Callable[[str, str], Exception] = InvalidField) -> None:
    """Turns every field of the frozen dataclass ``config`` that is typed as an ``enum.Enum`` but holds
    a plain value (``LlamaConfig(remat="full")`` from Python; YAML is converted on loading) into its
    member, in place; ``error(field, message)`` naming the valid values for a value that is none of
    them (the framework's configs pass their ``ConfigError``). Call it first in ``__post_init__``:
    the checks after it may then compare members with ``is``."""
    for name, kind in _enum_fields(type(config)):
        value = getattr(config, name)
        if isinstance(value, kind):
            continue
        try:
            member = kind(value)
        except ValueError:
            raise error(name, f"got {value!r}; valid: {', '.join(repr(m.value) for m in kind)}") from None
        object.__setattr__(config, name, member)


@functools.cache
def _enum_fields(cls: type) -> tuple[tuple[str, type[enum.Enum]], ...]:
    """(name, enum type) of each field of the dataclass ``cls`` typed as an ``enum.Enum`` (resolving
    the type hints is slow: a planner builds thousands of configs)."""
    hints = typing.get_type_hints(cls)
    return tuple((field.name, hints[field.name]) for field in dataclasses.fields(cls)
                 if isinstance(hints.get(field.name), type) and issubclass(hints[field.name], enum.Enum))


def matmul(equation: str, x: jax.Array, w: jax.Array | Fp8Weight | LoraWeight,
           result_dtype: jnp.dtype | None = None) -> jax.Array:
    """``jnp.einsum(equation, x, w)`` (two operands, no index repeated in one) summed in fp32 and
    returned in ``result_dtype`` (default: ``x``'s dtype), in the forward and in both backward
    matmuls (whose results take the operands' dtypes).

    With bf16 operands this is the mixed-precision matmul the hardware runs natively (bf16 products,
    fp32 sums: tensor cores, AMX). A plain bf16 einsum asks XLA for a bf16 result, which XLA:CPU
    computes by converting both operands to fp32 first, and its autodiff feeds the backward matmuls
    an fp32 cotangent, with the same effect; here one 2048x1024x1024 bf16 matmul ran 4.3x faster
    summed in fp32 than as a plain bf16 einsum (docs/benchmarks.md). The output is tagged
    ``CHECKPOINT_DOT`` when the einsum has no batch indices, so that ``RematPolicy.DOTS`` keeps it
    as it keeps a plain matmul's output. ``result_dtype=float32`` keeps the fp32 sums (e.g. logits
    for a fp32 loss) instead of rounding them to bf16 and converting back. fp32 operands: a plain
    einsum. An ``Fp8Weight`` (what the framework passes for a weight tagged with a ``MatmulGroup``
    when it trains in FP8): ``models.kernels.fp8.fp8_matmul``. A ``LoraWeight`` (a tagged weight under
    ``train.lora``): the frozen base's product (no gradient to the base) plus the low-rank update's.
    """
    inputs, out = equation.replace(" ", "").split("->")
    lhs, rhs = inputs.split(",")
    if isinstance(w, LoraWeight):
        down, up = low_rank_equations(equation, w.inputs)
        y = matmul(equation, x, jax.lax.stop_gradient(w.base), result_dtype)
        low = matmul(down, w.dropped(x), w.a) * jnp.asarray(w.scale, x.dtype)
        return y + matmul(up, low, w.b, y.dtype)
    if isinstance(w, Fp8Weight):
        y = fp8_matmul(equation, x, w, result_dtype or x.dtype)
    elif x.dtype == jnp.float32 and w.dtype == jnp.float32:
        return jnp.einsum(equation, x, w)
    else:
        y = _mixed_precision_einsum(lhs, rhs, out, jnp.dtype(result_dtype or x.dtype), x, w)
    return checkpoint_name(y, CHECKPOINT_DOT) if not set(lhs) & set(rhs) & set(out) else y


# The checkpoint name of batch-free ``matmul`` outputs (kept by ``RematPolicy.DOTS``).
CHECKPOINT_DOT = "dot"


def _fp32_sum(lhs: str, rhs: str, out: str, a: jax.Array, b: jax.Array, dtype) -> jax.Array:
    return jnp.einsum(f"{lhs},{rhs}->{out}", a, b, preferred_element_type=jnp.float32).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _mixed_precision_einsum(lhs: str, rhs: str, out: str, result_dtype, x: jax.Array, w: jax.Array) -> jax.Array:
    return _fp32_sum(lhs, rhs, out, x, w, result_dtype)


def _mixed_precision_forward(lhs, rhs, out, result_dtype, x, w):
    return _fp32_sum(lhs, rhs, out, x, w, result_dtype), (x, w)


def _mixed_precision_backward(lhs, rhs, out, result_dtype, residuals, grad):
    x, w = residuals
    return (_fp32_sum(out, rhs, lhs, grad.astype(x.dtype), w, x.dtype),
            _fp32_sum(lhs, out, rhs, x, grad.astype(x.dtype), w.dtype))


_mixed_precision_einsum.defvjp(_mixed_precision_forward, _mixed_precision_backward)


class ActivationSharding(Protocol):
    """What the framework hands a model for its layout: constraints on activations (identity
    off-mesh), the lookup of token embeddings, the causal self-attention its rules imply
    (``models.kernels.attention.attend``, or ring attention where the rules keep the keys split along the
    sequence), and ``platform``: the platform of the devices that run the model ("cpu", "gpu",
    "tpu"), from which every kernel is chosen (a compile-only GPU mesh on a CPU host says "gpu")."""

    platform: str

    def __call__(self, x: jax.Array, axes: LogicalAxes) -> jax.Array: ...

    def lookup(self, table: jax.Array, ids: jax.Array, axes: LogicalAxes) -> jax.Array:
        """``table[ids]``: rows of a [rows, width] table (a ``(vocab, embed)`` parameter) for int ids
        [batch, length], as [batch, length, width] laid out by logical ``axes``."""

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
               segments: jax.Array | None, spec: AttentionSpec) -> jax.Array:
        """Causal self-attention as ``spec`` asks (``models.kernels.attention.attend``): q [batch, length,
        heads, head_dim], k [batch, length, kv_heads, head_dim], v [batch, length, kv_heads,
        value_dim] (value_dim <= head_dim) -> [batch, length, heads, value_dim], within ``segments``
        (int [batch, length]) when given; ``positions`` (int [batch
        or 1, length]) order the tokens causally where the framework has permuted the sequence
        (ring attention's load balancing)."""

    def run_experts(self, compute: ExpertCompute, x: jax.Array, choices: jax.Array,
                    params: tuple[jax.Array, ...], param_axes: tuple[LogicalAxes, ...],
                    buffer_factor: float) -> tuple[jax.Array, jax.Array]:
        """Each token's chosen experts run on its row, wherever those experts live: x [batch, length,
        embed], ``choices`` int [batch, length, top_k] expert ids -> (out [batch, length, top_k, embed],
        each choice's expert output, zero where it was dropped; the number of choices dropped, an
        int scalar). ``params`` lead with the ``experts`` dimension (logical ``param_axes``); the
        framework may split the experts (expert parallelism: rows travel to the devices holding
        their experts and back, in buffers of ``buffer_factor`` times an even share of the rows per
        peer, 0 = the worst case: nothing is ever dropped) and the hidden dimension of the params
        (``compute``'s results are summed over it) and calls ``compute`` on each device's rows with
        the experts it holds (``ExpertCompute``)."""


class ExpertCompute(Protocol):
    """rows [m, embed], ``ids`` int [m] (an expert among ``params``' first dimension, or at least
    that size for a row to skip, whose result is zero) and the experts' params -> [m, embed]."""

    def __call__(self, rows: jax.Array, ids: jax.Array, *params: jax.Array) -> jax.Array: ...


def choice_rows(x: jax.Array, top_k: int) -> jax.Array:
    """x [batch, length, embed] -> [batch * length * top_k, embed]: each token's row once per choice."""
    rows, length, width = x.shape
    return jnp.broadcast_to(x[:, :, None, :], (rows, length, top_k, width)).reshape(-1, width)


class Unconstrained:
    """The identity constraint and full attention: a model run outside any mesh, on JAX's default
    device (whose platform chooses the kernels)."""

    @property
    def platform(self) -> str:
        return jax.devices()[0].platform

    def __call__(self, x: jax.Array, axes: LogicalAxes) -> jax.Array:
        del axes
        return x

    def lookup(self, table: jax.Array, ids: jax.Array, axes: LogicalAxes) -> jax.Array:
        del axes
        return jnp.take(table, ids, axis=0)

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
               segments: jax.Array | None, spec: AttentionSpec) -> jax.Array:
        del positions  # the rows are in sequence order
        return attend(q, k, v, segments, spec.resolved(self.platform, packed=segments is not None,
                                                       cudnn_refused=cudnn_refusal(q.dtype),
                                                       tokamax_refused=tokamax_refusal(q.dtype)))

    def run_experts(self, compute: ExpertCompute, x: jax.Array, choices: jax.Array,
                    params: tuple[jax.Array, ...], param_axes: tuple[LogicalAxes, ...],
                    buffer_factor: float) -> tuple[jax.Array, jax.Array]:
        del param_axes, buffer_factor  # every expert is here: nothing travels, nothing is dropped
        out = compute(choice_rows(x, choices.shape[-1]), choices.reshape(-1), *params)
        return out.reshape(*choices.shape, x.shape[-1]), jnp.zeros((), jnp.int32)


unconstrained = Unconstrained()


class SignDescent(nnx.Variable):
    """A model variable the framework's optimizer moves by ``rate * sign(gradient)`` downhill each
    step (``rate``: the variable's metadata) instead of by AdamW: never clipped, decayed or counted
    in the gradient norm. The model makes its gradient the direction it should move (models/moe's
    routing bias: an expert's load above the mean)."""


def sign_descent_variable(value: jax.Array, axes: LogicalAxes, rate: float) -> SignDescent:
    """A ``SignDescent`` variable annotated with logical axes (as ``logical_param``)."""
    if len(axes) != value.ndim:
        raise ValueError(f"logical axes {axes} do not match a value of shape {value.shape}")
    return SignDescent(value, rate=rate, out_sharding=axes, eager_sharding=False)


# The metadata entry of a parameter's ``MatmulGroup`` (``logical_param``).
MATMUL_GROUP = "matmul_group"


def logical_param(value: jax.Array, axes: LogicalAxes, group: MatmulGroup | None = None) -> nnx.Param:
    """A parameter annotated with logical axis names (one per dimension) and, for a weight that one
    matmul of a layer consumes (through ``matmul``, once per forward pass), its ``MatmulGroup``: the
    framework may then pass it as an ``Fp8Weight`` (``models.kernels.fp8``).

    Flax's eager sharding is off: where the parameter lives is decided by the framework's rules
    when the whole state is created under ``jit(..., out_shardings=...)``.
    """
    if len(axes) != value.ndim:
        raise ValueError(f"logical axes {axes} do not match a value of shape {value.shape}")
    return nnx.Param(value, out_sharding=axes, eager_sharding=False, **{MATMUL_GROUP: group})


def stacked_layers(make_layer: Callable[[nnx.Rngs], nnx.Module], num_layers: int, rngs: nnx.Rngs,
                   axis: str = "layers") -> nnx.Module:
    """``num_layers`` layers built by ``make_layer``, their parameters stacked on a leading axis of
    logical name ``axis`` (``nnx.vmap``; each layer gets its own split of ``rngs``), ready for
    ``lax.scan``. ``layers`` is the stack the framework schedules (pipeline stages split it); a
    family's other stacks name their own axis (``AxisRole.STACKED``)."""

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: axis})
    def make(layer_rngs: nnx.Rngs) -> nnx.Module:
        return make_layer(layer_rngs)

    return make(rngs)


def logical_axes_of(variable: nnx.Variable) -> LogicalAxes:
    """The logical axis names a parameter was created with (``layers`` included when stacked)."""
    return tuple(variable.get_metadata()["out_sharding"])


class RematPolicy(str, enum.Enum):
    """What the backward pass of each scanned layer keeps instead of recomputing.

    NONE: keep every activation (fastest, most memory).
    FULL: keep only the layer inputs; recompute the whole layer (least memory).
    DOTS: keep the outputs of matmuls without batch dimensions (recompute norms, activations);
    ``matmul``'s are tagged ``CHECKPOINT_DOT`` for it.
    NAMED: keep only the activations tagged with ``checkpoint_name`` in ``remat_names``.
    OFFLOAD: like NAMED, but the kept activations go to pinned host memory until the backward.
    """

    NONE = "none"
    FULL = "full"
    DOTS = "dots"
    NAMED = "named"
    OFFLOAD = "offload"

    def wrap(self, layer_fn: Callable, saved_names: tuple[str, ...]) -> Callable:
        """``layer_fn`` with this policy applied (``jax.checkpoint``), or unchanged for NONE."""
        if self is RematPolicy.NONE:
            return layer_fn
        return jax.checkpoint(layer_fn, policy=_CHECKPOINT_POLICIES[self](saved_names), prevent_cse=False)


_CHECKPOINT_POLICIES: dict[RematPolicy, Callable[[tuple[str, ...]], Callable]] = {
    RematPolicy.FULL: lambda names: jax.checkpoint_policies.nothing_saveable,
    RematPolicy.DOTS: lambda names: jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(CHECKPOINT_DOT)),
    RematPolicy.NAMED: lambda names: jax.checkpoint_policies.save_only_these_names(*names),
    RematPolicy.OFFLOAD: lambda names: jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=names,
        offload_src="device", offload_dst="pinned_host"),
}


def palm_train_flops_per_token(*, matmul_params: int, num_layers: int, seq_len: int,
                               attention_dim: int) -> float:
    """Training (forward + backward) FLOPs per token of a decoder, PaLM convention (also MaxText's
    and torchtitan's): ``6 * N + 12 * L * T * attention_dim``.

    Args:
      matmul_params: weights in matmuls, output head included, input embedding excluded.
      num_layers: transformer layers.
      seq_len: training sequence length.
      attention_dim: ``num_heads * head_dim`` (score and value matmuls, not halved for causality).
    """
    return float(6 * matmul_params + 12 * num_layers * seq_len * attention_dim)

"""Mixed precision: fp32 master weights, compute in fp32, bf16, fp16 or fp8, dynamic loss scaling
for fp16.

The train state always holds fp32 parameters and optimizer moments. Inside the step the parameters
are cast to the compute dtype before the forward pass, the loss is taken in fp32, and gradients
arrive in fp32 through the cast. ``fp8`` computes in bf16 but for the layer matmuls its recipe
names, which take FP8 operands (``meshtrain.fp8_training``).
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
from flax import struct

from models.kernels.fp8 import Fp8Weight
from models.kernels.lora import LoraWeight


class Precision(str, enum.Enum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"  # bf16, with the recipe's layer matmuls in FP8 (train.fp8)

    @property
    def compute_dtype(self) -> jnp.dtype:
        return _COMPUTE_DTYPES[self]

    @property
    def needs_loss_scaling(self) -> bool:
        """fp16's narrow exponent range underflows small gradients without loss scaling."""
        return self is Precision.FP16


def initial_loss_scale(dynamic: bool) -> LossScale:
    """A dynamic scale starting at 2**15, or a fixed scale of 1 (a no-op)."""
    return LossScale(scale=jnp.float32(2.0**15 if dynamic else 1.0), good_steps=jnp.int32(0),
                     dynamic=dynamic)


_COMPUTE_DTYPES = {Precision.FP32: jnp.float32, Precision.BF16: jnp.bfloat16, Precision.FP16: jnp.float16,
                   Precision.FP8: jnp.bfloat16}


@struct.dataclass
class LossScale:
    """Dynamic loss scale: halve on overflow, double after ``growth_interval`` finite steps."""

    scale: jax.Array  # f32 []
    good_steps: jax.Array  # i32 []
    dynamic: bool = struct.field(pytree_node=False, default=False)
    growth_interval: int = struct.field(pytree_node=False, default=1000)

    def scale_loss(self, loss: jax.Array) -> jax.Array:
        """``loss`` times the scale; unchanged for a fixed scale, which is always 1."""
        return loss * self.scale if self.dynamic else loss

    def unscale(self, tree):
        """``tree`` (a scaled loss, or its gradients) over the scale; unchanged for a fixed scale (no
        pass over the gradients)."""
        return jax.tree.map(lambda x: x / self.scale, tree) if self.dynamic else tree

    def adjust(self, grads_finite: jax.Array) -> LossScale:
        """The scale for the next step given whether this step's gradients were finite."""
        if not self.dynamic:
            return self
        grow = grads_finite & (self.good_steps + 1 >= self.growth_interval)
        scale = jnp.where(grads_finite, jnp.where(grow, self.scale * 2, self.scale),
                          jnp.maximum(self.scale / 2, 1.0))
        good_steps = jnp.where(grads_finite & ~grow, self.good_steps + 1, 0)
        return self.replace(scale=scale, good_steps=good_steps)


def cast_floating(tree, dtype: jnp.dtype):
    """``tree`` with floating-point leaves cast to ``dtype``; of an ``Fp8Weight``, the weight only
    (its amaxes stay fp32); of a ``LoraWeight``, the base and adapter (its dropout seeds stay fp32)."""

    def cast(x):
        if isinstance(x, Fp8Weight):
            return x.replace(weight=cast(x.weight))
        if isinstance(x, LoraWeight):
            return x.cast(dtype)
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree.map(cast, tree, is_leaf=lambda x: isinstance(x, Fp8Weight | LoraWeight))

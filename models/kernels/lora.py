"""LoRA: a frozen weight with a trainable low-rank update (``LoraWeight``), multiplied as
``x @ base + scale * (dropout(x) @ a) @ b`` by ``models.common.matmul``.

A weight ``w`` of shape [in..., out...] (its leading ``inputs`` axes are the ones a matmul contracts,
the rest its output axes, after any stacked layer axes) gets ``a`` [in..., rank] and ``b`` [rank,
out...]; the update is never formed as a full matrix. No gradient flows to ``base`` (the framework
trains ``a`` and ``b`` only), so a step does the base's forward and input-gradient matmuls and skips
its weight-gradient matmuls.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class LoraWeight:
    """A frozen weight and its low-rank adapter, as the framework passes it to a model.

    base: the frozen weight [stacked..., in..., out...] in the compute dtype.
    a: [stacked..., in..., rank]; b: [stacked..., rank, out...] (``b`` starts at zero).
    seed: fp32 [stacked...]: this step's dropout seed of each layer's adapter (integers below 2**24).
    scale: alpha / rank. inputs: how many axes of a layer's weight are its input (contracted) axes.
    dropout: the probability that an input element is dropped on the adapter's path.
    """

    base: jax.Array
    a: jax.Array
    b: jax.Array
    seed: jax.Array
    scale: float = struct.field(pytree_node=False, default=1.0)
    inputs: int = struct.field(pytree_node=False, default=1)
    dropout: float = struct.field(pytree_node=False, default=0.0)

    def __getitem__(self, index):
        """Itself for ``[...]``: how a model reads a parameter (``self.query[...]``)."""
        if index is not Ellipsis:
            raise TypeError(f"a LoraWeight is read whole ([...]), not at {index!r}")
        return self

    def cast(self, dtype: jnp.dtype) -> LoraWeight:
        """The base and the adapter in ``dtype``; the seeds stay fp32 (exact integers)."""
        return self.replace(base=self.base.astype(dtype), a=self.a.astype(dtype), b=self.b.astype(dtype))

    def dropped(self, x: jax.Array) -> jax.Array:
        """x with each element zeroed with probability ``dropout`` (the rest scaled up to keep the
        mean), from this layer's seed; x itself without dropout."""
        if not self.dropout:
            return x
        key = jax.random.key(jax.lax.stop_gradient(self.seed).astype(jnp.uint32))
        keep = jax.random.bernoulli(key, 1.0 - self.dropout, x.shape)
        return jnp.where(keep, x / (1.0 - self.dropout), 0).astype(x.dtype)


def low_rank_equations(equation: str, inputs: int) -> tuple[str, str]:
    """The two einsums of the update for a weight whose first ``inputs`` axes ``equation`` contracts
    ("btd,dnh->btnh", 1 -> ("btd,dr->btr", "btr,rnh->btnh")). ValueError for an equation that
    contracts other axes of the weight, or has batch indices."""
    operands, out = equation.replace(" ", "").split("->")
    lhs, rhs = operands.split(",")
    inner, outer = rhs[:inputs], rhs[inputs:]
    contracted = set(lhs) & set(rhs) - set(out)
    if set(inner) != contracted or not set(outer) <= set(out) - set(lhs) or set(lhs) & set(rhs) & set(out):
        raise ValueError(f"LoRA on {equation!r}: the weight's first {inputs} axes must be exactly the ones "
                         "contracted and the rest output axes (no batch axes)")
    rank = next(letter for letter in "rzyxwvuqpo" if letter not in equation)
    kept = "".join(letter for letter in lhs if letter not in inner)
    return f"{lhs},{inner}{rank}->{kept}{rank}", f"{kept}{rank},{rank}{outer}->{out}"

"""Gradient accumulation: microbatches scanned inside the jitted step.

A global batch [batch, length] becomes [microbatches, batch / microbatches, length] where
microbatch k holds rows k, k + M, k + 2M, ...: every device keeps exactly its own rows, so the split
moves no data. The gradient accumulator is constrained to the gradients' sharding of the ZeRO stage
(``meshtrain.parallel.zero``): split over ``fsdp`` from ZeRO-2 on, replicated over it below.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from meshtrain.loss import Batch


class Accumulates(Protocol):
    """A gradient node that adds up by its own rule (``models.kernels.fp8.Fp8Weight``: its amaxes combine
    by maximum, not by sum)."""

    def plus(self, other: Any) -> Any:
        """This node and ``other`` (the same node of another microbatch or chunk) combined."""


def _accumulates(node: Any) -> bool:
    """Whether ``node``'s own class defines ``Accumulates.plus`` (an ``nnx.Variable`` forwards
    attribute reads to its value, so an instance check would also take the variable holding one)."""
    return callable(getattr(type(node), "plus", None))


def add_gradients(total: Any, grads: Any) -> Any:
    """``total + grads`` leaf by leaf (in ``total``'s dtypes), ``Accumulates`` nodes by their own rule:
    what a sum over microbatches or pipeline chunks must do."""
    return jax.tree.map(lambda a, b: a.plus(b) if _accumulates(a) else a + b.astype(a.dtype),
                        total, grads, is_leaf=_accumulates)


def split_microbatches(batch: Batch, num_microbatches: int) -> Batch:
    """[batch, ...] -> [num_microbatches, batch / num_microbatches, ...] (strided rows)."""

    def split(x: jax.Array) -> jax.Array:
        rows = x.shape[0] // num_microbatches
        return x.reshape(rows, num_microbatches, *x.shape[1:]).swapaxes(0, 1)

    return jax.tree.map(split, batch)


def sum_leading(tree: Any) -> Any:
    """Every array of ``tree`` summed over its leading axis (values stacked by a scan)."""
    return jax.tree.map(lambda x: jnp.sum(x, axis=0), tree)


def accumulate_gradients(loss_and_grad: Callable[[Any, Batch], tuple[tuple[jax.Array, Any], Any]], params: Any,
                         microbatches: Batch, constrain_grads: Callable[[Any], Any]) -> tuple[jax.Array, Any, Any]:
    """Sums ``loss_and_grad(params, microbatch) -> ((loss, aux), grads)`` over the leading
    microbatch axis with ``lax.scan``: (loss, aux, grads) summed.

    ``loss_and_grad`` must already be normalised by the global target count, so sums are exact.
    The amaxes of FP8 matmuls (``meshtrain.fp8_training``) combine by maximum.
    """

    def add_microbatch(carry, microbatch):
        loss_sum, grad_sum = carry
        (loss, aux), grads = loss_and_grad(params, microbatch)
        grad_sum = constrain_grads(add_gradients(grad_sum, grads))
        return (loss_sum + loss, grad_sum), aux  # aux: a scan output, summed below

    zeros = constrain_grads(jax.tree.map(jnp.zeros_like, params))
    (loss, grads), aux = jax.lax.scan(add_microbatch, (jnp.zeros((), jnp.float32), zeros), microbatches)
    return loss, sum_leading(aux), grads

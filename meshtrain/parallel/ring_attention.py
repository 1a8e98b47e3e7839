"""Ring attention: causal self-attention over a sequence split across one mesh axis, without gathering it.

Rank ``i`` of the ring axis (size N) holds block ``i`` of the queries, keys and values along with
each token's position (``i * T .. (i+1) * T - 1`` in sequence order; any order when the sequence was
permuted for load balancing, see ``balanced_order``). In N steps every rank attends its queries to
each key/value block in turn while the key/value blocks travel one rank along the ring
(``lax.ppermute``) per step. Each step is the blockwise kernel of ``models.attention`` (online
softmax over sub-blocks of ``block`` positions, fp32 statistics) over the block the rank holds: a
key is visible to a query when its position is not later, within the sliding window if any, and
in the same document (segments travel with their keys); a sub-block pair no query of which sees
any key is skipped at run time, so the causal skip also works in the balanced order.

The backward is a second ring (a ``custom_vjp``): the forward keeps only each query's output and
log-sum-exp; the backward sends the key/value blocks round again, each with the gradient of its
keys and values, to which every rank adds its queries' share, so that after N steps each block's
gradient is home. Per-device memory is the rank's blocks and one ``[block, block]`` score block,
and falls as 1 / N.

The framework runs it for a model's ``shard.attend`` wherever the rules split the keys'
``kv_length`` over the same single mesh axis as the queries' ``length`` (``fsdp_cp_ring``;
``meshtrain.parallel.sharding.MeshActivationSharding``). Proven equal to full attention in
tests/test_ring_attention.py, and in training to one device in tests/test_long_context.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from models.attention import (all_pairs, attend_pairs, attend_pairs_backward, finish, initial_state, input_gradients,
                              output_cotangent, split_keys, split_queries, ungroup_heads, zero_gradients)


def balanced_order(length: int, ring: int) -> np.ndarray:
    """int [length]: the sequence order that balances causal ring attention: the sequence cut into
    2 * ring chunks, rank i holding chunks i and 2 * ring - 1 - i (an early and a late one), so every
    rank computes about the same number of unmasked score blocks."""
    chunks = np.arange(length).reshape(2 * ring, length // (2 * ring))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * ring - 1 - i]]) for i in range(ring)])


def sub_block_length(length: int, block: int) -> int:
    """The positions per sub-block of a ring step: the largest divisor of ``length`` (the positions
    a rank holds) not above ``block`` (``block`` 0: the whole block)."""
    if block <= 0 or block >= length:
        return length
    return max(d for d in range(1, block + 1) if length % d == 0)


def ring_attention_block(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
                         segments: jax.Array | None, *, axis: str, block: int = 0, window: int = 0) -> jax.Array:
    """The per-rank body, inside a ``shard_map`` manual over ``axis``.

    Args:
      q: [batch, T, heads, head_dim] this rank's queries; k, v: [batch, T, kv_heads, head_dim]
        this rank's keys and values (heads a multiple of kv_heads: grouped-query attention).
      positions: int [batch, T] the positions of this rank's tokens (causality follows them).
      segments: int [batch, T] document ids of this rank's positions, or None (one document).
      block: queries and keys per score block within a step (``sub_block_length``; 0: all T).
      window: the sliding window (0: none).

    Returns:
      [batch, T, heads, head_dim] in q's dtype: causal attention over the whole ring's sequence.
    """
    return _ring(q, k, v, positions, segments, axis, sub_block_length(q.shape[1], block), window)


def _shift(tree, axis: str):
    ring = jax.lax.axis_size(axis)
    return jax.tree.map(lambda x: jax.lax.ppermute(x, axis, [(i, (i + 1) % ring) for i in range(ring)]), tree)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _ring(q, k, v, positions, segments, axis: str, block: int, window: int):
    return _ring_forward(q, k, v, positions, segments, axis, block, window)[0]


def _ring_forward(q, k, v, positions, segments, axis, block, window):
    queries = split_queries(q, positions, segments, block, k.shape[2])
    pairs = all_pairs(q.shape[1] // block, k.shape[1] // block)

    def step(carry, _):
        state, keys = carry
        state = attend_pairs(state, queries, keys, pairs, window=window, skip_hidden=True)
        return (state, _shift(keys, axis)), None

    state = initial_state(queries, v.shape[-1])
    keys = split_keys(k, v, positions, segments, block)
    (state, _), _ = jax.lax.scan(step, (state, keys), None, length=jax.lax.axis_size(axis))
    out, lse = finish(state)
    return ungroup_heads(out).astype(q.dtype), (q, k, v, positions, segments, out, lse)


def _ring_backward(axis, block, window, residuals, d_out):
    q, k, v, positions, segments, out, lse = residuals
    queries = split_queries(q, positions, segments, block, k.shape[2])
    pairs = all_pairs(q.shape[1] // block, k.shape[1] // block)
    d_out, delta = output_cotangent(d_out, out, block, k.shape[2])

    def step(carry, _):
        dq, keys, dk, dv = carry
        dq, dk, dv = attend_pairs_backward((dq, dk, dv), queries, keys, d_out, delta, lse, pairs, window=window,
                                           skip_hidden=True)
        return (dq, *_shift((keys, dk, dv), axis)), None

    keys = split_keys(k, v, positions, segments, block)
    dq, dk, dv = zero_gradients(queries, keys)
    carry = (dq, keys, dk, dv)
    (dq, _, dk, dv), _ = jax.lax.scan(step, carry, None, length=jax.lax.axis_size(axis))
    return input_gradients((dq, dk, dv), q, k, v) + (None, None)


_ring.defvjp(_ring_forward, _ring_backward)


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, segments: jax.Array | None,
                   *, mesh: Mesh, axis: str, block: int = 0, window: int = 0) -> jax.Array:
    """Causal attention of global q [batch, length, heads, head_dim], k, v [batch, length, kv_heads,
    head_dim], by ``positions`` (int [batch or 1, length]) and within ``segments`` ([batch, length]
    or None), with ``length`` split over mesh axis ``axis``: one ``shard_map`` manual over ``axis``
    running ``ring_attention_block`` (score blocks of ``block`` queries x keys; 0: a rank's whole block)."""
    positions = jnp.broadcast_to(positions, q.shape[:2])
    sequence = PartitionSpec(None, axis)
    in_specs = (PartitionSpec(None, axis, None, None),) * 3 + (sequence, None if segments is None else sequence)
    body = functools.partial(ring_attention_block, axis=axis, block=block, window=window)
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=PartitionSpec(None, axis, None, None),
                         axis_names={axis})(q, k, v, positions, segments)

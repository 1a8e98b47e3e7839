"""Ring attention: causal self-attention over a sequence split across one mesh axis, without gathering it.

Rank ``i`` of the ring axis (size N) holds block ``i`` of the queries, keys and values along with
each token's position (``i * T .. (i+1) * T - 1`` in sequence order; any order when the sequence was
permuted for load balancing, see ``balanced_order``). In N steps every rank attends its queries to
each key/value block in turn while the key/value blocks travel one rank along the ring
(``lax.ppermute``) per step. Each step is the blockwise kernel of ``models.kernels.attention`` (online
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
``meshtrain.parallel.activations.MeshActivationSharding``). Proven equal to full attention in
tests/test_ring_attention.py, and in training to one device in tests/test_long_context.py.

Inside a pipeline stage, where no nested ``shard_map`` compiles, ``ring_attention_in_stage`` runs
the same ring for XLA's partitioner (a rank dimension, ``_Ring``); its collective-permutes need
every device of every stage, so the pipeline then runs every slot on every stage
(``meshtrain.parallel.executor``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models.kernels.attention import (all_pairs, attend_pairs, attend_pairs_backward, finish, initial_state,
                                      input_gradients, output_cotangent, split_keys, split_queries, ungroup_heads,
                                      zero_gradients)


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
    return _ring(q, k, v, positions, segments, _Ring(axis), sub_block_length(q.shape[1], block), window)


@dataclasses.dataclass(frozen=True)
class _Ring:
    """How the key/value blocks travel round the ring of mesh axis ``axis``. ``ranks`` 0: inside the
    ring's ``shard_map`` (manual over ``axis``), each device's own blocks, sent by ``lax.ppermute``.
    ``ranks`` N: inside a pipeline stage, where no nested ``shard_map`` compiles, every array has a
    leading rank dimension [N, ...] split over ``axis``; each rank's work is a ``vmap`` over it and
    the blocks move by a roll of it under a sharding constraint, which XLA's partitioner turns into
    the same collective-permute."""

    axis: str
    ranks: int = 0

    @property
    def size(self) -> int:
        return self.ranks or jax.lax.axis_size(self.axis)

    def each(self, f):
        """``f`` on each rank's arrays."""
        return jax.vmap(f) if self.ranks else f

    def shift(self, tree):
        """Each rank's blocks to rank + 1."""
        if not self.ranks:
            ring = jax.lax.axis_size(self.axis)
            return jax.tree.map(lambda x: jax.lax.ppermute(x, self.axis, [(i, (i + 1) % ring) for i in range(ring)]),
                                tree)
        return jax.tree.map(lambda x: self.ranked(jnp.roll(self.ranked(x), 1, axis=0)), tree)

    def ranked(self, x: jax.Array) -> jax.Array:
        """``x`` [N, ...] with its rank dimension over ``axis`` (the others as XLA chooses)."""
        mesh = jax.sharding.get_abstract_mesh()
        spec = PartitionSpec(self.axis, *(PartitionSpec.UNCONSTRAINED,) * (x.ndim - 1))
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _ring(q, k, v, positions, segments, ring: _Ring, block: int, window: int):
    return _ring_forward(q, k, v, positions, segments, ring, block, window)[0]


def _ring_forward(q, k, v, positions, segments, ring, block, window):
    each, skip = ring.each, not ring.ranks  # under vmap a run-time skip would compute both branches
    queries = each(lambda q, p, s: split_queries(q, p, s, block, k.shape[-2]))(q, positions, segments)
    pairs = all_pairs(q.shape[-3] // block, k.shape[-3] // block)

    def step(carry, _):
        state, keys = carry
        state = each(lambda s, qs, ks: attend_pairs(s, qs, ks, pairs, window=window, skip_hidden=skip))(
            state, queries, keys)
        return (state, ring.shift(keys)), None

    state = each(lambda qs: initial_state(qs, v.shape[-1]))(queries)
    keys = each(lambda k, v, p, s: split_keys(k, v, p, s, block))(k, v, positions, segments)
    (state, _), _ = jax.lax.scan(step, (state, keys), None, length=ring.size)
    out, lse = each(finish)(state)
    return each(ungroup_heads)(out).astype(q.dtype), (q, k, v, positions, segments, out, lse)


def _ring_backward(ring, block, window, residuals, d_out):
    q, k, v, positions, segments, out, lse = residuals
    each, skip = ring.each, not ring.ranks
    queries = each(lambda q, p, s: split_queries(q, p, s, block, k.shape[-2]))(q, positions, segments)
    pairs = all_pairs(q.shape[-3] // block, k.shape[-3] // block)
    d_out, delta = each(lambda d, o: output_cotangent(d, o, block, k.shape[-2]))(d_out, out)

    def step(carry, _):
        dq, keys, dk, dv = carry
        backward = lambda grads, *blocks: attend_pairs_backward(grads, *blocks, pairs, window=window,
                                                                skip_hidden=skip)
        dq, dk, dv = each(backward)((dq, dk, dv), queries, keys, d_out, delta, lse)
        return (dq, *ring.shift((keys, dk, dv))), None

    keys = each(lambda k, v, p, s: split_keys(k, v, p, s, block))(k, v, positions, segments)
    dq, dk, dv = each(zero_gradients)(queries, keys)
    carry = (dq, keys, dk, dv)
    (dq, _, dk, dv), _ = jax.lax.scan(step, carry, None, length=ring.size)
    return each(input_gradients)((dq, dk, dv), q, k, v) + (None, None)


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


def ring_attention_in_stage(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
                            segments: jax.Array | None, *, axis: str, ranks: int, block: int = 0,
                            window: int = 0) -> jax.Array:
    """``ring_attention`` inside a pipeline stage (a ``shard_map`` manual over ``stage``, where no
    nested ``shard_map`` compiles): the sequence cut into ``ranks`` blocks along a leading rank
    dimension split over ``axis`` (``_Ring``). XLA's collective-permute that moves the blocks spans
    the devices of every stage, so every device must run it at the same time: the pipeline runs
    every slot on every stage (``MeshActivationSharding.lockstep_stages``). Sub-block pairs whose
    keys no query sees are computed and masked here (a run-time skip under the ranks' ``vmap``
    would compute both branches)."""
    positions = jnp.broadcast_to(positions, q.shape[:2])
    ring = _Ring(axis, ranks)

    def to_ranks(x):
        if x is None:
            return None
        return ring.ranked(jnp.moveaxis(x.reshape(x.shape[0], ranks, x.shape[1] // ranks, *x.shape[2:]), 1, 0))

    out = _ring(*map(to_ranks, (q, k, v, positions, segments)), ring,
                sub_block_length(q.shape[1] // ranks, block), window)
    return jnp.moveaxis(ring.ranked(out), 0, 1).reshape(q.shape[:2] + out.shape[3:])

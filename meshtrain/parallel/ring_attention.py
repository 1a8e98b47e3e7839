"""Ring attention: causal self-attention over a sequence split across one mesh axis, without gathering it.

Rank ``i`` of the ring axis (size N) holds block ``i`` of the queries, keys and values along with
each token's position (``i * T .. (i+1) * T - 1`` in sequence order; any order when the sequence was
permuted for load balancing, see ``balanced_order``). In N steps every rank attends its queries to
each key/value block in turn, keeping a running maximum, normaliser and output (the online softmax
of blockwise/flash attention), while the key/value blocks travel one rank along the ring
(``lax.ppermute``) per step. A key is visible to a query when its position is not later (and, with
document segments, which travel with their keys, when it is in the same segment); a block whose
keys all lie after all the rank's queries contributes nothing and is skipped (``lax.cond``). Each
step is rematerialised in the backward pass
(``jax.checkpoint``), so the backward is blockwise too: what is kept per step is the carry and the
key/value block, never a ``[queries, keys]`` score block.

The framework runs it for a model's ``shard.attend`` wherever the rules split the keys'
``kv_length`` over the same single mesh axis as the queries' ``length`` (``fsdp_cp_ring``;
``meshtrain.parallel.sharding.ActivationLayout``). Proven equal to full attention in
tests/test_ring_attention.py, and in training to one device in tests/test_long_context.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

# Added to masked scores: finite, so that a row masked in one block yields exp(...) = 0, not NaN.
MASKED = -1e30


def balanced_order(length: int, ring: int) -> np.ndarray:
    """int [length]: the sequence order that balances causal ring attention: the sequence cut into
    2 * ring chunks, rank i holding chunks i and 2 * ring - 1 - i (an early and a late one), so every
    rank computes about the same number of unmasked score blocks."""
    chunks = np.arange(length).reshape(2 * ring, length // (2 * ring))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * ring - 1 - i]]) for i in range(ring)])


def ring_attention_block(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
                         segments: jax.Array | None, *, axis: str) -> jax.Array:
    """The per-rank body, inside a ``shard_map`` manual over ``axis``.

    Args:
      q: [batch, T, heads, head_dim] this rank's queries; k, v: [batch, T, kv_heads, head_dim]
        this rank's keys and values (heads a multiple of kv_heads: grouped-query attention).
      positions: int [batch, T] the positions of this rank's tokens (causality follows them).
      segments: int [batch, T] document ids of this rank's positions, or None (one document).

    Returns:
      [batch, T, heads, head_dim] in q's dtype: causal attention over the whole ring's sequence.
    """
    ring = jax.lax.axis_size(axis)
    batch, length, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    groups = heads // kv_heads
    queries = q.astype(jnp.float32).reshape(batch, length, kv_heads, groups, head_dim) * head_dim ** -0.5
    own_positions, own_segments = positions, segments

    def attend(carry, keys, values, key_positions, key_segments):
        out, running_max, normaliser = carry
        scores = jnp.einsum("btkgd,bskd->bkgts", queries, keys.astype(jnp.float32))
        visible = (key_positions[:, None, None, None, :] <= own_positions[:, None, None, :, None])
        if own_segments is not None:
            visible = visible & (own_segments[:, None, None, :, None] == key_segments[:, None, None, None, :])
        scores = jnp.where(visible, scores, MASKED)
        new_max = jnp.maximum(running_max, scores.max(-1))
        weights = jnp.exp(scores - new_max[..., None])
        correction = jnp.exp(running_max - new_max)
        normaliser = normaliser * correction + weights.sum(-1)
        out = out * correction[..., None] + jnp.einsum("bkgts,bskd->bkgtd", weights, values.astype(jnp.float32))
        return out, new_max, normaliser

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def step(carry, index):
        state, keys, values, key_positions, key_segments = carry
        any_visible = jnp.min(key_positions) <= jnp.max(own_positions)  # else every key is later: skipped
        state = jax.lax.cond(any_visible, lambda s: attend(s, keys, values, key_positions, key_segments),
                             lambda s: s, state)
        shift = [(i, (i + 1) % ring) for i in range(ring)]
        moved = jax.tree.map(lambda x: jax.lax.ppermute(x, axis, shift), (keys, values, key_positions, key_segments))
        return (state, *moved), None

    varying = lambda x: jax.lax.pcast(x, axis, to="varying")
    state = (varying(jnp.zeros((batch, kv_heads, groups, length, head_dim), jnp.float32)),
             varying(jnp.full((batch, kv_heads, groups, length), MASKED, jnp.float32)),
             varying(jnp.zeros((batch, kv_heads, groups, length), jnp.float32)))
    (state, *_), _ = jax.lax.scan(step, (state, k, v, positions, segments), jnp.arange(ring))
    out, _, normaliser = state
    out = out / normaliser[..., None]  # [batch, kv_heads, groups, T, head_dim]
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, length, heads, head_dim).astype(q.dtype)


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, segments: jax.Array | None,
                   *, mesh: Mesh, axis: str) -> jax.Array:
    """Causal attention of global q [batch, length, heads, head_dim], k, v [batch, length, kv_heads,
    head_dim], by ``positions`` (int [batch or 1, length]) and within ``segments`` ([batch, length]
    or None), with ``length`` split over mesh axis ``axis``: one ``shard_map`` manual over ``axis``
    running ``ring_attention_block``."""
    positions = jnp.broadcast_to(positions, q.shape[:2])
    sequence = PartitionSpec(None, axis)
    in_specs = (PartitionSpec(None, axis, None, None),) * 3 + (sequence, None if segments is None else sequence)
    body = functools.partial(ring_attention_block, axis=axis)
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=PartitionSpec(None, axis, None, None),
                         axis_names={axis})(q, k, v, positions, segments)

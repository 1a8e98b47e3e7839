"""Ring attention: causal self-attention over a sequence split across one mesh axis, without gathering it.

Rank ``i`` of the ring axis (size N) holds block ``i`` of the queries, keys and values along with
each token's position (``i * T .. (i+1) * T - 1`` in sequence order; any order when the sequence was
permuted for load balancing, see ``balanced_order``). In N steps every rank attends its queries to
each key/value block in turn, keeping a running maximum, normaliser and output (the online softmax
of blockwise/flash attention), while the key/value blocks travel one rank along the ring
(``lax.ppermute``) per step. A key is visible to a query when its position is not later (and, with
document segments, which travel with their keys, when it is in the same segment); a block whose
keys all lie after all the rank's queries contributes nothing and is skipped (``lax.cond``).

Within a step the rank's queries and the key block it holds are visited in sub-blocks of at most
``block`` positions (the largest divisor of the block length not above it), each pair one
online-softmax update, skipped when all its keys are later than all its queries (so the causal skip
also works in the balanced order, where a rank's block holds an early and a late chunk): a step
holds one ``[block, block]`` score block, and per-device memory grows linearly with the sequence,
not with its square. Steps and pairs are rematerialised in the backward pass (``jax.checkpoint``),
so the backward is blockwise too: what is kept is the carries and the key/value block, never a
``[queries, keys]`` score block.

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

# Added to masked scores: finite, so that a row masked in one block yields exp(...) = 0, not NaN.
MASKED = -1e30


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
                         segments: jax.Array | None, *, axis: str, block: int = 0) -> jax.Array:
    """The per-rank body, inside a ``shard_map`` manual over ``axis``.

    Args:
      q: [batch, T, heads, head_dim] this rank's queries; k, v: [batch, T, kv_heads, head_dim]
        this rank's keys and values (heads a multiple of kv_heads: grouped-query attention).
      positions: int [batch, T] the positions of this rank's tokens (causality follows them).
      segments: int [batch, T] document ids of this rank's positions, or None (one document).
      block: queries and keys per score block within a step (``sub_block_length``; 0: all T).

    Returns:
      [batch, T, heads, head_dim] in q's dtype: causal attention over the whole ring's sequence.
    """
    ring = jax.lax.axis_size(axis)
    batch, length, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    groups = heads // kv_heads
    sub = sub_block_length(length, block)
    blocks = length // sub

    def split(x):  # [batch, T, ...] -> [T / sub, batch, sub, ...]
        return None if x is None else jnp.moveaxis(x.reshape(batch, blocks, sub, *x.shape[2:]), 1, 0)

    queries = q.astype(jnp.float32).reshape(batch, length, kv_heads, groups, head_dim) * head_dim ** -0.5
    own = (split(queries), split(positions), split(segments))  # per query sub-block

    def attend(state, query_block, key_block):
        """One online-softmax update of a query sub-block's (out, max, normaliser) by a key sub-block."""
        out, running_max, normaliser = state
        queries, query_positions, query_segments = query_block
        keys, values, key_positions, key_segments = key_block
        scores = jnp.einsum("btkgd,bskd->bkgts", queries, keys.astype(jnp.float32))
        visible = (key_positions[:, None, None, None, :] <= query_positions[:, None, None, :, None])
        if query_segments is not None:
            visible = visible & (query_segments[:, None, None, :, None] == key_segments[:, None, None, None, :])
        scores = jnp.where(visible, scores, MASKED)
        new_max = jnp.maximum(running_max, scores.max(-1))
        weights = jnp.exp(scores - new_max[..., None])
        correction = jnp.exp(running_max - new_max)
        normaliser = normaliser * correction + weights.sum(-1)
        out = out * correction[..., None] + jnp.einsum("bkgts,bskd->bkgtd", weights, values.astype(jnp.float32))
        return out, new_max, normaliser

    def attend_if_visible(state, query_block, key_block):
        # A key sub-block wholly later than the query sub-block contributes nothing: skipped.
        any_visible = jnp.min(key_block[2]) <= jnp.max(query_block[1])
        return jax.lax.cond(any_visible, lambda s: attend(s, query_block, key_block), lambda s: s, state)

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def attend_pair(state, query_block, key_block):
        return attend_if_visible(state, query_block, key_block)

    def attend_rank_block(state, keys, values, key_positions, key_segments):
        """Every query sub-block against every key sub-block of the block this rank holds now."""
        if blocks == 1:
            return attend_if_visible(state, (queries, positions, segments), (keys, values, key_positions, key_segments))
        key_blocks = tuple(map(split, (keys, values, key_positions, key_segments)))

        def per_query_block(_, query_and_state):
            query_block, query_state = query_and_state
            visit = lambda s, key_block: (attend_pair(s, query_block, key_block), None)
            return None, jax.lax.scan(visit, query_state, key_blocks)[0]

        # state [batch, kv_heads, groups, T, ...] <-> [T / sub, batch, kv_heads, groups, sub, ...]
        by_block = jax.tree.map(lambda x: jnp.moveaxis(x.reshape(*x.shape[:3], blocks, sub, *x.shape[4:]), 3, 0), state)
        _, by_block = jax.lax.scan(per_query_block, None, (own, by_block))
        return jax.tree.map(lambda x: jnp.moveaxis(x, 0, 3).reshape(*x.shape[1:4], length, *x.shape[5:]), by_block)

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def step(carry, index):
        state, keys, values, key_positions, key_segments = carry
        state = attend_rank_block(state, keys, values, key_positions, key_segments)
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
                   *, mesh: Mesh, axis: str, block: int = 0) -> jax.Array:
    """Causal attention of global q [batch, length, heads, head_dim], k, v [batch, length, kv_heads,
    head_dim], by ``positions`` (int [batch or 1, length]) and within ``segments`` ([batch, length]
    or None), with ``length`` split over mesh axis ``axis``: one ``shard_map`` manual over ``axis``
    running ``ring_attention_block`` (score blocks of ``block`` queries x keys; 0: a rank's whole block)."""
    positions = jnp.broadcast_to(positions, q.shape[:2])
    sequence = PartitionSpec(None, axis)
    in_specs = (PartitionSpec(None, axis, None, None),) * 3 + (sequence, None if segments is None else sequence)
    body = functools.partial(ring_attention_block, axis=axis, block=block)
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=PartitionSpec(None, axis, None, None),
                         axis_names={axis})(q, k, v, positions, segments)

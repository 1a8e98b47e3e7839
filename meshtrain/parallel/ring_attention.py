"""Ring attention: causal self-attention over a sequence split across one mesh axis, without gathering it.

Rank ``i`` of the ring axis (size N) holds block ``i`` of the queries, keys and values (positions
``i * T .. (i+1) * T - 1``). In N steps every rank attends its queries to each key/value block in
turn, keeping a running maximum, normaliser and output (the online softmax of blockwise/flash
attention), while the key/value blocks travel one rank along the ring (``lax.ppermute``) per step.
Under the causal mask a block of keys that lies wholly after the rank's queries (source block >
``i``) contributes nothing and is skipped (``lax.cond``); the diagonal block is masked within.
Document segments travel with their keys. Each step is rematerialised in the backward pass
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
from jax.sharding import Mesh, PartitionSpec

# Added to masked scores: finite, so that a row masked in one block yields exp(...) = 0, not NaN.
MASKED = -1e30


def ring_attention_block(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None, *,
                         axis: str) -> jax.Array:
    """The per-rank body, inside a ``shard_map`` manual over ``axis``.

    Args:
      q: [batch, T, heads, head_dim] this rank's queries; k, v: [batch, T, kv_heads, head_dim]
        this rank's keys and values (heads a multiple of kv_heads: grouped-query attention).
      segments: int [batch, T] document ids of this rank's positions, or None (one document).

    Returns:
      [batch, T, heads, head_dim] in q's dtype: causal attention over the whole ring's sequence.
    """
    ring = jax.lax.axis_size(axis)
    rank = jax.lax.axis_index(axis)
    batch, length, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    groups = heads // kv_heads
    queries = q.astype(jnp.float32).reshape(batch, length, kv_heads, groups, head_dim) * head_dim ** -0.5
    own_segments = segments
    local_causal = jnp.arange(length)[:, None] >= jnp.arange(length)[None, :]  # [T, T]

    def attend(carry, keys, values, key_segments, source):
        out, running_max, normaliser = carry
        scores = jnp.einsum("btkgd,bskd->bkgts", queries, keys.astype(jnp.float32))
        visible = jnp.where(source == rank, local_causal, True)[None, None, None]  # earlier blocks: all
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
        state, keys, values, key_segments = carry
        source = (rank - index) % ring  # whose block this rank holds at this step
        state = jax.lax.cond(source <= rank, lambda s: attend(s, keys, values, key_segments, source),
                             lambda s: s, state)  # blocks after the queries are all masked: skipped
        shift = [(i, (i + 1) % ring) for i in range(ring)]
        keys, values = jax.lax.ppermute(keys, axis, shift), jax.lax.ppermute(values, axis, shift)
        if key_segments is not None:
            key_segments = jax.lax.ppermute(key_segments, axis, shift)
        return (state, keys, values, key_segments), None

    varying = lambda x: jax.lax.pcast(x, axis, to="varying")
    state = (varying(jnp.zeros((batch, kv_heads, groups, length, head_dim), jnp.float32)),
             varying(jnp.full((batch, kv_heads, groups, length), MASKED, jnp.float32)),
             varying(jnp.zeros((batch, kv_heads, groups, length), jnp.float32)))
    (state, *_), _ = jax.lax.scan(step, (state, k, v, segments), jnp.arange(ring))
    out, _, normaliser = state
    out = out / normaliser[..., None]  # [batch, kv_heads, groups, T, head_dim]
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, length, heads, head_dim).astype(q.dtype)


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None, *, mesh: Mesh,
                   axis: str) -> jax.Array:
    """Causal attention of global q [batch, length, heads, head_dim], k, v [batch, length, kv_heads,
    head_dim] (and segments [batch, length] or None) with ``length`` split over mesh axis ``axis``:
    one ``shard_map`` manual over ``axis`` running ``ring_attention_block``."""
    sequence = PartitionSpec(None, axis)
    in_specs = (PartitionSpec(None, axis, None, None),) * 3 + (None if segments is None else sequence,)
    body = functools.partial(ring_attention_block, axis=axis)
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=PartitionSpec(None, axis, None, None),
                         axis_names={axis})(q, k, v, segments)

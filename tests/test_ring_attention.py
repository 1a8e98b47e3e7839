"""Ring attention (meshtrain/parallel/ring_attention.py) equals full causal attention: forward and
backward against ``jax.nn.dot_product_attention`` on the whole sequence (fp32, abs 2e-5 / grads rel
L2 1e-5), with grouped-query heads and document segments, on rings of 2, 4 and 8 devices, in sequence
order and in the balanced order (undone before comparing)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from meshtrain.parallel.ring_attention import balanced_order, ring_attention

BATCH, LENGTH, HEADS, KV_HEADS, HEAD_DIM = 2, 32, 4, 2, 8


def _inputs(seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (BATCH, LENGTH, HEADS, HEAD_DIM))
    k = jax.random.normal(keys[1], (BATCH, LENGTH, KV_HEADS, HEAD_DIM))
    v = jax.random.normal(keys[2], (BATCH, LENGTH, KV_HEADS, HEAD_DIM))
    return q, k, v


def _segments():
    """Documents of uneven lengths, some crossing ring blocks; row 1 ends in padding (segment 0)."""
    rows = [np.repeat([1, 2, 3], [5, 17, 10]), np.repeat([1, 2, 0], [12, 13, 7])]
    return jnp.asarray(np.stack(rows), jnp.int32)


def _reference(q, k, v, segments):
    mask = None
    if segments is not None:
        causal = jnp.tril(jnp.ones((LENGTH, LENGTH), bool))
        mask = (causal[None] & (segments[:, :, None] == segments[:, None, :]))[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=segments is None, implementation="xla")


CASES = [(ring, segments, balanced) for ring in (2, 4, 8) for segments in (False, True) for balanced in (False, True)]
FAST = {(4, True, True), (8, False, False)}


@pytest.mark.parametrize("ring,with_segments,balanced", [
    case if case in FAST else pytest.param(*case, marks=pytest.mark.slow) for case in CASES],
    ids=[f"ring{r}-{'segments' if s else 'causal'}-{'balanced' if b else 'in_order'}" for r, s, b in CASES])
def test_ring_attention_equals_full_attention(ring, with_segments, balanced):
    mesh = Mesh(np.array(jax.devices()[:ring]), ("fsdp",))
    q, k, v = _inputs()
    segments = _segments() if with_segments else None
    order = balanced_order(LENGTH, ring) if balanced else np.arange(LENGTH)
    undo = np.argsort(order)
    positions = jnp.asarray(order, jnp.int32)[None]

    def ring_fn(q, k, v):  # permuted in, run, permuted back: comparable with full attention
        permuted = ring_attention(q[:, order], k[:, order], v[:, order], positions,
                                  None if segments is None else segments[:, order], mesh=mesh, axis="fsdp")
        return permuted[:, undo]

    ring_fn = jax.jit(ring_fn)
    full_fn = jax.jit(lambda q, k, v: _reference(q, k, v, segments))
    np.testing.assert_allclose(np.asarray(ring_fn(q, k, v)), np.asarray(full_fn(q, k, v)), atol=2e-5, rtol=0)

    cotangent = jax.random.normal(jax.random.key(7), q.shape)
    loss = lambda fn: (lambda q, k, v: jnp.sum(fn(q, k, v) * cotangent))
    ring_grads = jax.jit(jax.grad(loss(ring_fn), argnums=(0, 1, 2)))(q, k, v)
    full_grads = jax.jit(jax.grad(loss(full_fn), argnums=(0, 1, 2)))(q, k, v)
    for name, mine, theirs in zip("qkv", ring_grads, full_grads):
        error = float(jnp.linalg.norm(mine - theirs) / jnp.linalg.norm(theirs))
        assert error <= 1e-5, (name, error)


def test_balanced_order_gives_each_rank_an_early_and_a_late_chunk():
    np.testing.assert_array_equal(balanced_order(8, 2), [0, 1, 6, 7, 2, 3, 4, 5])
    order = balanced_order(64, 4).reshape(4, 16)  # rank r's block
    blocks = [(order[r][:, None] >= order[s][None, :]).sum() for r in range(4) for s in range(4)]
    work = np.array(blocks).reshape(4, 4).sum(1)  # visible (query, key) pairs per rank
    assert work.max() / work.min() < 1.1  # in sequence order the last rank would have 7x the first's


def test_ring_skips_blocks_after_the_queries_and_moves_keys_by_collective_permute():
    mesh = Mesh(np.array(jax.devices()[:4]), ("fsdp",))
    q, k, v = _inputs()
    positions = jnp.arange(LENGTH, dtype=jnp.int32)[None]
    compiled = jax.jit(lambda q, k, v: ring_attention(q, k, v, positions, None, mesh=mesh, axis="fsdp")
                       ).lower(q, k, v).compile()
    text = compiled.as_text()
    assert "collective-permute" in text and " all-gather(" not in text and "all-gather-start" not in text
    assert "conditional" in text  # the causal skip

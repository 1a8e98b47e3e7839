"""Ring attention (meshtrain/parallel/ring_attention.py) equals full causal attention: forward and
backward against ``jax.nn.dot_product_attention`` on the whole sequence (fp32, abs 2e-5 / grads rel
L2 1e-5), with grouped-query heads and document segments, on rings of 2, 4 and 8 devices, in sequence
order and in the balanced order (undone before comparing), and with each ring step's keys visited in
sub-blocks of queries and keys (``block``); and the ring written for XLA's partitioner inside a
pipeline stage (``ring_attention_in_stage``) on rings of 2 and 4."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from meshtrain.parallel.ring_attention import balanced_order, ring_attention, ring_attention_in_stage, sub_block_length

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


# (ring, segments, balanced, block): block 0 = a rank's whole block per step; 5 of a rank's 16
# positions = sub-blocks of 4, 4 of 8 = sub-blocks of 4 (query x key pairs skip on their own).
CASES = [(ring, segments, balanced, 0) for ring in (2, 4, 8) for segments in (False, True)
         for balanced in (False, True)] + [(2, True, True, 5), (4, False, False, 4), (4, True, True, 4)]
FAST = {(4, True, True, 0), (8, False, False, 0), (2, True, True, 5), (4, False, False, 4)}


@pytest.mark.parametrize("ring,with_segments,balanced,block", [
    case if case in FAST else pytest.param(*case, marks=pytest.mark.slow) for case in CASES],
    ids=[f"ring{r}-{'segments' if s else 'causal'}-{'balanced' if b else 'in_order'}" + (f"-block{kb}" if kb else "")
         for r, s, b, kb in CASES])
def test_ring_attention_equals_full_attention(ring, with_segments, balanced, block):
    mesh = Mesh(np.array(jax.devices()[:ring]), ("fsdp",), axis_types=(AxisType.Auto,))
    q, k, v = _inputs()
    segments = _segments() if with_segments else None
    order = balanced_order(LENGTH, ring) if balanced else np.arange(LENGTH)
    undo = np.argsort(order)
    positions = jnp.asarray(order, jnp.int32)[None]

    def ring_fn(q, k, v):  # permuted in, run, permuted back: comparable with full attention
        permuted = ring_attention(q[:, order], k[:, order], v[:, order], positions,
                                  None if segments is None else segments[:, order], mesh=mesh, axis="fsdp",
                                  block=block)
        return permuted[:, undo]

    _assert_equals_full_attention(ring_fn, q, k, v, segments)


def _assert_equals_full_attention(ring_fn, q, k, v, segments):
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


@pytest.mark.parametrize("ring", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ring_attention_inside_a_pipeline_stage_equals_full_attention(ring):
    """``ring_attention_in_stage`` inside a ``shard_map`` manual over ``stage`` (2 stages, each with
    its own ring over ``fsdp``), balanced order, documents, sub-blocks of 4."""
    mesh = Mesh(np.array(jax.devices()[:2 * ring]).reshape(ring, 2), ("fsdp", "stage"),
                axis_types=(AxisType.Auto,) * 2)
    q, k, v = _inputs()
    segments = _segments()
    order = balanced_order(LENGTH, ring)
    positions = jnp.asarray(order, jnp.int32)[None]

    def ring_fn(q, k, v):
        in_stage = lambda q, k, v: ring_attention_in_stage(q, k, v, positions, segments[:, order], axis="fsdp",
                                                           ranks=ring, block=4)
        permuted = jax.shard_map(in_stage, mesh=mesh, in_specs=P(), out_specs=P(), axis_names={"stage"})(
            q[:, order], k[:, order], v[:, order])
        return permuted[:, np.argsort(order)]

    _assert_equals_full_attention(ring_fn, q, k, v, segments)


def test_sub_block_length_is_the_largest_divisor_not_above_the_request():
    assert [sub_block_length(16, b) for b in (0, 1, 5, 8, 15, 16, 40)] == [16, 1, 4, 8, 8, 16, 16]
    assert sub_block_length(96, 64) == 48


def test_balanced_order_gives_each_rank_an_early_and_a_late_chunk():
    np.testing.assert_array_equal(balanced_order(8, 2), [0, 1, 6, 7, 2, 3, 4, 5])
    order = balanced_order(64, 4).reshape(4, 16)  # rank r's block
    blocks = [(order[r][:, None] >= order[s][None, :]).sum() for r in range(4) for s in range(4)]
    work = np.array(blocks).reshape(4, 4).sum(1)  # visible (query, key) pairs per rank
    assert work.max() / work.min() < 1.1  # in sequence order the last rank would have 7x the first's


def test_ring_skips_blocks_after_the_queries_and_moves_keys_by_collective_permute():
    mesh = Mesh(np.array(jax.devices()[:4]), ("fsdp",), axis_types=(AxisType.Auto,))
    q, k, v = _inputs()
    positions = jnp.arange(LENGTH, dtype=jnp.int32)[None]
    compiled = jax.jit(lambda q, k, v: ring_attention(q, k, v, positions, None, mesh=mesh, axis="fsdp")
                       ).lower(q, k, v).compile()
    text = compiled.as_text()
    assert "collective-permute" in text and " all-gather(" not in text and "all-gather-start" not in text
    assert "conditional" in text  # the causal skip


def test_sub_blocks_hold_a_fraction_of_the_score_memory():
    """A step's score block is [block, block] instead of [queries, keys] of the rank: the
    compiled forward and backward's temporaries (memory_analysis) fall accordingly."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("fsdp",), axis_types=(AxisType.Auto,))
    length = 4096  # 1,024 keys per rank
    q = jax.ShapeDtypeStruct((1, length, 2, 16), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, length, 1, 16), jnp.float32)
    positions = jnp.arange(length, dtype=jnp.int32)[None]

    def temp_bytes(block):
        loss = lambda q, k, v: jnp.sum(ring_attention(q, k, v, positions, None, mesh=mesh, axis="fsdp",
                                                      block=block))
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    whole, sub_blocks = temp_bytes(0), temp_bytes(128)
    score_block = 2 * 1024 * 1024 * 4  # one rank's [heads, queries, keys] fp32 scores
    assert whole > score_block and sub_blocks < whole / 3, (whole, sub_blocks)

"""The blockwise attention kernel against the dense reference: outputs, gradients, work and memory."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshtrain.measure.flops import count_flops
from models.kernels.attention import AttentionKernel, blockwise_attention, causal_pairs, dense_attention

BATCH, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 8


def qkv(length: int, dtype=jnp.float32, seed: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (BATCH, length, HEADS, HEAD_DIM), jnp.float32)
    k = jax.random.normal(keys[1], (BATCH, length, KV_HEADS, HEAD_DIM), jnp.float32)
    v = jax.random.normal(keys[2], (BATCH, length, KV_HEADS, HEAD_DIM), jnp.float32)
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def packed_segments(length: int) -> jax.Array:
    """Row 0: documents of 1, 5, 1, ... tokens then padding (segment 0); row 1: one long document
    after a 1-token one."""
    row0, doc = [], 1
    for size in (1, 5, 1, 9, 2, 13):
        row0 += [doc] * size
        doc += 1
    row0 = (row0 + [0] * length)[:length]
    row1 = [1] + [2] * (length - 1)
    return jnp.asarray([row0, row1], jnp.int32)


def rel_l2(a, b) -> float:
    return float(jnp.linalg.norm((a - b).ravel()) / jnp.linalg.norm(b.ravel()))


def loss_and_grads(attention, q, k, v):
    probe = jax.random.normal(jax.random.key(7), (*q.shape[:-1], v.shape[-1]), jnp.float32)
    loss = lambda q, k, v: jnp.sum(attention(q, k, v).astype(jnp.float32) * probe)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)


# length, block, packed, window: causal; a block that does not divide the length; packed documents
# (1-token documents and padding); a sliding window shorter than the block and one longer.
CASES = {
    "causal": (64, 16, False, 0),
    "block_not_dividing": (50, 16, False, 0),
    "documents": (48, 16, True, 0),
    "documents_uneven_block": (45, 8, True, 0),
    "window_in_block": (64, 16, False, 5),
    "window_over_blocks": (64, 8, True, 21),
}


# The fast tier runs causal rows and packed documents; the full suite every case.
FAST_CASES = ("causal", "documents")


@pytest.mark.parametrize("case", [case if case in FAST_CASES else pytest.param(case, marks=pytest.mark.slow)
                                  for case in CASES])
def test_blockwise_equals_dense_in_outputs_and_gradients(case):
    """fp32: outputs within 2e-5 (absolute), gradients of q, k, v within 1e-5 (relative L2)."""
    length, block, packed, window = CASES[case]
    q, k, v = qkv(length)
    segments = packed_segments(length) if packed else None
    dense = lambda q, k, v: dense_attention(q, k, v, segments, window)
    blockwise = lambda q, k, v: blockwise_attention(q, k, v, segments, segments, window=window, block=block)
    np.testing.assert_allclose(blockwise(q, k, v), dense(q, k, v), atol=2e-5, rtol=0)
    (loss, grads), (ref_loss, ref_grads) = loss_and_grads(blockwise, q, k, v), loss_and_grads(dense, q, k, v)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for grad, ref in zip(grads, ref_grads):
        assert rel_l2(grad, ref) < 1e-5


def test_values_narrower_than_queries_need_no_padding_in_the_blockwise_kernel():
    """Multi-head latent attention's values (v width 5 < q/k width 8) through the blockwise kernel
    equal the dense reference through ``attend``'s padded path, outputs and gradients, and the
    blockwise kernel's output is 5 wide."""
    from models.kernels.attention import AttentionSpec, attend

    q, k, v = qkv(48)
    v = v[..., :5]
    segments = packed_segments(48)
    dense = lambda q, k, v: attend(q, k, v, segments, AttentionSpec(AttentionKernel.XLA))
    blockwise = lambda q, k, v: blockwise_attention(q, k, v, segments, segments, block=16)
    assert blockwise(q, k, v).shape == (BATCH, 48, HEADS, 5)
    np.testing.assert_allclose(blockwise(q, k, v), dense(q, k, v), atol=2e-5, rtol=0)
    (loss, grads), (ref_loss, ref_grads) = loss_and_grads(blockwise, q, k, v), loss_and_grads(dense, q, k, v)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for grad, ref in zip(grads, ref_grads):
        assert grad.shape == ref.shape and rel_l2(grad, ref) < 1e-5


def test_queries_of_one_device_equal_their_rows_of_the_whole():
    """Context parallelism's case: a device's queries (rows from ``query_start``) against every key."""
    length, start, block = 48, 24, 8
    q, k, v = qkv(length)
    segments = packed_segments(length)
    whole = dense_attention(q, k, v, segments, 7)
    part = blockwise_attention(q[:, start:], k, v, segments[:, start:], segments, window=7, block=block,
                               query_start=jnp.int32(start))
    np.testing.assert_allclose(part, whole[:, start:], atol=2e-5, rtol=0)


@pytest.mark.slow
def test_bf16_tracks_fp32():
    """bf16 operands, fp32 statistics: outputs within 2e-2 of the fp32 reference, gradients 2e-2 rel L2."""
    q, k, v = qkv(64)
    _, ref_grads = loss_and_grads(lambda q, k, v: dense_attention(q, k, v, None, 0), q, k, v)
    low = tuple(x.astype(jnp.bfloat16) for x in (q, k, v))
    out = blockwise_attention(*low, block=16)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(out.astype(jnp.float32), dense_attention(q, k, v, None, 0), atol=2e-2)
    _, grads = loss_and_grads(lambda q, k, v: blockwise_attention(q, k, v, block=16), *low)
    for grad, expected in zip(grads, ref_grads):
        assert rel_l2(grad.astype(jnp.float32), expected) < 2e-2


def attention_flops(attention, length: int, backward: bool) -> float:
    q, k, v = (jax.ShapeDtypeStruct(x.shape, x.dtype) for x in qkv(length))
    traced = jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v)), argnums=(0, 1, 2)) if backward else attention
    return count_flops(traced, q, k, v).flops


@pytest.mark.parametrize("backward", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["forward", "forward_backward"])
def test_causal_work_is_half_the_dense_product_and_a_window_is_proportional(backward):
    """Traced FLOPs: causal blockwise at most 0.55 x dense + one block pair's product in the
    forward. The backward recomputes each visited pair's scores (5 products per pair against the
    dense backward's 4 over every pair), so forward + backward is at most 7/6 x that. A window of W:
    at most (W / block + 2) key blocks per query block."""
    length, block = 1024, 64
    recompute = 7 / 6 if backward else 1.0
    dense = attention_flops(lambda q, k, v: dense_attention(q, k, v, None, 0), length, backward)
    per_pair = dense / (length // block) ** 2
    causal = attention_flops(lambda q, k, v: blockwise_attention(q, k, v, block=block), length, backward)
    assert causal <= recompute * (0.55 * dense + per_pair), (causal, dense)
    window = 128
    windowed = attention_flops(lambda q, k, v: blockwise_attention(q, k, v, window=window, block=block), length,
                               backward)
    assert windowed <= recompute * (length // block) * (window // block + 2) * per_pair
    assert len(causal_pairs(length // block, block, window)) == 3 * (length // block) - 3


def test_auto_resolves_per_backend_and_refuses_cudnn_where_it_cannot_run():
    assert AttentionKernel.AUTO.resolve("gpu", packed=False) is AttentionKernel.CUDNN
    assert AttentionKernel.AUTO.resolve("gpu", packed=True, tokamax_refused=NO_TOKAMAX) is AttentionKernel.BLOCKWISE
    assert AttentionKernel.AUTO.resolve("cpu", packed=False) is AttentionKernel.BLOCKWISE
    with pytest.raises(ValueError, match="cudnn needs an NVIDIA GPU"):
        AttentionKernel.CUDNN.resolve("cpu", packed=False)
    with pytest.raises(ValueError, match="no document segments"):
        AttentionKernel.CUDNN.resolve("gpu", packed=True)
    # Where the framework says cuDNN's partitioner or dtype rules it out, AUTO is blockwise, CUDNN an error.
    assert AttentionKernel.AUTO.resolve("gpu", False, "inside pipeline stages") is AttentionKernel.BLOCKWISE
    with pytest.raises(ValueError, match="cudnn cannot run inside pipeline stages; use auto or blockwise"):
        AttentionKernel.CUDNN.resolve("gpu", False, "inside pipeline stages")


NO_TOKAMAX = "here: tokamax is not installed"


@pytest.mark.parametrize(("platform", "packed", "tokamax_refused", "expected"), [
    ("gpu", True, "", AttentionKernel.TOKAMAX),
    ("gpu", True, NO_TOKAMAX, AttentionKernel.BLOCKWISE),
    ("gpu", True, "on float32 inputs (it takes fp16 and bf16)", AttentionKernel.BLOCKWISE),
    ("gpu", False, "", AttentionKernel.CUDNN),
    ("cpu", True, "", AttentionKernel.BLOCKWISE),
    ("tpu", True, "", AttentionKernel.BLOCKWISE)])
def test_auto_runs_tokamax_for_packed_rows_on_gpus_where_it_can(platform, packed, tokamax_refused, expected):
    """tokamax's availability is the framework's answer (``tokamax_refused``: '' where it can run)."""
    assert AttentionKernel.AUTO.resolve(platform, packed, tokamax_refused=tokamax_refused) is expected


@pytest.mark.parametrize(("platform", "refused", "message"), [
    ("cpu", "", "tokamax needs an NVIDIA GPU, these devices are cpu; valid here: auto, blockwise, xla"),
    ("gpu", NO_TOKAMAX, f"tokamax cannot run {NO_TOKAMAX}; use auto or blockwise"),
    ("gpu", "inside pipeline stages", "tokamax cannot run inside pipeline stages; use auto or blockwise")])
def test_tokamax_where_it_cannot_run_is_a_one_line_error(platform, refused, message):
    with pytest.raises(ValueError) as error:
        AttentionKernel.TOKAMAX.resolve(platform, True, tokamax_refused=refused)
    assert str(error.value) == message
    assert AttentionKernel.TOKAMAX.resolve("gpu", True) is AttentionKernel.TOKAMAX


def test_the_mesh_says_where_cudnn_cannot_run():
    """The layouts jax's cuDNN partitioner refuses (queries split along the sequence, pipeline stages:
    compiled for GPUs in tests_gpu) and fp32 inputs; '' where it can run."""
    from meshtrain.mesh import MeshConfig, make_mesh
    from meshtrain.parallel.rules import Preset
    from meshtrain.parallel.activations import activation_sharding

    mesh = lambda *shape: make_mesh(MeshConfig(*shape), jax.devices()[:math.prod(shape)])
    plain = activation_sharding(Preset.FSDP_TP.rules, mesh(1, 2, 2, 1))
    assert plain.cudnn_refused(jnp.bfloat16) == "" and plain.cudnn_refused(jnp.float16) == ""
    assert plain.cudnn_refused(jnp.float32) == "on fp32 inputs (it takes fp16 and bf16)"
    assert activation_sharding(Preset.FSDP_CP.rules, mesh(1, 2, 1, 1)).cudnn_refused(jnp.bfloat16) == (
        "queries split along the sequence (context parallelism)")
    assert activation_sharding(Preset.FSDP_TP.rules, mesh(1, 2, 1, 2)).cudnn_refused(jnp.bfloat16) == (
        "inside pipeline stages")
    # tokamax's kernel runs in a shard_map over the rows and heads: the same layouts refuse it.
    assert activation_sharding(Preset.FSDP_CP.rules, mesh(1, 2, 1, 1)).tokamax_refused(jnp.bfloat16) == (
        "queries split along the sequence (context parallelism)")


def test_the_start_up_line_names_the_kernel_and_refuses_what_cannot_run():
    from meshtrain.errors import ConfigError
    from meshtrain.mesh import MeshConfig, make_mesh
    from meshtrain.parallel.rules import Preset
    from meshtrain.parallel.activations import activation_sharding
    from models.kernels.attention import AttentionSpec

    one = activation_sharding(Preset.FSDP_TP.rules, make_mesh(MeshConfig(1, 1, 1, 1), jax.devices()[:1]))
    bf16 = jnp.bfloat16
    assert one.describe_attention(AttentionSpec(), packed=False, dtype=bf16) == (
        "attention: blockwise, blocks of 512 positions")
    assert one.describe_attention(AttentionSpec(AttentionKernel.XLA, window=64), packed=True, dtype=bf16) == (
        "attention: xla, sliding window 64 (document segments)")
    with pytest.raises(ConfigError, match="cudnn needs an NVIDIA GPU") as error:
        one.describe_attention(AttentionSpec(AttentionKernel.CUDNN), packed=False, dtype=jnp.bfloat16)
    assert error.value.field == "model.attention"
    with pytest.raises(ConfigError) as error:
        one.describe_attention(AttentionSpec(AttentionKernel.TOKAMAX), packed=True, dtype=jnp.bfloat16)
    assert str(error.value) == ("model.attention: tokamax needs an NVIDIA GPU, these devices are cpu; valid here: "
                                "auto, blockwise, xla")
    ring = activation_sharding(Preset.FSDP_CP_RING.rules, make_mesh(MeshConfig(1, 2, 1, 1), jax.devices()[:2]))
    assert ring.describe_attention(AttentionSpec(), packed=False, dtype=jnp.bfloat16) == (
        "attention: ring over fsdp (2 steps, blockwise sub-blocks of at most 512 positions)")
    with pytest.raises(ConfigError, match="cannot run ring attention's steps"):
        ring.describe_attention(AttentionSpec(AttentionKernel.XLA), packed=False, dtype=jnp.bfloat16)


def test_off_the_mesh_fp32_attention_never_asks_for_cudnn():
    """A model run outside any mesh (``models.common.unconstrained``) resolves the kernel for its inputs'
    dtype too: cuDNN's refusal of fp32 is the same line the mesh gives."""
    from models.kernels.attention import cudnn_refusal

    assert cudnn_refusal(jnp.float32) == "on fp32 inputs (it takes fp16 and bf16)"
    assert cudnn_refusal(jnp.bfloat16) == cudnn_refusal(jnp.float16) == ""
    assert AttentionKernel.AUTO.resolve("gpu", False, cudnn_refusal(jnp.float32)) is AttentionKernel.BLOCKWISE
    assert AttentionKernel.AUTO.resolve("gpu", False, cudnn_refusal(jnp.bfloat16)) is AttentionKernel.CUDNN

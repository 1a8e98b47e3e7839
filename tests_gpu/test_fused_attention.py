"""tokamax's flash attention for packed documents (``AttentionKernel.TOKAMAX``, docs/kernels.md), in ``.venv-gpu``:

* on this CPU, ``tokamax_attention`` (the causal mask from each query's first visible key, tokamax's
  op called below its ``custom_vjp`` under ours) run with tokamax's own XLA reference op equals
  ``dense_attention`` in fp32 at rel 1e-5, forward and the q, k, v gradients: causal, windowed,
  packed (1-token documents, padding), GQA and MLA's narrower values. The Mosaic-GPU kernel itself
  does not run in jax 0.11.2's GPU interpreter (it refuses the kernel's ``inline_mgpu`` fences;
  told to ignore them, the warp-specialized ``mpmd_map`` fails: "Cannot lower jaxpr with effects"):
  it is proven by compilation (tests_gpu/test_gpu_compile.py), not by value;
* tokamax installed, ``auto`` runs it for packed bf16 / fp16 rows on GPUs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.kernels.attention import AttentionKernel, AttentionSpec, attend
from models.kernels.tokamax_attention import tokamax_attention, tokamax_refusal

LENGTH, HEAD_DIM = 40, 16
# Row 0: documents of 1, 5, 1, 9 and 13 tokens, then padding (segment 0, as the packer marks it);
# row 1: a 1-token document, then one long one.
SEGMENTS = jnp.asarray([[d for d, n in ((1, 1), (2, 5), (3, 1), (4, 9), (5, 13)) for _ in range(n)] + [0] * 11,
                        [1] + [2] * (LENGTH - 1)], jnp.int32)
# heads, kv_heads, value width, packed, window
CASES = {
    "causal": (4, 4, HEAD_DIM, False, 0),
    "window": (4, 4, HEAD_DIM, False, 7),
    "documents": (4, 4, HEAD_DIM, True, 0),
    "documents_window": (4, 4, HEAD_DIM, True, 7),
    "gqa_documents": (4, 2, HEAD_DIM, True, 0),
    "mla_values": (4, 2, 8, True, 7),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_wrapper_equals_the_dense_reference_with_tokamax_xla_op(case):
    """fp32 inputs (the XLA op takes them; the Mosaic-GPU kernel takes bf16 / fp16): the output and
    the gradients of q, k and v within 1e-5 of their largest value."""
    from tokamax._src.ops.attention.base import DotProductAttention

    heads, kv_heads, value_width, packed, window = CASES[case]
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (2, LENGTH, heads, HEAD_DIM))
    k = jax.random.normal(keys[1], (2, LENGTH, kv_heads, HEAD_DIM))
    v = jax.random.normal(keys[2], (2, LENGTH, kv_heads, value_width))
    probe = jax.random.normal(keys[3], (2, LENGTH, heads, value_width))
    segments = SEGMENTS if packed else None
    kernel = lambda q, k, v: tokamax_attention(q, k, v, segments, window, DotProductAttention())
    reference = lambda q, k, v: attend(q, k, v, segments, AttentionSpec(AttentionKernel.XLA, window=window))
    gradients = lambda f: jax.grad(lambda *x: jnp.sum(f(*x) * probe), argnums=(0, 1, 2))(q, k, v)
    grads, expected_grads = gradients(kernel), gradients(reference)
    for got, expected in zip((kernel(q, k, v), *grads), (reference(q, k, v), *expected_grads)):
        assert got.shape == expected.shape
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(expected))))


def test_auto_runs_tokamax_for_packed_bf16_rows_on_gpus_where_it_is_installed():
    assert tokamax_refusal(jnp.bfloat16) == tokamax_refusal(jnp.float16) == ""
    assert tokamax_refusal(jnp.float32) == "on float32 inputs (it takes fp16 and bf16)"
    resolve = lambda dtype: AttentionKernel.AUTO.resolve("gpu", True, tokamax_refused=tokamax_refusal(dtype))
    assert resolve(jnp.bfloat16) is AttentionKernel.TOKAMAX and resolve(jnp.float32) is AttentionKernel.BLOCKWISE

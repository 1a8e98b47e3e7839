"""The census of an optimized HLO module (``meshtrain.measure.hlo.Module``), which the GPU compile tool reads
because XLA:GPU's compile-only programs have no cost analysis: checked here on XLA:CPU programs whose
FLOPs and collectives are known by construction, and the compile tool's refusal without the CUDA plugin."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from meshtrain.measure.hlo import Instruction, Module, cudnn_attention_flops, pallas_calls, visible_fraction
from meshtrain.xla_flags import cuda_plugin_installed


def test_a_scanned_matmul_counts_once_per_trip():
    """Seven trips of a [64, 128] x [128, 32] matmul in a scan, plus one outside: 8 x 2 m k n."""
    w = jnp.ones((7, 128, 32), jnp.float32)

    def f(x, w, v):
        def body(carry, wi):
            return carry, x @ wi
        _, ys = jax.lax.scan(body, 0.0, w)
        return ys.sum() + (x @ v).sum()

    text = jax.jit(f).lower(jnp.ones((64, 128)), w, jnp.ones((128, 32))).compile().as_text()
    census = Module(text).census()
    assert census.flops == 8 * 2 * 64 * 128 * 32
    assert census.fp8_gemms == 0 and census.ragged_dots == 0


def test_collectives_are_counted_with_their_bytes_and_loop_trips():
    """An all-reduce of a [1024] f32 inside a 5-trip loop and one of [256] outside: 6 per step, 5 x 4 KiB
    + 1 KiB."""
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))

    def f(a, b):
        def body(i, acc):
            return acc + jax.lax.psum(a * i, "x")
        looped = jax.lax.fori_loop(0, 5, body, jnp.zeros_like(a))
        return looped, jax.lax.psum(b, "x")

    g = jax.shard_map(f, mesh=mesh, in_specs=(PartitionSpec(), PartitionSpec()), out_specs=(PartitionSpec(),) * 2)
    args = (jax.device_put(np.ones(1024, np.float32), NamedSharding(mesh, PartitionSpec())),
            jax.device_put(np.ones(256, np.float32), NamedSharding(mesh, PartitionSpec())))
    census = Module(jax.jit(g).lower(*args).compile().as_text()).census()
    assert census.collectives["all-reduce"] == 6
    assert census.collective_bytes["all-reduce"] == 5 * 4096 + 1024


def test_visible_fraction_of_causal_and_windowed_attention():
    assert visible_fraction(4, 4, causal=False, window=0) == 1.0
    assert visible_fraction(4, 4, causal=True, window=0) == (1 + 2 + 3 + 4) / 16
    assert visible_fraction(4, 4, causal=True, window=2) == (1 + 2 + 2 + 2) / 16


def test_cudnn_attention_flops_from_its_shapes():
    """A forward call of XLA:GPU's printed form: batch 1, 32 query heads of 128 over 8 key heads,
    8,192 positions, causal: 2 x (128 + 128) x pairs; the backward 2 x (3 x 128 + 2 x 128) x pairs."""
    forward = ('%fwd = (bf16[1,32,8192,128]{3,1,2,0}, f32[1,32,8192]{2,1,0}, u8[0]{0}) custom-call(%q, %k, %v), '
               'custom_call_target="__cudnn$fmhaSoftmax", operand_layout_constraints={bf16[1,8192,32,128]{3,2,1,0}, '
               'bf16[1,8192,8,128]{3,2,1,0}, bf16[1,8192,8,128]{3,2,1,0}}, backend_config={"cudnn_fmha_backend_config":'
               ' {"intermediate_tensor_shape": {"element_type": "BF16", "dimensions": ["1", "32", "8192", "8192"]}, '
               '"mask_type": "CAUSAL", "bmm1_dot_dimension_numbers": {"lhs_contracting_dimensions": ["3"]}, '
               '"sliding_window_length": 0}}')
    pairs = 32 * 8192 * 8193 / 2
    assert cudnn_attention_flops(Instruction.parse("  " + forward)) == pytest.approx(2 * 256 * pairs)
    backward = forward.replace('fmhaSoftmax"', 'fmhaSoftmaxBackward"')
    assert cudnn_attention_flops(Instruction.parse("  " + backward)) == pytest.approx(2 * 640 * pairs)


def test_flash_attention_kernels_flops_from_their_shapes():
    """tokamax's Mosaic-GPU calls as XLA:GPU prints them (one row, 32 query heads of 128 over 8 key
    heads, 8,192 positions), counted over the causal pairs: the forward 2 x (128 + 128) x pairs; the
    dQ kernel (given the output's cotangent, one result) 2 x (2 x 128 + 128); the dK, dV kernel (two
    results) 2 x (2 x 128 + 2 x 128). A grouped GEMM's call stays a grouped GEMM."""
    q, kv, rows = "bf16[8192,32,128]{2,1,0}", "bf16[8192,8,128]{2,1,0}", "f32[32,8192]{1,0}"
    call = lambda result, operands: (f'  %call = {result} custom-call(%a), custom_call_target="mosaic_gpu_v2", '
                                     f'operand_layout_constraints={{{", ".join(operands)}}}')
    hlo = "\n".join([
        call(f"({q}, {rows}, {rows})", [q, kv, kv, "s32[1,8192]{1,0}", "s32[1,64]{1,0}"]),
        call(q, [q, kv, kv, q, rows, rows, rows, "s32[1,8192]{1,0}"]),
        call(f"({kv}, {kv})", [q, kv, kv, q, rows, rows, rows, "s32[1,8192]{1,0}"]),
        call("bf16[4096,768]{1,0}", ["bf16[4096,2048]{1,0}", "bf16[128,2048,768]{2,1,0}", "s32[128]{0}"])])
    pairs = 32 * 8192 * 8193 / 2
    assert [flops for _, flops in pallas_calls(hlo)] == pytest.approx(
        [2 * 256 * pairs, 2 * 384 * pairs, 2 * 512 * pairs, 2 * 4096 * 2048 * 768])


@pytest.mark.skipif(cuda_plugin_installed(), reason="this venv has the CUDA plugin: tests_gpu covers the tool")
def test_compile_tool_without_the_cuda_plugin_says_how_to_install_it():
    proc = subprocess.run([sys.executable, "-m", "meshtrain.compile", "--config", "configs/tiny.yaml", "--target",
                           "h100"], capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 2
    assert proc.stderr == ("error: --target: compiling for GPUs needs a JAX CUDA plugin: run `make setup-gpu-compile`, "
                           "then `.venv-gpu/bin/python -m meshtrain.compile ...`\n")


def test_compile_tool_refuses_an_unknown_target_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "meshtrain.compile", "--target", "a100"], capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 2
    assert proc.stderr == "error: --target: unknown GPU 'a100'; valid: h100, h200, b200\n"

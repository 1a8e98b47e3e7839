"""tokamax's Mosaic-GPU grouped GEMM (``GroupedKernel.TOKAMAX``, docs/kernels.md), in ``.venv-gpu``:

* on this CPU, the Mosaic-GPU kernel itself run in Pallas' GPU interpret mode equals
  ``jax.lax.ragged_dot`` (fp32, highest precision) forward and for the rows' gradient at rel 1e-5
  (bf16-valued inputs, fp32 accumulation and output; rows of no group and empty groups included).
  The weight gradient's ragged-contracting kernel does not run in jax 0.11.2's Mosaic-GPU interpreter
  (a ``wgmma`` operand it cannot address): it is proven by the compile below, not by value;
* a dropless Qwen3-30B-A3B step (128 experts, top 8, expert parallelism over 8 H100s with the ragged
  exchange) compiles with the kernel's custom calls, forward and backward, and its grouped GEMMs do
  at most 1.15x the active experts' FLOPs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshtrain.config import load_config
from meshtrain.gpu_compile import Target, compile_step, topology
from meshtrain.measure.hlo import pallas_calls
from models.kernels.grouped_matmul import GroupedKernel, tokamax_matmul

# Each peer's exchange buffer 1.125x its even share (model.exchange_buffer_factor): the kernel's calls
# are shaped by the rows that may arrive (the default, 0, sizes them for the worst case: EP x the rows).
QWEN3_MOE = ("configs/qwen3_moe_30b_a3b.yaml", "model.num_layers=1", "train.batch_size=8", "mesh.fsdp=8",
             "model.dispatch=dropless", "model.exchange_buffer_factor=1.125")


@pytest.fixture
def interpreted_hopper(monkeypatch):
    """Pallas Mosaic-GPU kernels interpreted on the CPU, tokamax told it targets an sm90 GPU."""
    from jax._src import config
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    from tokamax._src import gpu_utils

    monkeypatch.setattr(gpu_utils, "is_sm90", lambda device=None: True)
    previous = config.pallas_tpu_interpret_mode_context_manager.swap_local(InterpretGPUParams())
    yield
    config.pallas_tpu_interpret_mode_context_manager.set_local(previous)


def test_the_mosaic_gpu_kernel_equals_ragged_dot_forward_and_rows_gradient(interpreted_hopper):
    m, width, out = 192, 64, 128
    sizes = jnp.array([40, 0, 72, 50], jnp.int32)  # an empty group; 30 rows of no group at the end
    keys = jax.random.split(jax.random.key(0), 3)
    rows = jax.random.normal(keys[0], (m, width)).astype(jnp.bfloat16).astype(jnp.float32)
    w = jax.random.normal(keys[1], (4, width, out)).astype(jnp.bfloat16).astype(jnp.float32)
    d_out = jax.random.normal(keys[2], (m, out)).astype(jnp.bfloat16).astype(jnp.float32)
    reference = lambda r: jax.lax.ragged_dot(r, w, sizes, precision=jax.lax.Precision.HIGHEST)
    kernel = lambda r: tokamax_matmul(r.astype(jnp.bfloat16), w.astype(jnp.bfloat16), sizes)
    from models.kernels.grouped_matmul import _tokamax

    y = _tokamax(rows.astype(jnp.bfloat16), w.astype(jnp.bfloat16), sizes)  # the kernel's own fp32 result
    expected = reference(rows)
    scale = float(jnp.max(jnp.abs(expected)))
    np.testing.assert_allclose(y[:162], expected[:162], rtol=0, atol=1e-5 * scale)
    d_rows = _tokamax(d_out.astype(jnp.bfloat16), jnp.swapaxes(w, 1, 2).astype(jnp.bfloat16), sizes)
    expected_d_rows = jax.vjp(reference, rows)[1](d_out)[0]
    np.testing.assert_allclose(d_rows[:162], expected_d_rows[:162], rtol=0,
                               atol=1e-5 * float(jnp.max(jnp.abs(expected_d_rows))))
    # Through the custom VJP: rows of no group are zero both ways, the rest bf16 roundings of the above.
    out_bf16, pullback = jax.vjp(kernel, rows)
    assert float(jnp.max(jnp.abs(out_bf16[162:]))) == 0.0
    np.testing.assert_allclose(out_bf16[:162].astype(jnp.float32), expected[:162], rtol=0, atol=8e-3 * scale)
    with pytest.raises(Exception, match="Expected shape"):  # dw: not interpretable on jax 0.11.2 (docstring)
        jax.block_until_ready(pullback(d_out.astype(jnp.bfloat16)))


def test_tokamax_is_chosen_on_gpus_for_bf16_and_refused_in_one_line_elsewhere():
    assert GroupedKernel.AUTO.resolve("gpu", jnp.bfloat16) is GroupedKernel.TOKAMAX
    assert GroupedKernel.AUTO.resolve("gpu", jnp.float32) is GroupedKernel.BLOCKED
    assert GroupedKernel.AUTO.resolve("cpu", jnp.bfloat16) is GroupedKernel.BLOCKED
    for platform, dtype, reason in (("cpu", jnp.bfloat16, "this mesh's devices are cpu"),
                                    ("gpu", jnp.float32, "bf16 / fp16 rows, not float32")):
        with pytest.raises(ValueError, match=reason) as error:
            GroupedKernel.TOKAMAX.resolve(platform, dtype)
        assert "\n" not in str(error.value) and str(error.value).startswith("model.grouped_matmul=tokamax")


def test_a_dropless_moe_step_on_8_h100s_runs_the_grouped_gemm_at_the_active_flops():
    """Qwen3-30B-A3B widths (embed 2048, expert mlp 768, 128 experts, top 8) at 1 layer, experts
    split over 8 H100s (fsdp 8, the ragged exchange), full remat: every grouped matmul is a Mosaic-GPU
    call (3 forward + 3 recomputed forward + 6 backward per layer), none is left to XLA (no
    ragged-dot), and their FLOPs, each call counted by its shapes (all the rows its exchange buffer
    can receive), are at most 1.15x the active experts'. At run time the kernel also skips the tiles
    past the rows that arrived (tokamax's sm90 kernel: ``pl.when(actual_size > 0)``)."""
    cfg = load_config(QWEN3_MOE[0], list(QWEN3_MOE[1:]))
    step = compile_step(cfg, topology(Target.H100), Target.H100)
    calls = pallas_calls(step.hlo)
    model = cfg.model
    assert {target for target, _ in calls} == {"mosaic_gpu_v2"}, step.report.custom_calls
    assert step.report.ragged_dots == 0 and step.report.collectives.get("ragged-all-to-all", 0) > 0
    assert model.remat.value == "full" and len(calls) == model.num_layers * (3 + 3 + 6), len(calls)
    tokens = cfg.train.batch_size * model.seq_len / 8  # per device
    matmul = tokens * model.top_k * 2 * model.embed_dim * model.expert_mlp_dim  # one of the three, active rows
    active = matmul * 3 * 4 * model.num_layers  # forward, recomputed forward, two backward products
    grouped = sum(flops for _, flops in calls)
    assert active <= grouped <= 1.15 * active, (grouped / active, step.report.custom_calls)

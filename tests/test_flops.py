"""``meshtrain.measure.flops``: matmul FLOPs of the traced train step with scan trip counts.

On one device the count equals the family's analytic ``flops_per_token`` (the number MFU uses: dense
attention, PaLM's convention), plus exactly the recomputed forward under full remat; these models
run the dense (``xla``) attention kernel, whose work that formula describes (the blockwise kernel's
own count, about half for causal rows, is tests/test_attention.py's). On a 4-stage pipeline it is what each device
executes: each schedule's count equals its table's lock-step time exactly, i.e. the ideal
``(single / S) / (1 - bubble)`` with the table's bubble.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from meshtrain.measure.flops import count_flops
from meshtrain.parallel.pipeline import PipelineConfig, Schedule
from meshtrain.parallel.layout import abstract_model
from meshtrain.parallel.schedules import OpCosts
from models.kernels.attention import AttentionKernel
from models.common import RematPolicy
from models.llama import FAMILY, LlamaConfig
from utils import make_trainer

# A vocabulary large enough that the head matters: 131,072 of the 425,984 matmul weights.
MODEL = LlamaConfig(vocab_size=2048, embed_dim=64, num_layers=8, num_heads=4, num_kv_heads=2, head_dim=16,
                    mlp_dim=128, seq_len=32, attention=AttentionKernel.XLA)
BATCH = 16
TOKENS = BATCH * MODEL.seq_len
STAGES, MICRO = 4, 8


def _step_flops(mesh_shape, model=MODEL, pipeline=PipelineConfig()) -> float:
    trainer = make_trainer(mesh_shape, model, pipeline=pipeline, batch_size=BATCH)
    count = count_flops(trainer.step, trainer.abstract_state(), trainer.abstract_batch())
    assert count.unbounded_loops == 0
    return count.flops


def test_scan_bodies_count_once_per_trip():
    def stack(x, w):
        return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=5)[0]

    shapes = (jax.ShapeDtypeStruct((4, 8), jnp.float32), jax.ShapeDtypeStruct((8, 16), jnp.float32))
    assert count_flops(lambda x, w: x @ w, *shapes).flops == 2 * 4 * 8 * 16
    square = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    assert count_flops(stack, shapes[0], square).flops == 5 * 2 * 4 * 8 * 8


def test_one_device_step_counts_the_analytic_flops_mfu_uses():
    assert _step_flops((1, 1, 1, 1)) == FAMILY.costs(MODEL).flops_per_token() * TOKENS


@pytest.mark.parametrize("remat", [RematPolicy.FULL, RematPolicy.DOTS], ids=lambda r: r.value)
def test_remat_adds_exactly_the_recomputed_forward(remat):
    model = dataclasses.replace(MODEL, remat=remat)
    expected = (FAMILY.costs(model).flops_per_token() + FAMILY.costs(model).recompute_flops_per_token(remat)) * TOKENS
    assert _step_flops((1, 1, 1, 1), model) == expected


# Per token: the head's forward (2 x embed x vocab) and the layers' forward (weights and attention).
HEAD_FORWARD = 2 * MODEL.embed_dim * MODEL.vocab_size
LAYERS_FORWARD = FAMILY.costs(MODEL).flops_per_token() / 3 - HEAD_FORWARD
# The layers' weight matmuls alone (2 FLOPs per weight and token): the weight-gradient half of the
# backward repeats them once; the input-gradient half repeats them and the attention dots twice.
LAYER_WEIGHTS_FORWARD = 2 * sum(math.prod(v.get_value().shape) for path, v in
                                nnx.to_flat_state(abstract_model(MODEL)[1])
                                if path[0] == "layers" and len(v.get_value().shape) >= 3)
ATTENTION_FORWARD = LAYERS_FORWARD - LAYER_WEIGHTS_FORWARD


def _op_costs() -> OpCosts:
    """FLOPs of each kind of work on one stage's layers for one microbatch, and of the head."""
    tokens, per_stage = TOKENS / MICRO, lambda flops: flops * TOKENS / MICRO / STAGES
    return OpCosts(forward=per_stage(LAYERS_FORWARD), backward=per_stage(2 * LAYERS_FORWARD),
                   input_grad=per_stage(LAYER_WEIGHTS_FORWARD + 2 * ATTENTION_FORWARD),
                   weight_grad=per_stage(LAYER_WEIGHTS_FORWARD), head=3 * HEAD_FORWARD * tokens)


@pytest.mark.slow
@pytest.mark.parametrize("pipeline", [
    PipelineConfig(MICRO, Schedule.GPIPE), PipelineConfig(MICRO, Schedule.ONE_F_ONE_B),
    PipelineConfig(MICRO, Schedule.INTERLEAVED, virtual_stages=2), PipelineConfig(MICRO, Schedule.ZB_H1),
], ids=["gpipe", "1f1b", "interleaved", "zb_h1"])
def test_pipeline_schedules_do_only_the_work_their_table_implies(pipeline):
    """Per device, each schedule executes exactly its table's lock-step time: no stage repeats the
    head or the embedding, no forward is recomputed, idle slots compute nothing; so the count is
    (single-device FLOPs / S) / (1 - bubble of the table), priced with the same FLOPs per op."""
    per_device = _step_flops((1, 1, 1, STAGES), pipeline=pipeline)
    table, costs = pipeline.schedule_table(STAGES), _op_costs()
    assert per_device == pytest.approx(table.time(costs), rel=1e-9)
    single = FAMILY.costs(MODEL).flops_per_token() * TOKENS
    assert per_device == pytest.approx(single / STAGES / (1 - table.bubble(costs)), rel=0.05)

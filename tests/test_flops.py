"""``meshtrain.flops``: matmul FLOPs of the traced train step with scan trip counts.

On one device the count equals the family's analytic ``flops_per_token`` (the number MFU uses),
plus exactly the recomputed forward under full remat. On a 4-stage pipeline it is what each device
executes; the tests pin what today's schedules cost against the ideal ``(single / S) / (1 -
bubble)``, term by term (the stacked layers per tick, and the head, which GPipe and interleaved run
replicated outside the stages and 1F1B traces on every stage every tick).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import pytest

from meshtrain.flops import count_flops
from meshtrain.mesh import MeshConfig, make_mesh
from meshtrain.parallel.pipeline import PipelineConfig, Schedule
from meshtrain.parallel.rules import Preset
from meshtrain.trainer import Trainer
from models.common import RematPolicy
from models.llama import FAMILY, LlamaConfig
from utils import OPTIMIZER, TRAIN

# A vocabulary large enough that the head matters: 131,072 of the 425,984 matmul weights.
MODEL = LlamaConfig(vocab_size=2048, embed_dim=64, num_layers=8, num_heads=4, num_kv_heads=2, head_dim=16,
                    mlp_dim=128, seq_len=32)
BATCH = 16
TOKENS = BATCH * MODEL.seq_len
STAGES, MICRO = 4, 8


def _step_flops(mesh_shape, model=MODEL, pipeline=PipelineConfig()) -> float:
    mesh = make_mesh(MeshConfig(*mesh_shape), jax.devices()[: math.prod(mesh_shape)])
    trainer = Trainer(model, dataclasses.replace(TRAIN, batch_size=BATCH), OPTIMIZER, Preset.FSDP_TP.rules, mesh,
                      pipeline)
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
    assert _step_flops((1, 1, 1, 1)) == FAMILY.flops_per_token(MODEL) * TOKENS


@pytest.mark.parametrize("remat", [RematPolicy.FULL, RematPolicy.DOTS], ids=lambda r: r.value)
def test_remat_adds_exactly_the_recomputed_forward(remat):
    model = dataclasses.replace(MODEL, remat=remat)
    expected = (FAMILY.flops_per_token(model) + FAMILY.recompute_flops_per_token(model, remat)) * TOKENS
    assert _step_flops((1, 1, 1, 1), model) == expected


# Per token: the head's forward (2 x embed x vocab) and the layers' forward (weights and attention).
HEAD_FORWARD = 2 * MODEL.embed_dim * MODEL.vocab_size
LAYERS_FORWARD = FAMILY.flops_per_token(MODEL) / 3 - HEAD_FORWARD


@pytest.mark.slow
@pytest.mark.parametrize("pipeline, expected", [
    # GPipe / interleaved: every stage runs its chunk (masked when idle) for V*M + S - 1 ticks,
    # forward and backward; the head runs outside the stages on the whole batch, on every stage.
    (PipelineConfig(MICRO, Schedule.GPIPE),
     3 * LAYERS_FORWARD * TOKENS / STAGES * (MICRO + STAGES - 1) / MICRO + 3 * HEAD_FORWARD * TOKENS),
    (PipelineConfig(MICRO, Schedule.INTERLEAVED, virtual_stages=2),
     3 * LAYERS_FORWARD * TOKENS / STAGES * (2 * MICRO + STAGES - 1) / (2 * MICRO) + 3 * HEAD_FORWARD * TOKENS),
    # 1F1B: M + 2S - 2 ticks, each the stage's forward, its recomputed forward and backward (4 F),
    # and the head's forward and backward on one microbatch, on every stage.
    (PipelineConfig(MICRO, Schedule.ONE_F_ONE_B),
     (MICRO + 2 * STAGES - 2) * (4 * LAYERS_FORWARD / STAGES + 3 * HEAD_FORWARD) * TOKENS / MICRO),
], ids=["gpipe", "interleaved", "1f1b"])
def test_pipeline_schedules_per_device_flops(pipeline, expected):
    per_device = _step_flops((1, 1, 1, STAGES), pipeline=pipeline)
    assert per_device == pytest.approx(expected, rel=1e-9)
    # Against the ideal: what the schedule's bubble alone would cost.
    ideal = FAMILY.flops_per_token(MODEL) * TOKENS / STAGES / (1 - pipeline.bubble_fraction(STAGES))
    assert per_device > ideal

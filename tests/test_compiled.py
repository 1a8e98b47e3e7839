"""What XLA compiles for each layout: the collectives we claim, and the memory FSDP saves.

Counts are read from the optimized HLO of the real train step (XLA:CPU emits no reduce-scatter:
FSDP's gradient reduction is an all-reduce + dynamic-slice there, a reduce-scatter on GPU).
"""

import jax
import pytest
from flax import nnx

from meshtrain.parallel.rules import Preset
from meshtrain.parallel.sharding import activation_sharding
from utils import collective_counts, make_trainer


def _compile_step(trainer):
    return trainer.train_step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile()


def _compile_forward(trainer):
    shard = activation_sharding(trainer.rules, trainer.mesh)
    forward = jax.jit(lambda params, tokens: nnx.merge(trainer.graphdef, params)(tokens, shard),
                      in_shardings=(trainer.param_shardings, trainer.batch_sharding))
    return forward.lower(trainer.abstract_state().params,
                         trainer.abstract_batch()["inputs"]).compile()


@pytest.fixture(scope="module")
def pure_dp():
    return _compile_step(make_trainer((8, 1, 1, 1)))


@pytest.fixture(scope="module")
def fsdp():
    return make_trainer((1, 8, 1, 1))


def test_data_parallel_all_reduces_gradients_and_gathers_nothing(pure_dp):
    counts = collective_counts(pure_dp.as_text())
    assert counts["all-gather"] == 0
    assert counts["all-reduce"] >= 1
    assert counts["collective-permute"] == 0


def test_fsdp_gathers_every_layer_weight_in_the_forward_pass(fsdp):
    forward = collective_counts(_compile_forward(fsdp).as_text())
    # 9 stacked per-layer weights gathered inside the scanned layer, plus embedding, head, norm.
    assert forward["all-gather"] >= 9
    step = collective_counts(_compile_step(fsdp).as_text())
    assert step["all-gather"] >= forward["all-gather"]
    assert step["all-reduce"] + step["reduce-scatter"] >= 1  # gradient reduction


def test_tensor_parallel_all_reduces_activations_in_the_forward_pass():
    forward = collective_counts(_compile_forward(make_trainer((1, 1, 4, 1))).as_text())
    # Row-parallel attention-out and mlp-down each end in an all-reduce over `tensor`.
    assert forward["all-reduce"] >= 2
    assert forward["all-gather"] == 0  # TP alone never gathers a weight


def test_fsdp_argument_bytes_are_at_most_015_of_pure_dp(pure_dp, fsdp):
    dp_bytes = pure_dp.memory_analysis().argument_size_in_bytes
    fsdp_bytes = _compile_step(fsdp).memory_analysis().argument_size_in_bytes
    assert fsdp_bytes <= 0.15 * dp_bytes, (fsdp_bytes, dp_bytes)


def test_dp_preset_on_an_fsdp_mesh_replicates_parameters():
    """The rules, not the mesh, decide where parameters live: `dp` on (1,8,1,1) is pure DP."""
    counts = collective_counts(_compile_step(make_trainer((1, 8, 1, 1), rules=Preset.DP.rules)).as_text())
    assert counts["all-gather"] == 0

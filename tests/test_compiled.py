"""What XLA compiles for each layout: the collectives we claim, and the memory FSDP saves.

Counts are read from the optimized HLO of the real train step (XLA:CPU emits no reduce-scatter:
FSDP's gradient reduction is an all-reduce + dynamic-slice there, a reduce-scatter on GPU).
"""

import jax
import pytest
from flax import nnx

from meshtrain.measure.hlo import collective_counts
from meshtrain.parallel.rules import Preset
from meshtrain.parallel.activations import activation_sharding
from utils import make_trainer


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
    # Three all-reduces over data, nothing else: the scanned layers' gradients (one tuple), the
    # embedding's, head's and final norm's gradients (one tuple) and the loss's token sum.
    assert collective_counts(pure_dp.as_text()) == {"all-gather": 0, "all-reduce": 3, "reduce-scatter": 0,
                                                    "collective-permute": 0, "all-to-all": 0}


def test_fsdp_gathers_every_layer_weight_in_the_forward_pass(fsdp):
    forward = collective_counts(_compile_forward(fsdp).as_text())
    # The 9 per-layer weights (q, k, v, out, gate, up, down, two norm scales) gathered inside the
    # scanned layer (its body appears once), the final norm's scale, the head, and the token ids
    # (batch-split over fsdp, gathered for the embedding lookup): 12. One all-to-all re-lays out an
    # activation at a sharding constraint inside the layer.
    assert forward == {"all-gather": 12, "all-reduce": 0, "reduce-scatter": 0, "collective-permute": 0,
                       "all-to-all": 1}
    step = collective_counts(_compile_step(fsdp).as_text())
    # The step gathers the 9 layer weights again in the backward scan (18), the final norm's scale in
    # the forward and the backward (2), the head and the token ids: 22; all-to-all: the constraint's
    # forward and its transpose. The all-reduces: one tuple of the layers' gradients (XLA:CPU lowers
    # their reduce-scatter to all-reduce + dynamic-slice) and 6 of scalars (the loss's and norms'
    # sums over fsdp, the non-finite check).
    assert step == {"all-gather": 22, "all-reduce": 7, "reduce-scatter": 0, "collective-permute": 0,
                    "all-to-all": 2}


def test_tensor_parallel_all_reduces_activations_in_the_forward_pass():
    forward = collective_counts(_compile_forward(make_trainer((1, 1, 4, 1))).as_text())
    # Row-parallel attention-out and mlp-down each end in an all-reduce over `tensor` (the scanned
    # layer's body appears once), and the embedding lookup of the vocab-split table is one more.
    assert forward["all-reduce"] == 3
    assert forward["all-gather"] == 0  # TP alone never gathers a weight


def test_fsdp_argument_bytes_are_at_most_015_of_pure_dp(pure_dp, fsdp):
    dp_bytes = pure_dp.memory_analysis().argument_size_in_bytes
    fsdp_bytes = _compile_step(fsdp).memory_analysis().argument_size_in_bytes
    assert fsdp_bytes <= 0.15 * dp_bytes, (fsdp_bytes, dp_bytes)


def test_dp_preset_on_an_fsdp_mesh_replicates_parameters():
    """The rules, not the mesh, decide where parameters live: `dp` on (1,8,1,1) is pure DP."""
    counts = collective_counts(_compile_step(make_trainer((1, 8, 1, 1), rules=Preset.DP.rules)).as_text())
    # As pure DP: nothing gathered, the same three all-reduces (two gradient tuples, the token sum).
    assert counts == {"all-gather": 0, "all-reduce": 3, "reduce-scatter": 0, "collective-permute": 0,
                      "all-to-all": 0}

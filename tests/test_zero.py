"""ZeRO stages 0-3 and optimizer offload: the bytes each stage saves, read from XLA's compiled
memory analysis, and losses equal to stage 0."""

import dataclasses
import types

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from meshtrain.errors import ConfigError
from meshtrain.parallel.offload import OffloadConfig, check_host_memory
from meshtrain.parallel.pipeline import PipelineConfig, Schedule
from meshtrain.parallel.zero import ZeroConfig, ZeroStage
from utils import MODEL, make_trainer, run_steps

DP = 8  # ZeRO shards over fsdp: mesh (1, 8, 1, 1)


def _trainer(stage, mesh_shape=(1, DP, 1, 1), offload=False, pipeline=PipelineConfig(), model=MODEL):
    return make_trainer(mesh_shape, model, pipeline=pipeline, zero=ZeroConfig(ZeroStage(stage)),
                        offload=OffloadConfig(offload))


def _optimizer_bytes_per_device(trainer):
    init = jax.jit(trainer.tx.init, out_shardings=trainer.optimizer_compute_shardings)
    return init.lower(trainer.abstract_params).compile().memory_analysis().output_size_in_bytes


def _gradient_bytes_per_device(trainer):
    replicated = NamedSharding(trainer.mesh, PartitionSpec())
    # (loss, gradients, target count, the layers' statistics: none for Llama, FP8 amaxes: none)
    gradients = jax.jit(trainer.gradients,
                        out_shardings=(replicated, trainer.part_shardings.grads, replicated, replicated, replicated))
    compiled = gradients.lower(trainer.abstract_state(), trainer.abstract_batch()).compile()
    return compiled.memory_analysis().output_size_in_bytes - 2 * 4  # minus the two f32 scalars


@pytest.fixture(scope="module")
def trainers():
    return {stage: _trainer(stage) for stage in ZeroStage}


def test_stage1_shards_optimizer_state_by_the_data_parallel_size(trainers):
    replicated = _optimizer_bytes_per_device(trainers[ZeroStage.NONE])
    sharded = _optimizer_bytes_per_device(trainers[ZeroStage.OPTIMIZER])
    assert sharded == pytest.approx(replicated / DP, rel=0.10), (sharded, replicated)


def test_stage2_shards_gradients_by_the_data_parallel_size(trainers):
    replicated = _gradient_bytes_per_device(trainers[ZeroStage.OPTIMIZER])
    sharded = _gradient_bytes_per_device(trainers[ZeroStage.GRADIENTS])
    assert sharded == pytest.approx(replicated / DP, rel=0.10), (sharded, replicated)


def test_stage3_shards_parameters_and_stages_below_keep_them_whole(trainers):
    def argument_bytes(stage):
        trainer = trainers[stage]
        compiled = trainer.train_step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile()
        return compiled.memory_analysis().argument_size_in_bytes

    param_bytes = MODEL.num_params * 4
    # stage 2 holds whole parameters and 1/DP of the moments; stage 3 1/DP of everything.
    assert argument_bytes(ZeroStage.GRADIENTS) == pytest.approx(param_bytes * (1 + 2 / DP), rel=0.02)
    assert argument_bytes(ZeroStage.PARAMETERS) == pytest.approx(param_bytes * 3 / DP, rel=0.05)


@pytest.mark.slow
def test_three_steps_of_every_stage_equal_stage_0(trainers):
    reference = run_steps(trainers[ZeroStage.NONE])
    for stage in (ZeroStage.OPTIMIZER, ZeroStage.GRADIENTS, ZeroStage.PARAMETERS):
        result = run_steps(trainers[stage])
        np.testing.assert_allclose(result.losses, reference.losses, rtol=1e-5, err_msg=str(stage))
        for name, expected in reference.params.items():
            np.testing.assert_allclose(result.params[name], expected, atol=1e-5, err_msg=name)


@pytest.mark.slow
def test_zero_stages_compose_with_tensor_and_pipeline_parallelism():
    model = dataclasses.replace(MODEL, num_layers=4)
    pipeline = PipelineConfig(4, Schedule.ONE_F_ONE_B)
    reference = run_steps(_trainer(0, (1, 1, 1, 1), model=model))
    # ZeRO-2: gradients leave the pipeline split over fsdp (ZeRO-1 changes only the update, outside it).
    result = run_steps(_trainer(2, (1, 2, 2, 2), pipeline=pipeline, model=model))
    np.testing.assert_allclose(result.losses, reference.losses, rtol=1e-5)


def test_offloaded_optimizer_state_rests_in_host_memory_and_trains_identically(trainers):
    offloaded = _trainer(ZeroStage.PARAMETERS, offload=True)
    compiled = offloaded.train_step.lower(offloaded.abstract_state(), offloaded.abstract_batch()).compile()
    assert "S(5)" in compiled.as_text()  # XLA's host memory space in the entry layout
    result = run_steps(offloaded)
    reference = run_steps(trainers[ZeroStage.PARAMETERS])
    np.testing.assert_allclose(result.losses, reference.losses, rtol=1e-6)
    state = offloaded.init_state(seed=0)
    kinds = {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state.opt_state)}
    assert kinds == {"pinned_host"}
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state.params)} == {"device"}


def test_offload_without_host_memory_is_a_clear_error():
    memory = types.SimpleNamespace(kind="device")
    device = types.SimpleNamespace(platform="tpu-like", addressable_memories=lambda: [memory])
    mesh = types.SimpleNamespace(devices=np.array([device], dtype=object))
    with pytest.raises(ConfigError, match="no 'pinned_host' memory") as err:
        check_host_memory(mesh, "offload.optimizer")
    assert err.value.field == "offload.optimizer"

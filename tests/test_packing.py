"""Document packing (``data.packing: documents``): windows of several documents behave as if each
document ran alone, on one device, on a (2,2,2,1) mesh and through every pipeline schedule.

Tolerances (fp32): logits abs 1e-5; losses rel 1e-5; gradients rel L2 1e-5 per parameter.
"""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from meshtrain.data import global_batch
from meshtrain.data.sources import ArrayStream, FileDataset, StreamInfo
from meshtrain.loss import documents_of
from meshtrain.parallel.pipeline import PipelineConfig, Schedule
from meshtrain.parallel.rules import Preset
from meshtrain.parallel.activations import activation_sharding
from models.api import forward
from toy_family import ToyGPTConfig
from utils import initial_state, MODEL, logits_alone, make_trainer, packed_dataset

SEQ = 32
LLAMA = dataclasses.replace(MODEL, num_layers=4, seq_len=SEQ)
TOY = ToyGPTConfig(vocab_size=96, embed_dim=32, num_layers=4, num_heads=4, head_dim=8, mlp_dim=64, seq_len=SEQ)


def test_layout_of_windows_across_boundaries_and_the_padded_tail():
    info = StreamInfo("docs", document_starts=np.array([0, 3, 11, 20]))
    dataset = FileDataset(ArrayStream(np.arange(20) + 50), info, seq_len=7, seed=0, shuffle=False)
    assert dataset.num_windows == 3  # the 4-token tail is padded, not dropped
    rows = dataset.rows(np.arange(3))
    np.testing.assert_array_equal(rows["segments"][0], [1, 1, 1, 2, 2, 2, 2])
    np.testing.assert_array_equal(rows["positions"][0], [0, 1, 2, 0, 1, 2, 3])
    np.testing.assert_array_equal(rows["mask"][0], [1, 1, 0, 1, 1, 1, 1])  # 53 is not predicted from 52
    # Window 1 continues document 1 (positions count from the window's first token of it).
    np.testing.assert_array_equal(rows["segments"][1], [1, 1, 1, 2, 2, 2, 2])
    np.testing.assert_array_equal(rows["positions"][1], [0, 1, 2, 0, 1, 2, 3])
    np.testing.assert_array_equal(rows["mask"][1], [1, 1, 0, 1, 1, 1, 1])
    np.testing.assert_array_equal(rows["inputs"][2], [66, 67, 68, 69, 0, 0, 0])
    np.testing.assert_array_equal(rows["segments"][2], [1, 1, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(rows["mask"][2], [1, 1, 1, 0, 0, 0, 0])


def _trainer(model, mesh_shape, pipeline=PipelineConfig(), batch_size=8):
    return make_trainer(mesh_shape, model, pipeline=pipeline, batch_size=batch_size)


@pytest.mark.parametrize("model,mesh_shape", [
    (LLAMA, (2, 2, 2, 1)), pytest.param(TOY, (2, 2, 2, 1), marks=pytest.mark.slow),
    pytest.param(LLAMA, (1, 1, 1, 1), marks=pytest.mark.slow),
    pytest.param(TOY, (1, 1, 1, 1), marks=pytest.mark.slow)], ids=["llama-2x2x2x1", "toy_gpt-2x2x2x1",
                                                                    "llama-1x1x1x1", "toy_gpt-1x1x1x1"])
def test_packed_logits_equal_each_document_alone(model, mesh_shape):
    trainer = _trainer(model, mesh_shape)
    dataset = packed_dataset()
    batch = global_batch(dataset, 0, 8, trainer.batch_sharding)
    params = initial_state(trainer).params
    shard = activation_sharding(trainer.rules, trainer.mesh)
    logits = jax.jit(lambda p, b: forward(trainer._model_of(p), b["inputs"], shard, documents_of(b)))(params, batch)
    host = {key: np.asarray(value) for key, value in batch.items()}
    assert (host["segments"].max(1) >= 2).all()  # every row holds at least two documents
    reference = logits_alone(jax.device_get(params), trainer.graphdef, host["inputs"], host["segments"])
    valid = host["segments"] > 0
    np.testing.assert_allclose(np.asarray(logits)[valid], reference[valid], atol=1e-5, rtol=0)
    # Without the document layout the same rows give other logits (the test can fail).
    plain = jax.jit(lambda p, b: forward(trainer._model_of(p), b["inputs"], shard))(params, batch)
    assert np.abs(np.asarray(plain)[valid] - reference[valid]).max() > 1e-2


def _flat(tree):
    return {".".join(map(str, path)): np.asarray(v.get_value()) for path, v in nnx.to_flat_state(tree)}


@pytest.fixture(scope="module")
def single_device():
    trainer = _trainer(LLAMA, (1, 1, 1, 1))
    batch = global_batch(packed_dataset(1), 0, 8, trainer.batch_sharding)
    state = initial_state(trainer)
    loss, grads, *_ = jax.jit(trainer.gradients)(state, batch)
    host = {key: np.asarray(value) for key, value in batch.items()}
    logits = logits_alone(jax.device_get(state.params), trainer.graphdef, host["inputs"], host["segments"])
    log_probs = jax.nn.log_softmax(logits, -1)
    token_loss = -np.take_along_axis(np.asarray(log_probs), host["targets"][..., None], -1)[..., 0]
    alone_loss = float((token_loss * host["mask"]).sum() / host["mask"].sum())
    evaluated = jax.device_get(trainer.eval_step(state.params, batch))
    return float(loss), _flat(grads), alone_loss, evaluated


# Segment ids are batch data that travel with each microbatch to every stage's layers the same way in
# every schedule: the interleaved one (each stage runs two chunks of layers) proves it, with the batch
# split (data) and the heads (tensor) beside the stages; every schedule's gradients: test_pipeline.py.
PIPELINES = {"interleaved": PipelineConfig(2, Schedule.INTERLEAVED, virtual_stages=2)}


@pytest.mark.parametrize("mesh_shape,pipeline", [
    ((1, 1, 1, 1), "none"), pytest.param((2, 1, 2, 2), "interleaved", marks=pytest.mark.slow)])
def test_packed_loss_and_gradients_through_every_layout(single_device, mesh_shape, pipeline):
    ref_loss, ref_grads, alone_loss, ref_eval = single_device
    assert ref_loss == pytest.approx(alone_loss, rel=1e-5)  # the objective is each document's alone
    trainer = _trainer(LLAMA, mesh_shape, PIPELINES.get(pipeline, PipelineConfig()))
    batch = global_batch(packed_dataset(1), 0, 8, trainer.batch_sharding)
    state = initial_state(trainer)
    loss, grads, *_ = jax.jit(trainer.gradients)(state, batch)
    assert float(loss) == pytest.approx(ref_loss, rel=1e-5)
    for name, grad in _flat(trainer.layer_order.to_logical(grads)).items():
        error = np.linalg.norm(grad - ref_grads[name]) / np.linalg.norm(ref_grads[name])
        assert error <= 1e-5, (name, error)
    evaluated = jax.device_get(trainer.eval_step(state.params, batch))
    assert float(evaluated["target_tokens"]) == float(ref_eval["target_tokens"])
    assert float(evaluated["loss_sum"]) == pytest.approx(float(ref_eval["loss_sum"]), rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("preset", [Preset.FSDP_CP, Preset.FSDP_CP_RING], ids=["cp_all_gather", "cp_ring_balanced"])
def test_packed_loss_and_gradients_under_context_parallelism(single_device, preset):
    """Segment ids travel with their keys (the ring) or are gathered with them (all-gather)."""
    ref_loss, ref_grads, _, _ = single_device
    trainer = make_trainer((1, 4, 1, 1), LLAMA, rules=preset.rules, batch_size=8)
    batch = global_batch(packed_dataset(1), 0, 8, trainer.batch_sharding)
    loss, grads, *_ = jax.jit(trainer.gradients)(initial_state(trainer), batch)
    assert float(loss) == pytest.approx(ref_loss, rel=1e-5)
    for name, grad in _flat(grads).items():
        assert np.linalg.norm(grad - ref_grads[name]) / np.linalg.norm(ref_grads[name]) <= 1e-5, name

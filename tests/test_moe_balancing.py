"""Auxiliary-loss-free load balancing (DeepSeek-V3; models/moe ``bias_update_rate``, the optimizer's
sign descent of ``SignDescent`` variables in meshtrain/optim.py) and the sigmoid router.

Tolerances (fp32): the bias against NumPy 1e-6 absolute (it moves in steps of the rate); layouts
as tests/test_moe.py's.
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshtrain.config import load_config
from meshtrain.data import DataConfig, global_batch, make_dataset
from meshtrain.loop import train
from meshtrain.parallel.pipeline import PipelineConfig, Schedule
from models.experts import RouterScore, route
from utils import (initial_state, MOE, assert_moe_matches, loss_grads_and_statistics, moe_trainer, relative_l2, restore,
                   trainer_of_config)

REPO = pathlib.Path(__file__).resolve().parents[1]
BALANCED = dataclasses.replace(MOE, bias_update_rate=0.01)


def _bias(state) -> np.ndarray:
    return np.asarray(state.params["layers"]["moe"]["routing_bias"].get_value())


def test_the_bias_moves_against_each_experts_load_as_a_numpy_reference_over_20_steps():
    """One layer, so that the step's ``moe_expert_load`` is that layer's: after each step the bias is
    the last one plus rate * sign(1/E - load), the load measured with the last bias."""
    cfg = dataclasses.replace(BALANCED, num_layers=1)
    trainer = moe_trainer((1, 1, 1, 1), cfg)
    data = make_dataset(DataConfig(), vocab_size=cfg.vocab_size, seq_len=cfg.seq_len)
    state, expected = initial_state(trainer), np.zeros((1, cfg.num_experts))
    for step in range(20):
        state, metrics = trainer.train_step(state, global_batch(data, step, 16, trainer.batch_sharding))
        load = np.asarray(metrics["moe_expert_load"])
        expected = expected + cfg.bias_update_rate * np.sign(1 / cfg.num_experts - load)
        np.testing.assert_allclose(_bias(state), expected, rtol=0, atol=1e-6, err_msg=f"step {step}")
    assert np.abs(expected).max() >= 0.05  # it moved


def test_the_bias_changes_neither_the_loss_nor_the_other_gradients():
    """At a zero bias routing is unchanged: the loss and every parameter's gradient equal the model
    without it (the bias's term is zero in value); the bias's own gradient is each layer's expert
    load above the mean."""
    plain_loss, plain_grads, plain_stats = loss_grads_and_statistics(moe_trainer((1, 1, 1, 1)))
    loss, grads, _ = loss_grads_and_statistics(moe_trainer((1, 1, 1, 1), BALANCED))
    np.testing.assert_allclose(loss, plain_loss, rtol=1e-7)
    for name, expected in plain_grads.items():
        assert relative_l2(grads[name], expected) < 1e-5, name
    layer_loads = grads["layers.moe.routing_bias"] + 1 / MOE.num_experts  # [layers, experts]
    np.testing.assert_allclose(layer_loads.mean(axis=0), plain_stats["moe_expert_load"], atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape, pipeline", [
    ((2, 2, 2, 1), PipelineConfig()),
    ((2, 1, 1, 2), PipelineConfig(2, Schedule.ONE_F_ONE_B)),
], ids=["ep4-tp2", "ep2-stage2-1f1b"])
def test_the_bias_gradient_is_the_same_on_every_layout(four_balanced_layers_reference, mesh_shape, pipeline):
    assert_moe_matches(four_balanced_layers_reference,
                       loss_grads_and_statistics(moe_trainer(mesh_shape, FOUR_BALANCED_LAYERS, pipeline)))


FOUR_BALANCED_LAYERS = dataclasses.replace(BALANCED, num_layers=4)


@pytest.fixture(scope="module")
def four_balanced_layers_reference():
    return loss_grads_and_statistics(moe_trainer((1, 1, 1, 1), FOUR_BALANCED_LAYERS))


@pytest.mark.slow
def test_a_deliberately_imbalanced_router_is_balanced_by_the_bias_within_200_steps():
    """configs/moe_tiny.yaml's model and data (sorted dispatch, no load-balancing loss; one device,
    8 rows a step), its bias started at +0.5 for two of the 8 experts (every token picks them
    first): the largest expert load, about 4x the mean at the start, is below 1.5x the mean after
    200 steps."""
    cfg = load_config(REPO / "configs/moe_tiny.yaml", [
        "model.dispatch=dropless", "model.bias_update_rate=0.01", "model.load_balancing_coef=0",
        "train.steps=200", "train.batch_size=8", "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"])
    trainer = trainer_of_config(cfg, devices=jax.devices()[:1])
    state = initial_state(trainer)
    bias = state.params["layers"]["moe"]["routing_bias"]
    bias.set_value(jnp.zeros(bias.get_value().shape).at[:, :2].set(0.5))
    data = make_dataset(cfg.data, vocab_size=cfg.model.vocab_size, seq_len=cfg.model.seq_len)
    mean = 1 / cfg.model.num_experts
    peaks = []
    for step in range(cfg.train.steps):
        state, metrics = trainer.train_step(state, global_batch(data, step, cfg.train.batch_size,
                                                                trainer.batch_sharding))
        peaks.append(float(np.max(metrics["moe_expert_load"])) / mean)
    print(f"max expert load / mean: {peaks[0]:.2f} at step 1, {peaks[-1]:.2f} at step 200, "
          f"first below 1.5 at step {next(i + 1 for i, p in enumerate(peaks) if p < 1.5)}")
    assert peaks[0] > 3.5 and peaks[-1] < 1.5, (peaks[0], peaks[-1])


def test_the_sigmoid_router_chooses_by_score_plus_bias_and_weighs_by_score():
    logits = jnp.array([[[[2.0, 1.0, 0.0, -1.0]]]])
    bias = jnp.array([0.0, 0.0, 0.5, 0.0])
    routing = route(logits, 2, True, RouterScore.SIGMOID, bias)
    scores = jax.nn.sigmoid(logits[0, 0, 0])
    assert routing.experts[0, 0, 0].tolist() == [2, 0]  # sigmoid(0) + 0.5 > sigmoid(2) > sigmoid(1)
    np.testing.assert_allclose(routing.weights[0, 0, 0], scores[jnp.array([2, 0])] / (scores[2] + scores[0]),
                               rtol=1e-6)
    np.testing.assert_allclose(routing.probs[0, 0, 0], scores / scores.sum(), rtol=1e-6)


@pytest.mark.slow
def test_the_bias_is_checkpointed_and_restored_onto_another_mesh(tmp_path):
    """Three steps of configs/moe_tiny.yaml with the bias on EP 4 x TP 2, saved; restored there and
    onto EP 8 (fsdp 8): the same, moved bias."""
    common = ["model.dispatch=dropless", "model.bias_update_rate=0.01", "train.steps=3", "train.log_every=1",
              "run.tensorboard=false", f"run.dir={tmp_path}", "checkpoint.every=3"]
    cfg = load_config(REPO / "configs/moe_tiny.yaml", common)
    train(cfg)
    restored = {}
    for name, mesh in (("saved on", ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]),
                       ("fsdp8", ["mesh.data=1", "mesh.fsdp=8", "mesh.tensor=1"])):
        restored[name] = _bias(restore(tmp_path, 3, load_config(REPO / "configs/moe_tiny.yaml", common + mesh)).state)
    assert np.abs(restored["saved on"]).max() > 0
    np.testing.assert_array_equal(restored["fsdp8"], restored["saved on"])

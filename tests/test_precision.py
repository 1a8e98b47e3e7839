"""Mixed precision: fp32 master weights under bf16 compute; dynamic loss scaling (on by default for
fp16) skips and counts overflowing steps without touching the state.

fp16 compute itself needs a GPU (XLA:CPU has no fp16 matmul with fp32 accumulation); the scaling
logic is precision-independent, so it is proven here with fp32 compute and a forced overflow.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshtrain.data import DataConfig, global_batch, make_dataset
from meshtrain.errors import ConfigError
from meshtrain.precision import LossScale, Precision, initial_loss_scale
from meshtrain.trainer import Trainer
from utils import OPTIMIZER, make_trainer, run_steps


def _with(trainer, **train_fields):
    return Trainer(trainer.model_cfg, dataclasses.replace(trainer.train_cfg, **train_fields),
                   OPTIMIZER, trainer.rules, trainer.mesh)


@pytest.fixture(scope="module")
def fp32_run():
    return run_steps(make_trainer((2, 2, 2, 1)))


def test_bf16_tracks_fp32_and_keeps_fp32_master_weights(fp32_run):
    result = run_steps(_with(make_trainer((2, 2, 2, 1)), precision=Precision.BF16))
    np.testing.assert_allclose(result.losses, fp32_run.losses, rtol=2e-2)
    assert all(p.dtype == np.float32 for p in result.params.values())
    assert not all(np.array_equal(result.params[k], fp32_run.params[k]) for k in result.params)


def test_power_of_two_dynamic_loss_scale_is_exact_in_fp32(fp32_run):
    result = run_steps(_with(make_trainer((2, 2, 2, 1)), dynamic_loss_scale=True))
    np.testing.assert_allclose(result.losses, fp32_run.losses, rtol=1e-6)


def test_loss_scale_halves_on_overflow_and_grows_after_interval():
    scale = LossScale(scale=jnp.float32(1024.0), good_steps=jnp.int32(0), dynamic=True, growth_interval=2)
    scale = scale.adjust(jnp.bool_(False))
    assert float(scale.scale) == 512.0 and int(scale.good_steps) == 0
    scale = scale.adjust(jnp.bool_(True))
    assert float(scale.scale) == 512.0 and int(scale.good_steps) == 1
    scale = scale.adjust(jnp.bool_(True))
    assert float(scale.scale) == 1024.0 and int(scale.good_steps) == 0
    fixed = initial_loss_scale(dynamic=False)
    assert fixed.adjust(jnp.bool_(False)) is fixed


def test_overflowing_step_is_skipped_and_counted():
    trainer = _with(make_trainer((2, 2, 2, 1)), dynamic_loss_scale=True)
    state = trainer.init_state(seed=0)
    # A scale this large overflows the scaled fp32 loss (and so the gradients) for certain.
    state = state.replace(loss_scale=state.loss_scale.replace(scale=jnp.float32(2.0**127)))
    before = jax.tree.map(np.asarray, state.params)
    dataset = make_dataset(DataConfig(), vocab_size=trainer.model_cfg.vocab_size,
                           seq_len=trainer.model_cfg.seq_len)
    batch = global_batch(dataset, 0, trainer.train_cfg.batch_size, trainer.batch_sharding)
    state, metrics = trainer.train_step(state, batch)
    assert int(metrics["skipped_steps"]) == 1 and int(state.step) == 1
    assert float(state.loss_scale.scale) == 2.0**126
    for (path, old), (_, new) in zip(nnx.to_flat_state(before), nnx.to_flat_state(state.params)):
        np.testing.assert_array_equal(np.asarray(new.get_value()), old.get_value(), err_msg=str(path))


def test_fp16_on_cpu_is_a_clear_config_error():
    with pytest.raises(ConfigError, match="fp16 needs a GPU") as err:
        _with(make_trainer((1, 1, 1, 1)), precision=Precision.FP16)
    assert err.value.field == "train.precision"

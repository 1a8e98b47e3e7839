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
from utils import initial_state, OPTIMIZER, make_trainer, run_steps


def _with(trainer, **train_fields):
    layout = dataclasses.replace(trainer.layout, train=dataclasses.replace(trainer.layout.train, **train_fields))
    return Trainer(layout, trainer.mesh, OPTIMIZER)


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
    state = initial_state(trainer)
    # A scale this large overflows the scaled fp32 loss (and so the gradients) for certain.
    state = state.replace(loss_scale=state.loss_scale.replace(scale=jnp.float32(2.0**127)))
    before = jax.tree.map(np.asarray, state.params)
    dataset = make_dataset(DataConfig(), vocab_size=trainer.layout.model.vocab_size,
                           seq_len=trainer.layout.model.seq_len)
    batch = global_batch(dataset, 0, trainer.layout.train.batch_size, trainer.batch_sharding)
    state, metrics = trainer.train_step(state, batch)
    assert int(metrics["skipped_steps"]) == 1 and int(state.step) == 1
    assert float(state.loss_scale.scale) == 2.0**126
    for (path, old), (_, new) in zip(nnx.to_flat_state(before), nnx.to_flat_state(state.params)):
        np.testing.assert_array_equal(np.asarray(new.get_value()), old.get_value(), err_msg=str(path))


def test_fp16_on_cpu_is_a_clear_config_error():
    with pytest.raises(ConfigError, match="fp16 needs a GPU") as err:
        _with(make_trainer((1, 1, 1, 1)), precision=Precision.FP16)
    assert err.value.field == "train.precision"


def test_bf16_logits_keep_the_heads_fp32_sums():
    """Under bf16 compute the head multiplies bf16 operands and returns its fp32 sums as the logits
    (no round trip through bf16 before the fp32 loss): the jaxpr's last matmul asks for an fp32
    result and nothing converts it, and the values equal an fp32 matmul of the bf16 operands."""
    from meshtrain.precision import cast_floating
    from models.api import family_of
    from utils import MODEL

    model = family_of(MODEL).build(MODEL)
    graphdef, params = nnx.split(model)
    bf16_model = nnx.merge(graphdef, cast_floating(params, jnp.bfloat16))
    x = jax.random.normal(jax.random.key(1), (2, MODEL.seq_len, MODEL.embed_dim)).astype(jnp.bfloat16)
    logits = bf16_model.logits(x)
    assert logits.dtype == jnp.float32
    jaxpr = jax.make_jaxpr(bf16_model.logits)(x).jaxpr
    dots = [eqn for eqn in jaxpr.eqns if "custom_vjp" in eqn.primitive.name]
    head = dots[-1]
    assert head.outvars[0].aval.dtype == jnp.float32 and head.outvars[0].aval.shape[-1] == MODEL.vocab_size
    converts = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "convert_element_type"
                and eqn.invars[0] is head.outvars[0]]
    assert not converts
    normed = bf16_model.final_norm(x)
    head_weight = bf16_model.embedding[...].T if bf16_model.head is None else bf16_model.head[...]
    expected = jnp.einsum("btd,dv->btv", normed.astype(jnp.float32), head_weight.astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(expected), rtol=1e-5, atol=1e-5)

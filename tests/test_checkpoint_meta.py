"""A checkpoint's metadata: the layer order it records (and derives for checkpoints written before it
was recorded), and the config drift a resume names, computed once (``meshtrain.resume.config_drift``)
and only when a checkpoint's arrays do not fit.

No model is built: each checkpoint here holds two small arrays on one device.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshtrain.checkpoint import (LAYER_ORDER, RunCheckpoints, UnreadableCheckpoint, checkpoint_meta,
                                  stored_layer_order)
from meshtrain.config import Config, to_dict
from meshtrain.errors import ConfigError
from meshtrain.mesh import MESH_AXES
from meshtrain.parallel.layer_order import LayerOrder
from meshtrain.resume import config_drift

STATE = {"w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4), "b": jnp.ones(5, jnp.float32)}
INTERLEAVED = LayerOrder(stages=2, virtual_stages=2, num_layers=8)


@pytest.fixture(scope="module")
def mesh():
    return jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1, 1), MESH_AXES)


def _saved(root, mesh, stored: LayerOrder, **meta_changes) -> RunCheckpoints:
    config = to_dict(Config())
    meta = {**checkpoint_meta(step=1, config=config, mesh=mesh, layer_order=stored, batch_size=8,
                              data_seed=0, train_seed=0), **meta_changes}
    checkpoints = RunCheckpoints(root, keep=1, async_save=False)
    checkpoints.save(1, STATE, meta)
    checkpoints.wait()
    return checkpoints


def _abstract(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def test_the_meta_records_the_layer_order_the_config_would_not_give(tmp_path, mesh):
    """Written on one stage with no pipeline section, yet the recorded order (interleaved) is the one read."""
    checkpoints = _saved(tmp_path, mesh, INTERLEAVED)
    meta = checkpoints.read_meta(1)
    assert meta[LAYER_ORDER] == {"stages": 2, "virtual_stages": 2, "num_layers": 8}
    assert stored_layer_order(meta) == INTERLEAVED
    assert LayerOrder.of_config(meta["config"], meta["mesh"]["stage"]) != INTERLEAVED
    checkpoints.close()


def test_a_meta_written_before_the_layer_order_derives_it_from_its_config_and_mesh():
    meta = {"config": {"model": {"num_layers": 8}, "pipeline": {"virtual_stages": 2}}, "mesh": {"stage": 2}}
    assert stored_layer_order(meta) == INTERLEAVED
    assert stored_layer_order({**meta, "mesh": {"stage": 1}}) == LayerOrder(num_layers=8)


@pytest.mark.parametrize("order", [{"stages": 0, "virtual_stages": 1, "num_layers": 4},
                                   {"stages": 1, "num_layers": 4}, [1, 1, 4]], ids=["zero", "missing", "list"])
def test_a_damaged_layer_order_makes_the_checkpoint_unreadable(tmp_path, mesh, order):
    checkpoints = _saved(tmp_path, mesh, LayerOrder(num_layers=4), **{LAYER_ORDER: order})
    with pytest.raises(UnreadableCheckpoint, match=LAYER_ORDER):
        checkpoints.read_meta(1)
    checkpoints.close()


def test_the_drift_is_asked_only_when_the_arrays_do_not_fit(tmp_path, mesh):
    checkpoints = _saved(tmp_path, mesh, LayerOrder(num_layers=4))
    asked = []
    drift = lambda saved: asked.append(saved) or ["model.embed_dim: 1 there, 2 here"]  # noqa: E731
    restored = checkpoints.restore(1, _abstract(STATE), field="test", layer_order=LayerOrder(num_layers=4),
                                   drift=drift)
    assert asked == [] and np.array_equal(restored.state["w"], STATE["w"])
    wider = {**STATE, "b": jnp.ones(6, jnp.float32)}
    with pytest.raises(ConfigError, match=r"b has shape \[5\] float32 there but \[6\] float32 here; the configs "
                                          r"differ in model.embed_dim: 1 there, 2 here$"):
        checkpoints.restore(1, _abstract(wider), field="test", layer_order=LayerOrder(num_layers=4), drift=drift)
    assert len(asked) == 1 and asked[0] == to_dict(Config())
    checkpoints.close()


def test_config_drift_names_numeric_changes_only():
    saved = to_dict(Config())
    changed = dataclasses.replace(Config(), train=dataclasses.replace(Config().train, log_every=7, steps=99))
    here = to_dict(changed)
    here["optimizer"]["learning_rate"] = 0.5
    assert config_drift(here, saved) == [f"optimizer.learning_rate: {saved['optimizer']['learning_rate']!r} there, "
                                         "0.5 here", f"train.steps: {saved['train']['steps']!r} there, 99 here"]
    del saved["train"]["grad_accum"]  # a checkpoint written before the field existed, run at its default
    assert config_drift(to_dict(Config()), saved) == []

"""The train state of a ``Layout`` without its batch (``meshtrain.trainer.ShardedState``): what the tools
restore a run's checkpoint into. Its shapes and shardings are the ``Trainer``'s for any batch, and a
batch that the tool's mesh cannot run (one the ``Trainer`` refuses) does not stop it."""

import dataclasses

import jax
import pytest

from meshtrain.errors import ConfigError
from meshtrain.parallel.layout import Layout
from meshtrain.parallel.rules import Preset
from meshtrain.trainer import ShardedState, Trainer
from utils import MOE, OPTIMIZER, TRAIN, mesh_of

MESH = (1, 8, 1, 1)
# 512 rows per expert block: more than the tokens of 8 rows of 32 (the Trainer refuses it), as many as 16 rows'.
MODEL = dataclasses.replace(MOE, expert_block=512)


def _layout(rows: int) -> Layout:
    return Layout.of(MODEL, mesh_of(MESH).shape, Preset.FSDP_TP.rules, dataclasses.replace(TRAIN, batch_size=rows))


def _described(state) -> list[tuple]:
    """(path, shape, dtype, sharding) of every leaf of an abstract train state."""
    return [(jax.tree_util.keystr(path), leaf.shape, leaf.dtype, leaf.sharding)
            for path, leaf in jax.tree_util.tree_leaves_with_path(state)]


def test_the_state_of_a_layout_needs_no_batch_the_mesh_can_run():
    runnable = Trainer(_layout(16), mesh_of(MESH), OPTIMIZER)
    for rows, field in ((3, "train.batch_size"), (8, "model.expert_block")):  # 3 rows do not split 8 ways
        with pytest.raises(ConfigError) as err:
            Trainer(_layout(rows), mesh_of(MESH), OPTIMIZER)
        assert err.value.field == field
        state = ShardedState(_layout(rows), mesh_of(MESH), OPTIMIZER)
        assert _described(state.abstract_state()) == _described(runnable.abstract_state())
    described = _described(runnable.abstract_state())
    assert len(described) > 20  # parameters, two moments each, counters

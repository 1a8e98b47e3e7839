"""The rules table: presets, validation, the exact shardings parameters are born with, and the
golden per-parameter table of the tiny model on (2,2,2,1)."""

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from meshtrain.config import load_config
from meshtrain.fp8_training import Fp8Recipe, Scaling
from meshtrain.lora import LoraConfig
from meshtrain.errors import ConfigError
from meshtrain.mesh import MeshConfig, make_mesh
from meshtrain.parallel.pipeline import PipelineConfig, Schedule
from meshtrain.parallel.rules import PRESETS, AxisRule, Preset, ShardingRules
from meshtrain.precision import Precision
from models.api import FRAMEWORK_AXES, RESIDUAL_AXES
from models.llama import FAMILY as LLAMA
from meshtrain.parallel.activations import activation_sharding
from meshtrain.parallel.sharding import parameter_table, replicated_parameters
from utils import MODEL, MOE, initial_state, make_trainer, trainer_of_config

GOLDEN = pathlib.Path(__file__).parent / "golden" / "tiny_2x2x2x1.txt"


def test_fsdp_tp_preset_specs():
    rules = PRESETS[Preset.FSDP_TP].completed(LLAMA.axis_roles)
    assert rules.param_spec(("layers", "embed", "mlp")) == P(None, "fsdp", "tensor")
    assert rules.param_spec(("layers", "mlp", "embed")) == P(None, "tensor", "fsdp")
    assert rules.param_spec(("vocab", "embed")) == P("tensor", "fsdp")
    assert rules.activation_spec(("batch", "length", "embed")) == P(("data", "fsdp"), None, None)
    assert rules.activation_spec(("batch", "length", "heads", "head_dim")) == P(("data", "fsdp"), None,
                                                                                 "tensor", None)


def test_every_preset_covers_every_logical_axis():
    for rules in PRESETS.values():
        assert set(FRAMEWORK_AXES) <= set(rules.table)
        assert set(LLAMA.logical_axes) == set(rules.completed(LLAMA.axis_roles).table)
    with pytest.raises(ConfigError, match=r"no rule for \['layers'\]"):
        ShardingRules("partial", {axis: AxisRule() for axis in FRAMEWORK_AXES if axis != "layers"})


def test_a_mesh_axis_may_split_only_one_dimension_of_a_spec():
    rules = PRESETS[Preset.FSDP_TP].overridden({"mlp": AxisRule(params="fsdp")}).completed(LLAMA.axis_roles)
    with pytest.raises(ConfigError, match="already split another dimension") as err:
        rules.param_spec(("layers", "embed", "mlp"))
    assert err.value.field == "sharding.rules.mlp.params"


def test_unknown_logical_axis_is_reported():
    with pytest.raises(ConfigError, match="no rule for logical axis 'experts'"):
        PRESETS[Preset.DP].param_spec(("experts", "embed"))


def test_parameters_are_born_with_their_rule_shardings():
    trainer = make_trainer((2, 2, 2, 1))
    state = trainer.init_state(seed=0)
    mesh = trainer.mesh
    expected = {
        "embedding": P("tensor", "fsdp"),
        "head": P("fsdp", "tensor"),
        "final_norm.scale": P("fsdp"),
        "layers.attention.query": P(None, "fsdp", "tensor", None),
        "layers.attention.key": P(None, "fsdp", "tensor", None),
        "layers.attention.out": P(None, "tensor", None, "fsdp"),
        "layers.mlp.gate": P(None, "fsdp", "tensor"),
        "layers.mlp.down": P(None, "tensor", "fsdp"),
        "layers.attn_norm.scale": P(None, "fsdp"),
    }
    params = {".".join(map(str, path)): v.get_value() for path, v in nnx.to_flat_state(state.params)}
    for name, spec in expected.items():
        array = params[name]
        assert array.sharding.is_equivalent_to(NamedSharding(mesh, spec), array.ndim), name
    # Adam's moments live exactly where their parameter lives.
    mu = state.opt_state[1][0].mu
    gate_mu = mu["layers"]["mlp"]["gate"].get_value()
    assert gate_mu.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "fsdp", "tensor")), 3)
    # Each device holds 1/4 of the gate (fsdp x tensor), none of it twice on one device.
    assert gate_mu.addressable_shards[0].data.shape == (2, 40 // 2, 72 // 2)


# One of each kind of state: parameters split over fsdp x tensor, layers stored in stage order
# (interleaved), experts split by expert parallelism, FP8's scale histories, LoRA's adapters.
BORN_SHARDED = {
    "fsdp-tensor": dict(mesh_shape=(1, 2, 4, 1)),
    "interleaved-stage-order": dict(mesh_shape=(1, 1, 2, 4), model=dataclasses.replace(MODEL, num_layers=8),
                                    pipeline=PipelineConfig(4, Schedule.INTERLEAVED, virtual_stages=2)),
    "experts": dict(mesh_shape=(2, 2, 2, 1), model=MOE),
    "fp8": dict(mesh_shape=(1, 4, 2, 1), precision=Precision.FP8, fp8=Fp8Recipe(scaling=Scaling.DELAYED)),
    "lora": dict(mesh_shape=(1, 2, 2, 2), pipeline=PipelineConfig(2, Schedule.ONE_F_ONE_B),
                 lora=LoraConfig(rank=4, alpha=8.0)),
}


@pytest.mark.parametrize("fields", BORN_SHARDED.values(), ids=BORN_SHARDED)
def test_born_sharded_init_equals_one_devices_state(fields):
    """The whole state (parameters, optimizer state, histories, adapters) created in its shardings
    equals, bit for bit, the same program run on one device: what ``utils.initial_state`` gives the
    layout tests in place of each layout's own init."""
    fields = dict(fields)
    trainer = make_trainer(fields.pop("mesh_shape"), **fields)
    born, placed = trainer.init_state(seed=0), initial_state(trainer)
    assert jax.tree.structure(born) == jax.tree.structure(placed)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(born), jax.tree.leaves(placed)):
        assert a.sharding == b.sharding, path
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


def test_non_divisible_dimension_names_the_mesh_axis():
    with pytest.raises(ConfigError, match=r"'embed' \(size 36\).*split 8 ways") as err:
        make_trainer((1, 8, 1, 1), model=dataclasses.replace(MODEL, embed_dim=36))
    assert err.value.field == "mesh.fsdp"


def test_large_replicated_parameters_are_reported():
    trainer = make_trainer((1, 8, 1, 1), rules=Preset.DP.rules)
    found = replicated_parameters(trainer.abstract_params, trainer.rules, trainer.mesh,
                                  threshold_bytes=15_000)
    assert found == ["embedding (15360 bytes)", "head (15360 bytes)", "layers.attention.out (15360 bytes)",
                     "layers.attention.query (15360 bytes)", "layers.mlp.down (23040 bytes)",
                     "layers.mlp.gate (23040 bytes)", "layers.mlp.up (23040 bytes)"]
    sharded = make_trainer((1, 8, 1, 1), rules=Preset.FSDP.rules)
    assert replicated_parameters(sharded.abstract_params, sharded.rules, sharded.mesh, 15_000) == []


def test_golden_parameter_table_of_tiny_on_2x2x2x1():
    """Regenerate with: python -m meshtrain.train --config configs/tiny.yaml --host-devices 8
    --print-sharding > tests/golden/tiny_2x2x2x1.txt (and review the diff)."""
    cfg = load_config(pathlib.Path(__file__).parents[1] / "configs" / "tiny.yaml")
    trainer = trainer_of_config(cfg)
    assert dict(trainer.mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2, "stage": 1}
    table = parameter_table(trainer.abstract_params, trainer.param_shardings)
    assert table + "\n" == GOLDEN.read_text()


def test_mesh_puts_tensor_on_neighbouring_devices():
    mesh = make_mesh(MeshConfig(2, 2, 2, 1))
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    assert ids[0, 0, :, 0].tolist() == [0, 1]  # tensor varies fastest
    assert ids[0, :, 0, 0].tolist() == [0, 2]
    assert ids[:, 0, 0, 0].tolist() == [0, 4]
    # Auto axes, not left to a default (jax.make_mesh's is Explicit): XLA propagates the shardings.
    assert mesh.axis_types == (AxisType.Auto,) * 4


@pytest.mark.parametrize("mesh_shape", [(1, 2, 2, 2), (2, 1, 2, 2)])
@pytest.mark.parametrize("preset", [Preset.FSDP_TP, Preset.FSDP_TP_CP])
def test_embedding_lookup_inside_a_pipeline_stage(preset, mesh_shape):
    """``lookup`` inside a pipeline stage (``stage`` manual), in a branch only the first stage takes
    (as the executor embeds): it compiles, runs and equals ``jnp.take``, gradient included. On jax
    0.11.2 XLA's partitioner aborted on the gather from a table whose vocab tensor split, and
    layouts that moved the width between mesh axes deadlocked on a collective-permute there."""
    mesh = make_mesh(MeshConfig(*mesh_shape))
    shard = activation_sharding(preset.rules, mesh)
    tables = jax.random.normal(jax.random.key(0), (2, 96, 40))  # one table per stage
    ids = jax.random.randint(jax.random.key(1), (2, 8, 32), 0, 96)
    loss = lambda lookup, table, ids: jnp.sum(jnp.sin(lookup(table, ids)))
    lookup = lambda table, ids: shard.lookup(table, ids, RESIDUAL_AXES)

    def per_stage(tables, ids):
        value, grad = jax.lax.cond(jax.lax.axis_index("stage") == 0,
                                   lambda: jax.value_and_grad(loss, argnums=1)(lookup, tables[0], ids[0]),
                                   lambda: (jnp.zeros(()), jnp.zeros_like(tables[0])))
        return value[None], grad[None]

    staged = jax.shard_map(per_stage, mesh=mesh, in_specs=(P("stage"), P("stage")), out_specs=P("stage"),
                           axis_names={"stage"}, check_vma=False)
    values, grads = jax.jit(staged)(tables, ids)
    value, grad = jax.value_and_grad(loss, argnums=1)(lambda table, ids: jnp.take(table, ids, axis=0), tables[0],
                                                      ids[0])
    np.testing.assert_allclose(values[0], value, rtol=1e-5)
    np.testing.assert_allclose(grads[0], grad, rtol=1e-5, atol=1e-6)

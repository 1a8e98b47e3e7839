"""LoRA (``train.lora``): the low-rank product equals the merged weight's and trains only the adapter;
every layout and pipeline schedule trains the adapters as one device does, with the base frozen
(no moments, no weight gradients: the FLOPs of the traced step say so); a config that cannot work is
a one-line error."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshtrain.errors import ConfigError
from meshtrain.measure.flops import count_flops
from meshtrain.lora import LoraConfig
from meshtrain.planner.estimate import layout_estimate
from meshtrain.parallel.pipeline import PipelineConfig, Schedule
from meshtrain.precision import Precision
from models.common import matmul
from models.kernels.fp8 import MatmulGroup
from models.kernels.lora import LoraWeight, low_rank_equations
from models.llama import LlamaConfig
from utils import MODEL, make_trainer, relative_l2, run_steps

LORA = LoraConfig(rank=4, alpha=8.0)


def test_low_rank_equations_split_the_weight_at_its_inputs():
    assert low_rank_equations("btd,dnh->btnh", 1) == ("btd,dr->btr", "btr,rnh->btnh")
    assert low_rank_equations("btnh,nhd->btd", 2) == ("btnh,nhr->btr", "btr,rd->btd")
    with pytest.raises(ValueError, match="first 1 axes"):
        low_rank_equations("btnh,nhd->btd", 1)  # h is contracted but counted as an output
    with pytest.raises(ValueError, match="no batch axes"):
        low_rank_equations("ebd,edf->ebf", 2)  # e: an experts' batch index


def _weights(seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(keys[0], (2, 5, 8))
    base = jax.random.normal(keys[1], (8, 3, 4))
    a, b = jax.random.normal(keys[2], (8, 2)), jax.random.normal(keys[3], (2, 3, 4))
    return x, base, a, b


def test_lora_matmul_is_the_merged_weights_and_only_the_adapter_gets_gradients():
    x, base, a, b = _weights()
    scale = 1.5

    def ours(base, a, b):
        w = LoraWeight(base=base, a=a, b=b, seed=jnp.zeros(()), scale=scale, inputs=1)
        return jnp.sum(jnp.sin(matmul("btd,dnh->btnh", x, w)))

    def merged(base, a, b):
        return jnp.sum(jnp.sin(jnp.einsum("btd,dnh->btnh", x, base + scale * jnp.einsum("dr,rnh->dnh", a, b))))

    assert float(ours(base, a, b)) == pytest.approx(float(merged(base, a, b)), rel=1e-6)
    got, want = jax.grad(ours, argnums=(0, 1, 2))(base, a, b), jax.grad(merged, argnums=(0, 1, 2))(base, a, b)
    assert not np.any(np.asarray(got[0]))  # the base is frozen
    for ours_grad, reference in zip(got[1:], want[1:]):  # equal up to fp32 summation order
        assert relative_l2(np.asarray(ours_grad), np.asarray(reference)) < 1e-5


def test_lora_dropout_drops_the_adapter_input_by_seed():
    x, base, a, b = _weights()
    out = lambda seed, dropout: matmul("btd,dnh->btnh", x, LoraWeight(base, a, b, jnp.float32(seed), 1.0, 1, dropout))
    no_dropout = out(0, 0.0)
    assert np.array_equal(out(3, 0.5), out(3, 0.5))  # a seed gives one mask
    assert not np.allclose(out(3, 0.5), out(4, 0.5))
    assert not np.allclose(out(3, 0.5), no_dropout)
    # The base's path never drops: with a zero adapter, dropout changes nothing.
    zero_b = jnp.zeros_like(b)
    np.testing.assert_array_equal(matmul("btd,dnh->btnh", x, LoraWeight(base, a, zero_b, jnp.float32(3), 1.0, 1, 0.5)),
                                  matmul("btd,dnh->btnh", x, LoraWeight(base, a, zero_b, jnp.float32(3), 1.0, 1, 0.0)))


@pytest.mark.parametrize("fields,field", [
    ({"rank": -1}, "lora.rank"), ({"rank": 4, "alpha": 0.0}, "lora.alpha"),
    ({"rank": 4, "dropout": 1.0}, "lora.dropout"),
    ({"rank": 4, "matmuls": ("experts",)}, "lora.matmuls"), ({"rank": 4, "matmuls": ("attn",)}, "lora.matmuls"),
    ({"rank": 4, "matmuls": ()}, "lora.matmuls"), ({"init_from": "adapter"}, "lora.init_from")])
def test_lora_config_errors_name_the_field(fields, field):
    with pytest.raises(ConfigError) as err:
        LoraConfig(**fields)
    assert err.value.field == field and "\n" not in str(err.value)


def test_lora_with_fp8_is_refused():
    from meshtrain.train_config import TrainConfig
    with pytest.raises(ConfigError, match="fp8") as err:
        TrainConfig(precision=Precision.FP8, lora=LORA)
    assert err.value.field == "lora"


DEEP = dataclasses.replace(MODEL, num_layers=4)  # 4 chunks of a layer: 2 stages x 2 virtual


@pytest.fixture(scope="module")
def one_device():
    """The one-device run of a model (computed once per model)."""
    runs = {}
    return lambda model: runs.get(model) or runs.setdefault(model, run_steps(make_trainer((1, 1, 1, 1), model,
                                                                                         lora=LORA)))


def _logical(result, part: str) -> dict:
    """The final state's ``part`` ("params" or "adapters") by path, layers in model order."""
    tree = result.trainer.layer_order.to_logical(getattr(result.state, part))
    return {".".join(map(str, path)): np.asarray(v.get_value()) for path, v in nnx.to_flat_state(tree)}


LAYOUTS = [
    pytest.param((2, 2, 2, 1), MODEL, PipelineConfig(), {"grad_accum": 2}, id="data-fsdp-tensor-accum2",
                 marks=pytest.mark.slow),
    pytest.param((1, 2, 1, 2), MODEL, PipelineConfig(microbatches=4), {}, id="fsdp-1f1b"),
    pytest.param((1, 1, 2, 2), DEEP, PipelineConfig(schedule=Schedule.INTERLEAVED, microbatches=4, virtual_stages=2),
                 {}, id="tensor-interleaved", marks=pytest.mark.slow),
    pytest.param((1, 1, 1, 2), MODEL, PipelineConfig(schedule=Schedule.ZB_H1, microbatches=4), {}, id="zb-h1",
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("mesh_shape,model,pipeline,train", LAYOUTS)
def test_lora_layouts_train_the_adapters_as_one_device(one_device, mesh_shape, model, pipeline, train):
    reference = one_device(model)
    result = run_steps(make_trainer(mesh_shape, model, pipeline=pipeline, lora=LORA, **train))
    np.testing.assert_allclose(result.losses, reference.losses, rtol=1e-5)
    assert reference.losses[-1] < reference.losses[0] - 0.05  # the adapters really train
    expected = _logical(reference, "adapters")
    for name, value in _logical(result, "adapters").items():  # as tests/test_equivalence.py compares parameters
        np.testing.assert_allclose(value, expected[name], rtol=0, atol=1e-4, err_msg=name)
    frozen = _logical(reference, "params")
    for name, value in _logical(result, "params").items():
        np.testing.assert_array_equal(value, frozen[name], err_msg=name)


def test_lora_freezes_the_base_in_the_compute_dtype_without_moments():
    trainer = make_trainer((1, 2, 1, 1), lora=LORA, precision=Precision.BF16, steps=2)
    initial = trainer.init_state(seed=0)
    before = {name: np.asarray(value) for name, value in jax.tree_util.tree_leaves_with_path(initial.params)}
    assert {leaf.dtype for leaf in jax.tree.leaves(initial.params)} == {jnp.dtype(jnp.bfloat16)}
    assert {leaf.dtype for leaf in jax.tree.leaves(initial.adapters)} == {jnp.dtype(jnp.float32)}
    adapter_elements = sum(leaf.size for leaf in jax.tree.leaves(initial.adapters))
    moments = [leaf for leaf in jax.tree.leaves(initial.opt_state) if leaf.ndim > 0]
    assert sum(leaf.size for leaf in moments) == 2 * adapter_elements  # Adam's two moments, of the adapters only
    result = run_steps(trainer)
    after = jax.tree.leaves(result.state.params)
    assert all(np.array_equal(np.asarray(a), b) for a, b in zip(after, before.values()))
    assert any(np.any(np.asarray(leaf)) for leaf in jax.tree.leaves(result.state.adapters))
    # The adapted weights: attention's four and the MLP's three, per the default matmul groups.
    assert sorted(trainer.lora.weights) == ["layers.attention.key", "layers.attention.out", "layers.attention.query",
                                            "layers.attention.value", "layers.mlp.down", "layers.mlp.gate",
                                            "layers.mlp.up"]


def test_lora_only_on_the_named_groups():
    trainer = make_trainer((1, 1, 1, 1), lora=dataclasses.replace(LORA, matmuls=(MatmulGroup.MLP,)))
    assert sorted(trainer.lora.weights) == ["layers.mlp.down", "layers.mlp.gate", "layers.mlp.up"]
    assert trainer.describe_kernels(False)[0].startswith("lora: rank 4 (alpha 8, dropout 0) on the mlp matmuls "
                                                         "(3 weights)")


def test_lora_step_skips_the_frozen_weights_gradient_matmuls():
    """The traced step's matmul FLOPs drop by the frozen weights' weight-gradient matmuls (one
    forward's worth of every weight matmul, the head's included) less what the adapters add."""
    model = LlamaConfig(vocab_size=512, embed_dim=256, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=32,
                        mlp_dim=512, seq_len=64)
    rank = 2
    full, lora = (make_trainer((1, 1, 1, 1), model, batch_size=2, **fields)
                  for fields in ({}, {"lora": LoraConfig(rank=rank)}))
    flops = [count_flops(t.step, t.abstract_state(), t.abstract_batch()).flops for t in (full, lora)]
    tokens = 2 * model.seq_len
    d, q, kv, m = model.embed_dim, model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim, model.mlp_dim
    layer_weights = 2 * d * q + 2 * d * kv + 3 * d * m
    weight_gradients = 2 * tokens * (model.num_layers * layer_weights + d * model.vocab_size)
    adapter = rank * model.num_layers * ((d + q) * 2 + (d + kv) * 2 + (d + m) * 3)
    # An adapter's forward (x @ a, then @ b), its input gradient and its weight gradients: 3 x 2 x tokens x size.
    adapters_cost = 3 * 2 * tokens * adapter
    assert flops[0] - flops[1] == pytest.approx(weight_gradients - adapters_cost, rel=1e-6)


def _device_bytes(tree) -> int:
    """Bytes of ``tree`` (ShapeDtypeStructs with shardings) that one device holds."""
    return sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


@pytest.mark.parametrize("mesh_shape", [(1, 1, 1, 1), (1, 4, 2, 1)])
def test_the_planner_counts_the_frozen_base_and_the_adapters_state(mesh_shape):
    """The estimate's parameters and optimizer moments are what the LoRA state holds per device: the base in
    bf16, the adapters in fp32 and Adam's moments of the adapters only, each split as the rules lay it out."""
    trainer = make_trainer(mesh_shape, lora=LORA, precision=Precision.BF16)
    state = trainer.abstract_state()
    est = layout_estimate(trainer.layout, compute_bytes=2)
    held = _device_bytes(state.params) + _device_bytes(state.adapters)
    moments = _device_bytes([leaf for leaf in jax.tree.leaves(state.opt_state) if leaf.ndim > 0])
    assert est.params == pytest.approx(held, rel=0.02)
    assert est.optimizer == pytest.approx(moments, rel=0.02)
    full = layout_estimate(make_trainer(mesh_shape, precision=Precision.BF16).layout, compute_bytes=2)
    assert est.optimizer < full.optimizer and est.params < full.params and est.grads < full.grads

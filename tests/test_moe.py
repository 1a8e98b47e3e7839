"""Mixture of experts (models/moe): the layer against a for-loop reference, expert parallelism equal
to one device, the all-to-all in the compiled step, the experts' bytes per device, bad input.

Tolerances (fp32): losses relative 1e-5, gradients relative L2 1e-5 per parameter, statistics
(expert load, dropped fraction, aux losses) absolute 1e-6.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from meshtrain.measure.hlo import collective_counts
from meshtrain.mesh import MeshConfig, make_mesh
from meshtrain.parallel.pipeline import PipelineConfig, Schedule
from meshtrain.parallel.rules import AxisRule, Preset
from meshtrain.train import main
from meshtrain.trainer import Trainer
from models.common import RematPolicy, unconstrained
from models.moe import Dispatch, MoEConfig
from models.experts import SparseMoE
from utils import MOE, MOE_YAML, assert_moe_matches, loss_grads_and_statistics, moe_trainer, relative_l2

FOUR_LAYERS = dataclasses.replace(MOE, num_layers=4)
# capacity ceil(0.5 * 16 * 2 / 8) = 2 slots per expert and group: tokens really are dropped.
CAPACITY = dataclasses.replace(MOE, dispatch=Dispatch.CAPACITY, capacity_factor=0.5)


# --- the layer against a for-loop reference ---------------------------------------------------------

def _reference_choices(weights: dict, x: jax.Array, cfg: MoEConfig) -> np.ndarray:
    """int [rows, length, top_k]: each token's experts by router probability, read as concrete values."""
    probs = jax.nn.softmax(jnp.einsum("btd,de->bte", x, weights["router"]), axis=-1)
    return np.argsort(-np.asarray(probs), axis=-1)[..., :cfg.top_k]


def _reference_layer(weights: dict, x: jax.Array, cfg: MoEConfig, choices: np.ndarray) -> jax.Array:
    """Each group, each token's choices by rank then position, each chosen expert while it has a
    free slot: the gate-weighted sum of the experts' SwiGLU outputs. The routing decisions (which
    experts, which choices are dropped) are the concrete ``choices``; the weights stay
    differentiable, so gradients are those of the same piecewise function (and it can be jitted)."""
    rows, length, _ = x.shape
    group = cfg.group_size or length
    slots = cfg.slots(group)
    probs = jax.nn.softmax(jnp.einsum("btd,de->bte", x, weights["router"]), axis=-1)
    out = [[jnp.zeros(x.shape[-1], x.dtype) for _ in range(length)] for _ in range(rows)]
    for row in range(rows):
        for start in range(0, length, group):
            filled = [0] * cfg.num_experts
            for rank in range(cfg.top_k):
                for t in range(start, start + group):
                    expert = int(choices[row, t, rank])
                    if filled[expert] == slots:
                        continue  # the expert is full: this choice is dropped
                    filled[expert] += 1
                    weight = probs[row, t, expert]
                    if cfg.norm_topk_prob:
                        weight = weight / jnp.sum(probs[row, t, choices[row, t]])
                    token = x[row, t]
                    hidden = jax.nn.silu(token @ weights["gate"][expert]) * (token @ weights["up"][expert])
                    out[row][t] = out[row][t] + weight * (hidden @ weights["down"][expert])
    return jnp.stack([jnp.stack(tokens) for tokens in out])


@pytest.mark.parametrize("cfg", [
    pytest.param(MoEConfig(embed_dim=12, num_experts=4, top_k=2, expert_mlp_dim=10, seq_len=8, group_size=4),
                 id="dropless", marks=pytest.mark.slow),
    pytest.param(MoEConfig(embed_dim=12, num_experts=4, top_k=2, expert_mlp_dim=10, seq_len=8, group_size=4,
                           dispatch=Dispatch.CAPACITY, capacity_factor=0.5), id="capacity"),
    pytest.param(MoEConfig(embed_dim=12, num_experts=5, top_k=3, expert_mlp_dim=10, seq_len=8, norm_topk_prob=False,
                           dispatch=Dispatch.CAPACITY, capacity_factor=1.0), id="top3-unnormalised",
                 marks=pytest.mark.slow),
])
def test_the_layer_equals_a_for_loop_reference(cfg):
    graphdef, state = nnx.split(SparseMoE(cfg, nnx.Rngs(0)))
    names = ("router", "gate", "up", "down")
    weights = {name: state[name].get_value() for name in names}
    x = jax.random.normal(jax.random.key(1), (3, cfg.seq_len, cfg.embed_dim), jnp.float32)

    def ours(weights, x):
        return nnx.merge(graphdef, nnx.State({name: nnx.Param(weights[name]) for name in names}))(x, unconstrained)

    y, stats = jax.jit(ours)(weights, x)
    choices = _reference_choices(weights, x, cfg)
    reference = jax.jit(lambda w, x: _reference_layer(w, x, cfg, choices))
    expected = reference(weights, x)
    np.testing.assert_allclose(y, expected, rtol=0, atol=1e-5)
    if cfg.dispatch is Dispatch.CAPACITY:
        assert float(stats["dropped"]) > 0  # the capacity really binds
    else:
        assert float(stats["dropped"]) == 0
    cotangent = jax.random.normal(jax.random.key(2), y.shape)
    grads = jax.jit(jax.grad(lambda w, x: jnp.sum(ours(w, x)[0] * cotangent), argnums=(0, 1)))(weights, x)
    reference_grads = jax.jit(jax.grad(lambda w, x: jnp.sum(reference(w, x) * cotangent), argnums=(0, 1)))(weights, x)
    for name in weights:
        assert relative_l2(np.asarray(grads[0][name]), np.asarray(reference_grads[0][name])) < 1e-5, name
    assert relative_l2(np.asarray(grads[1]), np.asarray(reference_grads[1])) < 1e-5


def test_routing_statistics_are_what_they_say():
    cfg = MoEConfig(embed_dim=12, num_experts=4, top_k=2, expert_mlp_dim=10, seq_len=8, group_size=4,
                    dispatch=Dispatch.CAPACITY, capacity_factor=0.5)
    layer = SparseMoE(cfg, nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (3, cfg.seq_len, cfg.embed_dim), jnp.float32)
    _, stats = layer(x, unconstrained)
    # Summed over 3 rows: each row's expert shares sum to 1; 1 slot per expert and group of 4
    # tokens x 2 choices keeps at most 4 of 8 choices per group.
    np.testing.assert_allclose(float(jnp.sum(stats["expert_load"])), 3.0, rtol=1e-6)
    assert 3 * 0.5 <= float(stats["dropped"]) < 3.0
    logits = jnp.einsum("btd,de->bte", x, layer.router[...]).reshape(3, 2, 4, 4)
    z = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2, axis=2)
    np.testing.assert_allclose(float(stats["z_loss"]), float(jnp.sum(jnp.mean(z, axis=1))), rtol=1e-6)


# --- expert parallelism equals one device ------------------------------------------------------------

@pytest.fixture(scope="module")
def reference():
    return loss_grads_and_statistics(moe_trainer((1, 1, 1, 1)))


@pytest.fixture(scope="module")
def reference_four_layers():
    return loss_grads_and_statistics(moe_trainer((1, 1, 1, 1), FOUR_LAYERS))


@pytest.fixture(scope="module")
def reference_capacity():
    return loss_grads_and_statistics(moe_trainer((1, 1, 1, 1), CAPACITY))


EP_LAYOUTS = [
    # (data, fsdp, tensor, stage), extra trainer fields; EP = data x fsdp
    pytest.param((2, 2, 2, 1), {}, id="ep4-fsdp-tp"),
    pytest.param((2, 1, 1, 1), {}, id="ep2", marks=pytest.mark.slow),
    pytest.param((4, 1, 1, 1), {}, id="ep4", marks=pytest.mark.slow),
    pytest.param((8, 1, 1, 1), {}, id="ep8", marks=pytest.mark.slow),
    pytest.param((1, 8, 1, 1), {}, id="ep8-fsdp", marks=pytest.mark.slow),
    pytest.param((1, 2, 4, 1), {}, id="ep2-tp4", marks=pytest.mark.slow),
    pytest.param((4, 1, 2, 1), {"grad_accum": 2}, id="ep4-tp-accum2", marks=pytest.mark.slow),
    # EP over a subset of the batch's axes, and none: the expert buffers' rows keep the rest.
    pytest.param((2, 2, 2, 1), {"rules": Preset.FSDP_TP.rules.overridden({"experts": AxisRule("fsdp", "fsdp")})},
                 id="ep2-over-fsdp-of-dp2-fsdp2", marks=pytest.mark.slow),
    pytest.param((4, 1, 2, 1), {"rules": Preset.FSDP_TP.rules.overridden({"experts": AxisRule()})},
                 id="experts-replicated", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("mesh_shape, fields", EP_LAYOUTS)
def test_expert_parallel_layouts_equal_one_device(reference, mesh_shape, fields):
    assert_moe_matches(reference, loss_grads_and_statistics(moe_trainer(mesh_shape, **fields)))


@pytest.mark.slow
@pytest.mark.parametrize("remat", [RematPolicy.FULL, RematPolicy.NAMED], ids=lambda r: r.value)
def test_remat_with_expert_parallelism_equals_one_device(reference, remat):
    trainer = moe_trainer((2, 2, 2, 1), dataclasses.replace(MOE, remat=remat))
    assert_moe_matches(reference, loss_grads_and_statistics(trainer))


PIPELINES = [
    pytest.param((2, 1, 1, 2), PipelineConfig(2, Schedule.ONE_F_ONE_B), id="ep2-stage2-1f1b", marks=pytest.mark.slow),
    pytest.param((2, 1, 2, 2), PipelineConfig(2, Schedule.INTERLEAVED, virtual_stages=2),
                 id="ep2-tp2-stage2-interleaved", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("mesh_shape, pipeline", PIPELINES)
def test_moe_layers_inside_pipeline_stages_equal_one_device(reference_four_layers, mesh_shape, pipeline):
    assert_moe_matches(reference_four_layers,
                       loss_grads_and_statistics(moe_trainer(mesh_shape, FOUR_LAYERS, pipeline)))


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", [(2, 2, 2, 1), (8, 1, 1, 1)], ids=["ep4-fsdp-tp", "ep8"])
def test_capacity_mode_drops_tokens_and_equals_one_device(reference_capacity, mesh_shape):
    assert float(reference_capacity[2]["moe_dropped_fraction"]) > 0.05
    assert_moe_matches(reference_capacity, loss_grads_and_statistics(moe_trainer(mesh_shape, CAPACITY)))


@pytest.mark.slow
def test_the_aux_losses_are_part_of_the_objective(reference):
    without_aux = loss_grads_and_statistics(
        moe_trainer((1, 1, 1, 1), dataclasses.replace(MOE, load_balancing_coef=0.0, z_loss_coef=0.0)))
    loss, _, stats = reference
    expected = (without_aux[0] + MOE.load_balancing_coef * MOE.num_layers * float(stats["moe_load_balancing_loss"])
                + MOE.z_loss_coef * MOE.num_layers * float(stats["moe_router_z_loss"]))
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    assert relative_l2(without_aux[1]["layers.moe.router"], reference[1]["layers.moe.router"]) > 1e-3


# --- the compiled program ---------------------------------------------------------------------------

_SHAPE = re.compile(r"(?:f32|bf16)\[([\d,]*)\]")


def _gathered_expert_weights(hlo: str, cfg: MoEConfig) -> list[str]:
    """All-gathers whose result has the shape of (a layer of) an expert weight, at any TP split."""
    hidden = {cfg.expert_mlp_dim // t for t in (1, 2, 4)}
    weights = ({(cfg.num_experts, cfg.embed_dim, f) for f in hidden}
               | {(cfg.num_experts, f, cfg.embed_dim) for f in hidden})
    found = []
    for line in hlo.splitlines():
        if " all-gather(" not in line and " all-gather-start(" not in line:
            continue
        result = line.split("=", 1)[1].split("all-gather")[0]
        for dims in _SHAPE.findall(result):
            shape = tuple(int(d) for d in dims.split(",") if d)
            if shape[-3:] in weights:
                found.append(line.strip()[:160])
    return found


def test_the_detector_sees_a_gathered_expert_weight():
    mesh = make_mesh(MeshConfig(4, 1, 2, 1), jax.devices())
    split = NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None, "tensor"))
    weight = jax.ShapeDtypeStruct((MOE.num_experts, MOE.embed_dim, MOE.expert_mlp_dim), jnp.float32, sharding=split)
    gather = jax.jit(lambda w: w * 2, out_shardings=NamedSharding(mesh, PartitionSpec()))
    assert _gathered_expert_weights(gather.lower(weight).compile().as_text(), MOE)


@pytest.fixture(scope="module")
def expert_parallel_step():
    trainer = moe_trainer((4, 1, 2, 1))
    compiled = trainer.train_step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile()
    return trainer, compiled


def test_expert_parallelism_compiles_to_all_to_all_and_never_gathers_expert_weights(expert_parallel_step):
    _, compiled = expert_parallel_step
    hlo = compiled.as_text()
    # The sorted dispatch's exchange (meshtrain/parallel/experts.py; the layer scan's body appears
    # once): rows, their expert ids and the results back in the forward, the rows' and the results'
    # transposes in the backward: exactly 5.
    assert collective_counts(hlo)["all-to-all"] == 5
    assert _gathered_expert_weights(hlo, MOE) == []


@pytest.mark.slow
def test_inside_pipeline_stages_the_experts_exchange_rows_and_never_gather_weights():
    """The sorted dispatch's exchange inside a 1F1B stage (XLA's all-to-all of a resharding
    transpose, meshtrain/parallel/experts.py): the rows travel, the expert weights stay split."""
    trainer = moe_trainer((2, 1, 1, 2), FOUR_LAYERS, PipelineConfig(2, Schedule.ONE_F_ONE_B))
    hlo = trainer.train_step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile().as_text()
    assert _gathered_expert_weights(hlo, FOUR_LAYERS) == []
    # At least the forward's rows, ids and results and the backward's two transposes (the
    # schedule's slot bodies may hold more than one copy).
    assert collective_counts(hlo)["all-to-all"] >= 5


def test_each_device_holds_one_ep_th_of_the_expert_weights(expert_parallel_step):
    trainer, compiled = expert_parallel_step
    replicated = moe_trainer((4, 1, 2, 1), rules=Preset.FSDP_TP.rules.overridden({"experts": AxisRule()}))
    baseline = replicated.train_step.lower(replicated.abstract_state(), replicated.abstract_batch()).compile()
    ep, tensor = 4, 2
    # fp32 parameters plus Adam's two moments; expert_mlp is split over tensor in both layouts.
    expert_bytes = MOE.num_layers * MOE.num_experts * MOE.expert_params * 4 * 3 / tensor
    saved = (baseline.memory_analysis().argument_size_in_bytes - compiled.memory_analysis().argument_size_in_bytes)
    np.testing.assert_allclose(saved, expert_bytes * (1 - 1 / ep), rtol=0.02)
    # Replicated experts still split the expert buffers' rows over the batch's axes: each token's
    # expert work is done once, not on every device (temp bytes would be ~2.3x otherwise).
    assert baseline.memory_analysis().temp_size_in_bytes < 1.2 * compiled.memory_analysis().temp_size_in_bytes
    spec = trainer.param_shardings["layers"]["moe"]["gate"].get_value().spec
    assert spec[:3] == (None, ("data", "fsdp"), None) and spec[3] == "tensor"


# --- bad input ---------------------------------------------------------------------------------------

@pytest.fixture
def moe_yaml(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("bad input reached Trainer.init_state (compilation) instead of failing early")

    monkeypatch.setattr(Trainer, "init_state", fail)
    path = tmp_path / "moe.yaml"
    path.write_text(MOE_YAML)
    return str(path)


@pytest.mark.parametrize("overrides, field, hints", [
    (["model.top_k=9"], "model.top_k", ["between 1 and num_experts=8"]),
    (["model.top_k=0"], "model.top_k", ["between 1 and num_experts=8"]),
    (["model.capacity_factor=0"], "model.capacity_factor", ["> 0"]),
    (["model.capacity_factor=-1.5"], "model.capacity_factor", ["> 0"]),
    (["model.group_size=5"], "model.group_size", ["must divide seq_len=32"]),
    (["model.num_experts=6"], "mesh.fsdp", ["'experts' (size 6)", "split 4 ways", "['data', 'fsdp']"]),
    (["sharding.preset=fsdp", "sharding.rules.experts={params: tensor, activations: tensor}"],
     "sharding.rules.experts", ["['tensor']", "do not split the batch"]),
    (["sharding.rules.experts={params: null, activations: [data, fsdp]}"], "sharding.rules.experts",
     ["must split"]),
], ids=["top-k-above-experts", "top-k-zero", "capacity-zero", "capacity-negative", "group-size",
        "experts-vs-ep", "experts-outside-batch-axes", "experts-held-elsewhere"])
def test_bad_moe_input_is_one_line_error(moe_yaml, capsys, overrides, field, hints):
    rc = main(["--config", moe_yaml, *overrides])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"error: {field}: "), lines[0]
    for hint in hints:
        assert hint in lines[0], (hint, lines[0])


# --- a run -------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_tiny_moe_config_trains_and_plots_the_expert_load(tmp_path):
    import json
    import pathlib

    config = pathlib.Path(__file__).resolve().parents[1] / "configs" / "moe_tiny.yaml"
    run_dir = tmp_path / "run"
    assert main(["--config", str(config), "train.steps=60", "train.log_every=10", f"run.dir={run_dir}",
                 "checkpoint.every=0"]) == 0
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "loss" in line]
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5
    for line in steps:
        load = line["moe_expert_load"]
        assert len(load) == 8 and sum(load) == pytest.approx(1.0, abs=1e-5)
        assert line["moe_expert_load_max"] == max(load) and line["moe_expert_load_min"] == min(load)
        assert 0 <= line["moe_dropped_fraction"] < 1 and line["moe_load_balancing_loss"] > 0
    assert (run_dir / "moe_expert_load.png").stat().st_size > 1000

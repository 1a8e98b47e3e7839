"""The sorted dispatch of the mixture of experts (``Dispatch.DROPLESS``: grouped matmuls in
models/moe/model.py, the expert exchange in meshtrain/parallel/experts.py): equal to the one-hot
dispatch, its exchange's overflow counted exactly and warned about, its FLOPs those of the active
experts, its temporaries against capacity mode's.

Expert parallelism of the sorted dispatch equal to one device (EP 2/4/8, x TP, with FSDP,
accumulation, remat, pipelines) is tests/test_moe.py's: its model dispatches sorted.
Tolerances (fp32): as tests/test_moe.py's; layer outputs absolute 1e-5.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshtrain.errors import ConfigError
from meshtrain.measure.flops import count_flops
from meshtrain.mesh import MeshConfig, make_mesh
from meshtrain.parallel.experts import Exchange, describe_exchange, exchange_rows
from meshtrain.parallel.rules import Preset
from meshtrain.parallel.activations import activation_sharding
from meshtrain.train import main
from models.kernels.attention import AttentionKernel
from models.common import unconstrained
from models.kernels.grouped_matmul import BlockSlots, GroupedKernel, blocked_matmul
from models.moe import FAMILY, Dispatch, MoEConfig
from models.experts import SparseMoE, grouped_swiglu
from utils import MOE, MOE_YAML, assert_moe_matches, loss_grads_and_statistics, moe_trainer

ONEHOT = dataclasses.replace(MOE, dispatch=Dispatch.ONEHOT)


@pytest.fixture(scope="module")
def one_hot_reference():
    return loss_grads_and_statistics(moe_trainer((1, 1, 1, 1), ONEHOT))


def test_sorted_dispatch_equals_the_one_hot_dispatch(one_hot_reference):
    assert MOE.dispatch is Dispatch.DROPLESS
    assert_moe_matches(one_hot_reference, loss_grads_and_statistics(moe_trainer((1, 1, 1, 1))))


@pytest.mark.slow
def test_the_one_hot_dispatch_under_expert_parallelism_equals_one_device(one_hot_reference):
    assert_moe_matches(one_hot_reference, loss_grads_and_statistics(moe_trainer((2, 2, 2, 1), ONEHOT)))


# --- the exchange's bound ------------------------------------------------------------------------------

def _expected_overflow(choices: np.ndarray, peers: int, local: int, factor: float) -> np.ndarray:
    """bool [rows, length, top_k]: the choices a device's full buffers drop. Each device (a block of
    rows under data parallelism) numbers its choices per destination peer in token-then-rank order
    and keeps the first ``exchange_rows`` of each peer."""
    rows = choices.shape[0]
    dropped = np.zeros(choices.shape, bool)
    for device in range(peers):
        block = slice(device * rows // peers, (device + 1) * rows // peers)
        flat = choices[block].reshape(-1)
        capacity = exchange_rows(flat.size, peers, factor)
        seen = np.zeros(peers, int)
        mask = np.zeros(flat.size, bool)
        for i, expert in enumerate(flat):
            peer = expert // local
            mask[i] = seen[peer] >= capacity
            seen[peer] += 1
        dropped[block] = mask.reshape(choices[block].shape)
    return dropped


def _ep8_layer(factor: float):
    """A layer under EP 8 (data parallelism over 8 devices) with exchange bound ``factor``, run on
    8 rows: (cfg, layer, x, shard, y, stats, the renormalised top-k weights, the choices)."""
    cfg = dataclasses.replace(MOE, exchange_buffer_factor=factor)
    layer = SparseMoE(cfg, nnx.Rngs(3))
    x = jax.random.normal(jax.random.key(4), (8, cfg.seq_len, cfg.embed_dim))
    mesh = make_mesh(MeshConfig(8, 1, 1, 1), jax.devices())
    shard = activation_sharding(Preset.DP.rules.completed(FAMILY.axis_roles), mesh)
    y, stats = jax.jit(lambda x: layer(x, shard))(x)
    logits = jnp.einsum("btd,de->bte", x, layer.router[...])
    weights, choices = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), cfg.top_k)
    return cfg, layer, x, shard, y, stats, weights / jnp.sum(weights, axis=-1, keepdims=True), choices


def test_a_bounded_exchange_drops_exactly_the_choices_past_each_peers_buffer():
    """EP 8 (data parallelism over 8 devices) with buffers of an even share: the layer's
    output is one device's with exactly those choices left out, and the overflow says how many."""
    cfg, layer, x, shard, y, stats, weights, choices = _ep8_layer(1.0)
    dropped = _expected_overflow(np.asarray(choices), 8, cfg.num_experts // 8, 1.0)
    assert 0 < dropped.sum() < dropped.size / 2
    np.testing.assert_allclose(float(stats["overflow"]), dropped.sum() / (cfg.seq_len * cfg.top_k), rtol=1e-6)
    # One device, the dropped choices sent to no expert (an id past the experts: a zero row).
    ids = jnp.where(jnp.asarray(dropped), cfg.num_experts, choices)
    rows = jnp.broadcast_to(x[:, :, None], (*ids.shape, cfg.embed_dim)).reshape(-1, cfg.embed_dim)
    out = grouped_swiglu(rows, ids.reshape(-1), layer.gate[...], layer.up[...], layer.down[...],
                         spec=cfg.grouped_spec.resolved("cpu"))
    expected = jnp.sum(out.reshape(*ids.shape, -1) * weights[..., None], axis=2)
    np.testing.assert_allclose(np.asarray(y), np.asarray(expected), rtol=0, atol=1e-5)
    # The worst-case buffers drop nothing: the layer equals one device's.
    exact = dataclasses.replace(cfg, exchange_buffer_factor=0.0)
    layer.cfg = exact
    y_exact, stats_exact = jax.jit(lambda x: layer(x, shard))(x)
    y_one, _ = layer(x, unconstrained)
    assert float(stats_exact["overflow"]) == 0
    np.testing.assert_allclose(np.asarray(y_exact), np.asarray(y_one), rtol=0, atol=1e-5)


@pytest.mark.slow  # the fast tier's exchange: test_the_ragged_exchange_trains_as_one_device
def test_the_run_says_which_exchange_runs_and_warns_of_an_overflow(tmp_path, capsys):
    path = tmp_path / "moe.yaml"
    path.write_text(MOE_YAML)
    main(["--config", str(path), "model.exchange_buffer_factor=0.3", f"run.dir={tmp_path / 'run'}",
          "checkpoint.every=0"])
    err = capsys.readouterr().err
    assert "experts: split 4 ways over ['data', 'fsdp']; a sorted dispatch's rows travel by all-to-all" in err
    assert "one-hot" not in err
    warnings = [line for line in err.splitlines() if line.startswith("warning: moe_exchange_overflow")]
    assert len(warnings) == 1 and "raise model.exchange_buffer_factor" in warnings[0], err


# --- the ragged exchange (GPU, TPU), its layout checked through an emulation ------------------------------

def _ragged_by_buffers(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """``jax.lax.ragged_all_to_all`` (one slice per peer) as its docstring defines it, by an
    ``all_to_all`` of buffers: XLA:CPU does not implement the primitive, so on CPU the exchange's
    offsets and sizes are checked against this."""
    rows = operand.shape[0]
    j = jnp.arange(rows)
    wide = lambda mask: mask.reshape(mask.shape + (1,) * (operand.ndim - 1))
    sending = jnp.where(wide(j < send_sizes[:, None]), operand[jnp.minimum(input_offsets[:, None] + j, rows - 1)], 0)
    arrived = jax.lax.all_to_all(sending, axis_name, 0, 0)  # [sources, rows, ...]
    at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # where each source's rows go here
    index = jnp.where(j < recv_sizes[:, None], at[:, None] + j, output.shape[0])  # past the end: not written
    return output.at[index.reshape(-1)].set(arrived.reshape(-1, *operand.shape[1:]), mode="drop")


@pytest.fixture
def ragged_exchange(monkeypatch):
    """The ragged exchange on this CPU: chosen as on a GPU, its primitive emulated."""
    monkeypatch.setattr(Exchange, "of", classmethod(lambda cls, mesh: Exchange.RAGGED))
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", _ragged_by_buffers)


def test_the_exchange_is_chosen_by_platform_and_said():
    mesh = make_mesh(MeshConfig(1, 4, 2, 1), jax.devices())
    rules = Preset.FSDP_TP.rules.completed(FAMILY.axis_roles)
    assert Exchange.of(mesh) is Exchange.BUFFERS  # XLA:CPU: UNIMPLEMENTED ragged-all-to-all
    assert describe_exchange(rules, mesh, "experts", sorted_dispatch=True) == (
        "experts: split 4 ways over ['fsdp']; a sorted dispatch's rows travel by all-to-all of fixed per-peer "
        "buffers (this backend has no ragged all-to-all)")
    assert describe_exchange(rules, mesh, "experts", sorted_dispatch=False) == (  # issue 52, item 3
        "experts: split 4 ways over ['fsdp']; a one-hot dispatch's slots travel as XLA partitions them (all-to-all "
        "of a resharding)")
    gpu = type("Device", (), {"platform": "gpu"})()
    assert Exchange.of(type("Mesh", (), {"devices": np.array([gpu])})()) is Exchange.RAGGED


def test_the_ragged_exchange_lowers_and_xla_cpu_refuses_it(monkeypatch):
    """The train step with the ragged exchange lowers to ragged all-to-alls; XLA:CPU still refuses
    to compile them (when it stops refusing, CPU should take the ragged exchange too)."""
    monkeypatch.setattr(Exchange, "of", classmethod(lambda cls, mesh: Exchange.RAGGED))
    trainer = moe_trainer((1, 4, 2, 1))
    lowered = trainer.train_step.lower(trainer.abstract_state(), trainer.abstract_batch())
    assert "ragged_all_to_all" in lowered.as_text()
    with pytest.raises(jax.errors.JaxRuntimeError, match="ragged-all-to-all"):
        lowered.compile()


def _expected_ragged_overflow(choices: np.ndarray, peers: int, local: int, factor: float) -> int:
    """The choices a ragged exchange drops: each receiver fills its ``peers x C`` rows with its
    sources' rows in source order (each source's rows in token-then-rank order) and cuts the rest."""
    rows = choices.shape[0]
    flat = [choices[d * rows // peers:(d + 1) * rows // peers].reshape(-1) for d in range(peers)]
    receive = peers * exchange_rows(flat[0].size, peers, factor)
    offered = np.array([[np.sum(f // local == p) for p in range(peers)] for f in flat])  # [source, peer]
    taken = [np.clip(receive - (np.cumsum(offered[:, p]) - offered[:, p]), 0, offered[:, p]) for p in range(peers)]
    return int(offered.sum() - sum(t.sum() for t in taken))


@pytest.mark.parametrize("factor", [0.0, 0.6])
def test_the_ragged_exchange_equals_one_device_and_counts_what_it_drops(ragged_exchange, factor):
    """EP 8 (data parallelism over 8 devices) through the ragged exchange: with the worst-case
    bound the layer equals one device's; with a bound below it, the overflow is exactly the
    choices past each receiver's buffer (NumPy, above)."""
    cfg, layer, x, _, y, stats, _, choices = _ep8_layer(factor)
    dropped = _expected_ragged_overflow(np.asarray(choices), 8, cfg.num_experts // 8, factor)
    np.testing.assert_allclose(float(stats["overflow"]), dropped / (cfg.seq_len * cfg.top_k), rtol=1e-6)
    if factor == 0:
        assert dropped == 0
        np.testing.assert_allclose(np.asarray(y), np.asarray(layer(x, unconstrained)[0]), rtol=0, atol=1e-5)
    else:
        assert dropped > 0


def test_the_ragged_exchange_trains_as_one_device(ragged_exchange, one_hot_reference):
    """Loss and every gradient through the ragged exchange (EP 4 x TP 2: the hidden split summed
    after the return trip) equal the one-device one-hot step's."""
    assert_moe_matches(one_hot_reference, loss_grads_and_statistics(moe_trainer((1, 4, 2, 1))))


# --- the blocked kernel ------------------------------------------------------------------------------------

def test_the_blocked_kernel_skips_the_blocks_past_the_used_ones():
    """Rows of no group (an exchange buffer's padding) fill no block: the slots name the blocks past
    the used ones group -1, and the kernel neither computes them nor reads them (junk put there
    reaches no output and no gradient), forward and both gradients equal to a per-block reference."""
    groups, block = 3, 2
    ids = jnp.array([1, 0, 1, 7, 7, 7, 7, 7, 2, 7])  # sizes 1, 2, 1: one block each; 6 blocks in all
    slots = BlockSlots.of(ids, groups, block)
    np.testing.assert_array_equal(np.asarray(slots.block_group), [0, 1, 2, -1, -1, -1])
    rows = jax.random.normal(jax.random.key(0), (ids.shape[0], 4))
    w = jax.random.normal(jax.random.key(1), (groups, 4, 5))
    x = slots.gather(rows).at[3:].set(100.0)  # junk in the skipped blocks
    cotangent = jax.random.normal(jax.random.key(2), (slots.blocks, block, 5))

    def loss(x, w, product):
        return jnp.sum(product(x, w) * cotangent)

    def reference(x, w):  # the used blocks only, each with its group's weights
        used = jnp.stack([x[b] @ w[g] for b, g in enumerate([0, 1, 2])])
        return jnp.concatenate([used, jnp.zeros((3, block, 5))])

    kernel = lambda x, w: blocked_matmul(x, w, slots.block_group)
    np.testing.assert_allclose(kernel(x, w), reference(x, w), rtol=1e-6, atol=1e-6)
    (dx, dw), (dx_ref, dw_ref) = (jax.grad(loss, argnums=(0, 1))(x, w, f) for f in (kernel, reference))
    assert not np.any(np.asarray(dx[3:]))
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-6, atol=1e-5)


# --- work and memory at fine-grained shapes --------------------------------------------------------------

def _fine_grained(num_experts: int, top_k: int, dispatch: Dispatch, **fields) -> MoEConfig:
    """Embed 128, expert MLP 64, 2048 positions: one row holds 2048 * top_k token choices."""
    return MoEConfig(vocab_size=256, embed_dim=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                     num_experts=num_experts, top_k=top_k, expert_mlp_dim=64, seq_len=2048, dispatch=dispatch,
                     **fields)


@pytest.mark.parametrize("num_experts, top_k", [(64, 4), (128, 8)])
def test_the_sorted_step_computes_the_active_experts_only(num_experts, top_k):
    """Matmul FLOPs of the traced train step (one row, one device; grouped matmuls at their rows)
    against the ideal in which each token pays for its top_k experts only (the family's
    ``flops_per_token``, MFU's count; the dense ``xla`` attention and head that formula describes): exactly
    1 with ragged_dot, within 1.15 with the blocked kernel's padding, where the one-hot dispatch
    computes every slot."""
    ratios = {}
    for name, dispatch, kernel in (("ragged", Dispatch.DROPLESS, GroupedKernel.RAGGED),
                                   ("blocked", Dispatch.DROPLESS, GroupedKernel.BLOCKED),
                                   ("onehot", Dispatch.ONEHOT, GroupedKernel.AUTO)):
        cfg = _fine_grained(num_experts, top_k, dispatch, grouped_matmul=kernel, attention=AttentionKernel.XLA)
        trainer = moe_trainer((1, 1, 1, 1), cfg, batch_size=1, loss_chunk=0)  # the chunked loss recomputes the head
        count = count_flops(trainer.step, trainer.abstract_state(), trainer.abstract_batch())
        ratios[name] = count.flops / (FAMILY.costs(cfg).flops_per_token() * cfg.seq_len)
    assert ratios["ragged"] == pytest.approx(1.0, rel=1e-9)
    assert 1.0 < ratios["blocked"] < 1.15, ratios
    assert ratios["onehot"] > 0.5 * num_experts / top_k, ratios


@pytest.mark.slow
def test_sorted_temporaries_are_a_fraction_of_capacity_modes():
    """Per-device temporaries (``memory_analysis``, abstract compile) of the 128-expert top-8 step at
    one row of 2048 positions: the sorted dispatch keeps [positions x top_k] rows per layer,
    capacity mode [positions x experts x C] one-hot dispatch and combine tensors (C = 160)."""
    temp = {}
    for dispatch in (Dispatch.DROPLESS, Dispatch.CAPACITY):
        trainer = moe_trainer((1, 1, 1, 1), _fine_grained(128, 8, dispatch), batch_size=1)
        compiled = trainer.train_step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile()
        temp[dispatch] = compiled.memory_analysis().temp_size_in_bytes
    assert temp[Dispatch.CAPACITY] > 4 * temp[Dispatch.DROPLESS], temp


@pytest.mark.parametrize("dispatch, said", [(Dispatch.DROPLESS, "a sorted dispatch's rows travel by all-to-all"),
                                            (Dispatch.CAPACITY, "a one-hot dispatch's slots travel as XLA "
                                                                "partitions them")])
def test_the_start_up_line_describes_the_configured_dispatch(dispatch, said):
    """Issue 52, item 3: under capacity (one-hot) dispatch it described the sorted one."""
    trainer = moe_trainer((2, 2, 2, 1), dataclasses.replace(MOE, dispatch=dispatch))
    lines = [line for line in trainer.describe_kernels(packed=False) if line.startswith("experts")]
    assert len(lines) == 1 + (dispatch is Dispatch.DROPLESS) and said in lines[0], lines
    if dispatch is Dispatch.DROPLESS:  # the grouped kernel the CPU runs (tokamax is for GPUs)
        assert lines[1] == "experts' grouped matmul: blocked", lines


def test_a_grouped_kernel_that_cannot_run_here_is_one_line_at_start_up():
    """tokamax's grouped GEMM runs on NVIDIA GPUs only: on CPU devices the start-up refuses it."""
    trainer = moe_trainer((1, 1, 1, 1), dataclasses.replace(MOE, dispatch=Dispatch.DROPLESS,
                                                         grouped_matmul=GroupedKernel.TOKAMAX))
    with pytest.raises(ConfigError) as err:
        trainer.describe_kernels(packed=False)
    assert err.value.field == "model.grouped_matmul" and "cpu" in str(err.value) and "\n" not in str(err.value)

"""``meshtrain.parallel.backward_split``: a stage's backward split into its input-gradient and
weight-gradient parts gives the backward's values, runs each of its matmul FLOPs exactly once
(input part + weight part == backward, ``meshtrain.measure.flops``), and defers all the weight-gradient
matmuls (dW = a^T g) to the weight part: scanned layers, a weight shared across a scan (its
gradient a carry), remat, a backward inside ``jit`` or ``shard_map``, and the Llama stage under
remat policies."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend import core
from jax.sharding import NamedSharding, PartitionSpec

from meshtrain.measure.flops import count_flops
from meshtrain.parallel.backward_split import UnsupportedBackward, split_backward
from models.common import RematPolicy, matmul
from models.llama import FAMILY
from utils import MODEL

BATCH, EMBED, HIDDEN, LAYERS = 4, 8, 12, 3


def _vjp_backward(forward, *primals):
    """(backward(residuals, cotangent) -> grads of primals, residuals, output) of ``forward``."""
    out, vjp_fn = jax.vjp(forward, *primals)
    residuals, treedef = jax.tree.flatten(vjp_fn)
    return (lambda residuals, cotangent: jax.tree.unflatten(treedef, residuals)(cotangent)), residuals, out


def _mlp_stack(weights, x, remat: bool = False):
    """x [batch, embed] through LAYERS scanned layers tanh(h @ up) @ down (``models.common.matmul``:
    its custom VJP in bf16); weights: up [layers, embed, hidden], down [layers, hidden, embed]."""
    def layer(h, layer_weights):
        up, down = layer_weights
        return matmul("bh,he->be", jnp.tanh(matmul("be,eh->bh", h, up)), down), None

    return jax.lax.scan(jax.checkpoint(layer) if remat else layer, x, weights)[0]


def _normal(seed: int, shape: tuple[int, ...], dtype=jnp.float32, scale: float = 1.0) -> jax.Array:
    """Gaussian test values from numpy (jax.random compiles per shape: seconds on 2 cores)."""
    return jnp.asarray(scale * np.random.default_rng(seed).standard_normal(shape), dtype)


def _mlp_backward(dtype, remat=False):
    weights = (_normal(0, (LAYERS, EMBED, HIDDEN), dtype), _normal(1, (LAYERS, HIDDEN, EMBED), dtype, 0.25))
    backward, residuals, y = _vjp_backward(lambda w, x: _mlp_stack(w, x, remat), weights,
                                           _normal(2, (BATCH, EMBED), dtype))
    return backward, residuals, _normal(3, y.shape, dtype)


# One dW = a^T g per weight and layer, each 2 * BATCH * EMBED * HIDDEN.
MLP_WEIGHT_GRAD_FLOPS = LAYERS * 2 * 2 * BATCH * EMBED * HIDDEN


def _equations(fn, *args) -> list[core.JaxprEqn]:
    """Every equation in the jaxpr of ``fn(*args)``, those of sub-jaxprs included."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            found.append(eqn)
            for sub in core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def _dot_shapes(fn, *args) -> list[tuple[int, ...]]:
    """The output shape of every dot_general in ``fn(*args)``."""
    return [e.outvars[0].aval.shape for e in _equations(fn, *args) if e.primitive.name == "dot_general"]


def _primitive_names(fn, *args) -> set[str]:
    return {e.primitive.name for e in _equations(fn, *args)}


def _assert_trees_close(actual, expected, atol: float):
    """Same structure, shapes and dtypes; values within ``atol`` x the largest |value| of each leaf."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        assert a.shape == e.shape and a.dtype == e.dtype
        e = np.asarray(e, np.float32)
        np.testing.assert_allclose(np.asarray(a, np.float32), e, atol=atol * np.abs(e).max(), rtol=0)


def _flops(split, backward, residuals, cotangent) -> tuple[float, float, float]:
    """Matmul FLOPs of (backward, its input part, its weight part)."""
    return (count_flops(backward, residuals, cotangent).flops,
            count_flops(split.input_grad, residuals, cotangent).flops,
            count_flops(split.weight_grad, residuals, split.cut_shapes).flops)


# bf16 goes through matmul's custom VJP. Its tolerance is a few bf16 ulps of each gradient's
# largest entry: the parts hand bf16 values over in the cut where XLA may keep the backward's
# fused elementwise chain in fp32 (measured: up to 0.0052 of the largest entry, 1/3 of 2^-6).
@pytest.mark.parametrize("dtype, atol", [(jnp.float32, 1e-6), (jnp.bfloat16, 2 ** -6)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("remat", [False, True], ids=["plain", "checkpoint"])
def test_scanned_mlp_parts_give_the_backward_and_defer_every_weight_matmul(dtype, atol, remat):
    backward, residuals, cotangent = _mlp_backward(dtype, remat)
    split = split_backward(backward, residuals, cotangent)
    d_inputs, cut = split.input_grad(residuals, cotangent)
    assert [(c.shape, c.dtype) for c in cut] == [(s.shape, s.dtype) for s in split.cut_shapes]
    _assert_trees_close((split.weight_grad(residuals, cut), d_inputs), backward(residuals, cotangent), atol)

    total, input_flops, weight_flops = _flops(split, backward, residuals, cotangent)
    assert input_flops + weight_flops == total
    assert weight_flops == MLP_WEIGHT_GRAD_FLOPS
    # The dx matmuls, as many as the dW ones, and the recomputed up projections under checkpoint.
    assert input_flops == MLP_WEIGHT_GRAD_FLOPS + (LAYERS * 2 * BATCH * EMBED * HIDDEN if remat else 0)
    weight_shapes = {(EMBED, HIDDEN), (HIDDEN, EMBED)}
    assert not weight_shapes & set(_dot_shapes(split.input_grad, residuals, cotangent))
    assert set(_dot_shapes(split.weight_grad, residuals, cut)) == weight_shapes
    if remat:  # jax.checkpoint's prevent_cse barrier is kept on each part's inputs
        assert "optimization_barrier" in _primitive_names(split.input_grad, residuals, cotangent)
        assert "optimization_barrier" in _primitive_names(split.weight_grad, residuals, cut)


def test_weight_shared_across_a_scan_accumulates_its_gradient_in_the_weight_part():
    """A loop-invariant weight: the transposed scan carries its gradient, a carry the weight part
    takes over (zeros initialised there); the input part carries only dx."""
    w, x = _normal(0, (EMBED, EMBED), scale=1 / 3), _normal(1, (BATCH, EMBED))
    backward, residuals, y = _vjp_backward(
        lambda w, x: jax.lax.scan(lambda h, _: (jnp.tanh(h @ w), None), x, None, length=LAYERS)[0], w, x)
    split = split_backward(backward, residuals, y)
    d_x, cut = split.input_grad(residuals, y)
    _assert_trees_close((split.weight_grad(residuals, cut), d_x), backward(residuals, y), 1e-6)
    total, input_flops, weight_flops = _flops(split, backward, residuals, y)
    assert (input_flops, weight_flops) == (total / 2, LAYERS * 2 * BATCH * EMBED * EMBED)


def test_backward_inside_jit_is_split_and_the_cotangent_is_cut():
    """One matmul y = x @ w behind a ``jit`` with explicit output shardings: dW = x^T g needs the
    cotangent, which the weight part gets through the cut; the shardings stay as constraints."""
    replicated = NamedSharding(jax.make_mesh((1,), ("x",)), PartitionSpec())
    w, x = _normal(0, (EMBED, HIDDEN)), _normal(1, (BATCH, EMBED))
    backward, residuals, y = _vjp_backward(lambda w, x: x @ w, w, x)
    jitted = jax.jit(backward, out_shardings=replicated)
    split = split_backward(jitted, residuals, y)
    assert [(s.shape, s.dtype) for s in split.cut_shapes] == [(y.shape, y.dtype)]
    d_x, cut = split.input_grad(residuals, y)
    _assert_trees_close((split.weight_grad(residuals, cut), d_x), backward(residuals, y), 1e-6)
    total, input_flops, weight_flops = _flops(split, jitted, residuals, y)
    assert (input_flops, weight_flops) == (total / 2, 2 * BATCH * EMBED * HIDDEN)
    assert "sharding_constraint" in _primitive_names(split.input_grad, residuals, y)
    assert "sharding_constraint" in _primitive_names(split.weight_grad, residuals, cut)


def test_backward_inside_shard_map_splits_around_its_collectives():
    """A data-parallel stage traced inside ``shard_map``: the psum of dW (a collective, whose named
    axis jax marks as an effect) lands in the weight part; the values match the backward's."""
    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    specs = (PartitionSpec(), PartitionSpec("data"))
    collectives = {}

    def per_device(w, x, cotangent):
        backward, residuals, _ = _vjp_backward(lambda w, x: x @ w, w, x)

        def reduced(residuals, cotangent):
            d_w, d_x = backward(residuals, cotangent)
            return jax.lax.psum(d_w, "data"), d_x

        split = split_backward(reduced, residuals, cotangent)
        d_x, cut = split.input_grad(residuals, cotangent)
        for part, args in (("input", (residuals, cotangent)), ("weight", (residuals, cut))):
            names = _primitive_names(getattr(split, f"{part}_grad"), *args)
            collectives[part] = {name for name in names if name.startswith("psum")}
        return (split.weight_grad(residuals, cut), d_x), reduced(residuals, cotangent)

    parts, expected = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(specs[0], specs[1], specs[1]),
                                            out_specs=(specs, specs)))(
        _normal(0, (EMBED, HIDDEN)), _normal(1, (BATCH, EMBED)), _normal(2, (BATCH, HIDDEN)))
    _assert_trees_close(parts, expected, 1e-6)
    assert not collectives["input"] and collectives["weight"]


def test_side_effects_are_refused_by_name():
    def backward(residuals, cotangent):
        jax.debug.callback(lambda c: None, cotangent)
        return residuals * cotangent, cotangent

    with pytest.raises(UnsupportedBackward, match="debug_callback"):
        split_backward(backward, jnp.ones(3), jnp.ones(3))


# FLOPs of the test model's 2-layer stage backward on [2, 8, 40] (backward = input + weight part):
#   none: 1,941,504 = 1,019,904 + 921,600
#   full: 2,727,936 = 1,806,336 + 921,600 (the recomputed forward feeds dx: input part)
#   dots: 1,990,656 = 1,044,480 + 946,176 (the recomputed attention output feeds only the output
#         projection's dW: weight part, + 2 * 2 * 8 * 8 * 8 * 6 per layer)
# 921,600 = 2 x tokens x per-layer matmul weights x layers: every dW matmul, none of them in the
# input part.
STAGE = dataclasses.replace(MODEL, seq_len=8)
STAGE_BATCH = 2


@pytest.fixture(scope="module")
def stage_params():
    """The stage's parameters (built once: remat changes the graph, not the parameters)."""
    return nnx.split(FAMILY.build(STAGE, seed=0))[1]


@pytest.mark.parametrize("remat", [RematPolicy.NONE, RematPolicy.FULL, RematPolicy.DOTS], ids=lambda r: r.value)
def test_llama_stage_parts_under_jit_match_the_backward_and_defer_the_weight_matmuls(stage_params, remat):
    cfg = dataclasses.replace(STAGE, remat=remat)
    graphdef = nnx.split(nnx.eval_shape(lambda: FAMILY.build(cfg, seed=0)))[0]

    def stage(params, x):
        return nnx.merge(graphdef, params).run_layers(x)[0]

    x = _normal(0, (STAGE_BATCH, cfg.seq_len, cfg.embed_dim))
    cotangent = _normal(1, x.shape)
    # Traced under a mesh as a pipeline stage is: its equations carry the mesh's shardings.
    with jax.set_mesh(jax.make_mesh((1, 1, 1, 1), ("data", "fsdp", "tensor", "stage"),
                                    axis_types=(jax.sharding.AxisType.Auto,) * 4)):
        vjp_fn = jax.jit(lambda params, x: jax.vjp(stage, params, x)[1])(stage_params, x)
        residuals, treedef = jax.tree.flatten(vjp_fn)

        def backward(residuals, cotangent):
            return jax.tree.unflatten(treedef, residuals)(cotangent)

        split = split_backward(backward, residuals, cotangent)
        d_x, cut = jax.jit(split.input_grad)(residuals, cotangent)
        d_params = jax.jit(split.weight_grad)(residuals, cut)
        _assert_trees_close((d_params, d_x), jax.jit(backward)(residuals, cotangent), 1e-6)
        total, input_flops, weight_flops = _flops(split, backward, residuals, cotangent)

    tokens = STAGE_BATCH * cfg.seq_len
    weight_matmuls = 2 * tokens * (cfg.layer_params - 2 * cfg.embed_dim) * cfg.num_layers
    assert input_flops + weight_flops == total
    # Under DOTS the attention output is recomputed (its matmuls have batch dimensions): the
    # blockwise kernel's forward, whose log-sum-exp its backward needs too, so it runs with the
    # input gradient and the weight pass stays the weight matmuls alone.
    assert weight_flops == weight_matmuls
    assert input_flops <= total - weight_matmuls

"""The experts every mixture-of-experts family shares (``models/moe``'s Mixtral and Qwen3-MoE,
``models/deepseek``'s DeepSeek-V3): the router, the dispatch modes, ``SparseMoE`` and ``MoELayer``, and
their memory and exchange terms for the planner. A config with the experts' fields (``MoEConfig``,
``DeepSeekConfig``) drives them.

Routing (``route``): fp32 logits, scored by a softmax over all experts (or each expert's sigmoid,
DeepSeek-V3's, ``router_score``), the ``top_k`` best scores as gate weights, renormalised to sum
to 1 when ``norm_topk_prob`` (Mixtral always; Qwen3-MoE by its config). With ``bias_update_rate``
> 0 the choice (not the weights) adds a per-expert bias to the scores, which the optimizer moves by
that rate each step towards the mean load: down for an expert chosen more than the mean, up for
one chosen less (auxiliary-loss-free balancing).

Dispatch (GShard): the tokens of each row are cut into groups of ``group_size`` positions (0: the
whole row), so what a token meets depends on the data, never on the mesh. In each group expert
``e`` has ``C`` slots; a token's choices are served first by rank (every token's first choice
before any second choice), then by position, and a choice that finds its expert full is dropped
(its weight is lost; the residual stream carries the token on). ``C = ceil(capacity_factor *
group_size * top_k / num_experts)`` in ``capacity`` mode, and ``C = group_size`` in ``dropless``
mode, where no choice can be dropped because a token picks an expert at most once. The slots are
one-hot dispatch and combine tensors [batch, groups, group, experts, C]; the experts' inputs
[experts, batch, groups, C, embed] are laid out batch-split first and then experts-split, which
XLA turns into an all-to-all when the rules split ``experts`` over the batch's mesh axes (expert
parallelism), and back after the experts.

Auxiliary losses, per group and layer (the framework averages over rows; see ``run_layers``):
the Switch load-balancing loss ``E * sum_e f_e * P_e`` (``f_e``: the fraction of the group's
token choices routed to expert e, before capacity; ``P_e``: the mean router probability of e), as
transformers' ``load_balancing_loss_func`` computes it over its tokens; and the router z-loss
``mean(logsumexp(logits)^2)``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from models.api import AUX_LOSS, RESIDUAL_AXES, AxisRole, Documents, LayerAux
from models.blocks import (BLOCK_CHECKPOINT_NAMES, BlockCosts, Decoder, DecoderConfig, PreNormLayer, QKNormAttention,
                           RMSNorm, SwiGLU, normal)
from models.common import (CHECKPOINT_DOT, ActivationSharding, InvalidField, check_finite, check_positive,
                           logical_param, matmul, sign_descent_variable, unconstrained)
from models.kernels.fp8 import Fp8Weight, MatmulGroup
from models.kernels.grouped_matmul import (BlockSlots, GroupedKernel, GroupedSpec, auto_block, grouped_product,
                                           ragged_matmul, tokamax_matmul)

CHECKPOINT_NAMES = BLOCK_CHECKPOINT_NAMES + ("expert_hidden",)
# Expert inputs and outputs: experts, batch rows (over the batch's axes the experts leave free),
# groups of a row, slots, hidden.
EXPERT_AXES = ("experts", "expert_rows", None, None, "expert_embed")
ROW_AXES = (None, "batch", None, None, "expert_embed")


class Dispatch(str, enum.Enum):
    """How tokens reach their experts (see the module docstring).

    DROPLESS: each token's choices sorted by expert, each expert's SwiGLU run over exactly its rows
    by grouped matmuls (``jax.lax.ragged_dot``): the active experts' FLOPs, nothing dropped.
    ONEHOT: one-hot dispatch with ``group_size`` slots per expert: nothing dropped, at the cost of
    ``num_experts / top_k`` times the experts' active FLOPs (every slot is computed, filled or not).
    CAPACITY: one-hot with ``ceil(capacity_factor * group_size * top_k / num_experts)`` slots; the
    rest are dropped (GShard).
    """

    DROPLESS = "dropless"
    ONEHOT = "onehot"
    CAPACITY = "capacity"


class RouterScore(str, enum.Enum):
    """How router logits become expert scores. SOFTMAX: over all experts (Mixtral, Qwen3-MoE).
    SIGMOID: each expert's own (DeepSeek-V3), the chosen ones' renormalised to sum to 1 as gate
    weights, and the whole row's for the load-balancing loss."""

    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"

@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpertsConfig(DecoderConfig):
    """``DecoderConfig`` and the experts' fields (routing, dispatch, kernel, auxiliary losses) with
    their checks; a family deriving from it gives ``shared_mlp_dim`` too (a field, or a property:
    the shared experts' hidden units, 0 for none)."""

    checkpoint_names: ClassVar[tuple[str, ...]] = CHECKPOINT_NAMES

    num_experts: int = 8
    top_k: int = 2
    expert_mlp_dim: int = 32
    norm_topk_prob: bool = True
    router_score: RouterScore = RouterScore.SOFTMAX
    # Group-limited routing (DeepSeek-V3): a token's experts come from its ``groups_per_token`` best
    # of ``expert_groups`` equal groups (a group scored by its two best scores); 1, 1: no limit.
    expert_groups: int = 1
    groups_per_token: int = 1
    routed_scaling_factor: float = 1.0  # multiplies the gate weights
    # Auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias on the scores for the top-k
    # choice only, moved by this much per step against each expert's load above the mean (0: none).
    bias_update_rate: float = 0.0
    dispatch: Dispatch = Dispatch.DROPLESS
    capacity_factor: float = 1.25
    # Expert parallelism under DROPLESS: rows per peer buffer, as a multiple of an even share
    # (a device's token choices / the number of expert ranks); 0: the worst case, never dropping.
    exchange_buffer_factor: float = 0.0
    grouped_matmul: GroupedKernel = GroupedKernel.AUTO  # DROPLESS's kernel (models/kernels/grouped_matmul.py)
    expert_block: int = 0  # rows per block of the blocked kernel (0: auto_block)
    group_size: int = 0  # positions per routing group (0: the whole row)
    load_balancing_coef: float = 0.01
    z_loss_coef: float = 0.0
    remat_names: tuple[str, ...] = ("attention", "mlp_hidden", "expert_hidden")

    def __post_init__(self):
        super().__post_init__()
        check_positive(self, "num_experts", "expert_mlp_dim")
        if not 1 <= self.top_k <= self.num_experts:
            raise InvalidField("top_k", f"must be between 1 and num_experts={self.num_experts}, got {self.top_k}")
        _check_routing_groups(self)
        check_finite(self, "capacity_factor", positive=True)
        if not (self.bias_update_rate >= 0 and math.isfinite(self.bias_update_rate)):
            raise InvalidField("bias_update_rate", f"must be a finite number >= 0 (0: no routing bias), "
                               f"got {self.bias_update_rate}")
        if self.expert_block < 0:
            raise InvalidField("expert_block", f"must be >= 0 (0: chosen from the rows), got {self.expert_block}")
        if not (self.exchange_buffer_factor >= 0 and math.isfinite(self.exchange_buffer_factor)):
            raise InvalidField("exchange_buffer_factor", "must be a finite number >= 0 (0: buffers for the worst "
                               f"case, nothing dropped), got {self.exchange_buffer_factor}")
        if self.group_size < 0 or (self.group_size and self.seq_len % self.group_size):
            raise InvalidField("group_size", f"must divide seq_len={self.seq_len} (0: one group per row), "
                               f"got {self.group_size}")
        check_finite(self, "load_balancing_coef", "z_loss_coef", positive=False)

    @property
    def grouped_spec(self) -> GroupedSpec:
        """The grouped-matmul kernel and block of the sorted dispatch (``model.grouped_matmul``)."""
        return GroupedSpec(self.grouped_matmul, self.expert_block)

    @property
    def sorted_dispatch(self) -> bool:
        return self.dispatch is Dispatch.DROPLESS

    def slots(self, group: int) -> int:
        """Slots per expert of the one-hot dispatches in a routing group of ``group`` positions (at
        most ``group``)."""
        if self.dispatch is not Dispatch.CAPACITY:
            return group
        return min(group, math.ceil(self.capacity_factor * group * self.top_k / self.num_experts))


@dataclasses.dataclass(frozen=True)
class ExpertCosts(BlockCosts):
    """The costs of a family whose layers hold routed experts (``ExpertsConfig``): the exchange."""

    def exchange_bytes(self, experts: int, compute_bytes: int) -> float:
        """Bytes per token and layer one exchange sends from a device under expert parallelism of
        ``experts``, on the GPUs the planner's roofline models: the sorted dispatch's ``top_k`` rows
        (the ragged exchange sends each peer exactly its rows; XLA:CPU's fixed buffers send
        ``buffer_factor`` or ``EP`` times that), the one-hot dispatches' ``E * C / group`` expert
        slots, of embed wide each."""
        cfg = self.cfg
        if experts == 1:
            return 0.0
        if cfg.dispatch is Dispatch.DROPLESS:
            rows = cfg.top_k
        else:
            group = cfg.group_size or cfg.seq_len
            rows = cfg.num_experts * cfg.slots(group) / group
        return rows * cfg.embed_dim * compute_bytes


def expert_terms(cfg, tensor: int, experts: int, compute_bytes: int) -> tuple[float, float, float, float]:
    """The experts' (kept under ``none``, kept under ``dots``, held by one layer's backward) vectors
    per token and the router's fp32 bytes per token, for ``cfg``'s dispatch (``_sorted_terms`` or
    ``_one_hot_terms``); ``cfg`` any config with the MoE fields (this family's, DeepSeek-V3's)."""
    if cfg.dispatch is Dispatch.DROPLESS:
        return _sorted_terms(cfg, tensor, experts, wide=max(1.0, 4 / compute_bytes))
    return _one_hot_terms(cfg, tensor)


def _one_hot_terms(cfg: ExpertsConfig, tensor: int) -> tuple[float, float, float, float]:
    """The one-hot dispatches' (kept under ``none``, kept under ``dots``, held by one layer's
    backward) vectors per token, and the router's fp32 bytes per token. Units: ``E * C`` (one row of
    the one-hot dispatch or combine tensor [batch, groups, group, experts, C], compute dtype);
    ``X * d`` and ``X * f``, with ``X = E * C / group`` expert slots per token: the token's share of
    an expert buffer [experts, batch, groups, C, embed] (the same in the batch-split and the
    expert-split layout) or of a hidden buffer of width ``f = expert_mlp / tensor``; ``(top_k + 3) *
    E`` fp32 router values (logits, probabilities, top-k one-hots, gate weights, arrival order). How
    many of each XLA keeps was fitted (least squares on 12 shapes, then rounded) to XLA:CPU's temp
    bytes of the fp32 train step on mesh (1, 8, 1, 1) (docs/memory.md): ``none`` keeps 2 E*C, 2 X*d
    and 4.5 X*f; ``dots`` keeps 1 X*f (the expert einsums have a batch axis, ``experts``, so the
    policy saves none of their outputs); one layer's backward holds 1.5 E*C, 3 X*d and 9.5 X*f."""
    group = cfg.group_size or cfg.seq_len
    per_token = cfg.num_experts * cfg.slots(group)  # E * C: one token's row of dispatch / combine
    slot_d = per_token / group * cfg.embed_dim  # X * d
    slot_f = per_token / group * cfg.expert_mlp_dim / tensor  # X * f
    return (2 * per_token + 2 * slot_d + 4.5 * slot_f, slot_f, 1.5 * per_token + 3 * slot_d + 9.5 * slot_f,
            (cfg.top_k + 3) * cfg.num_experts * 4)


# Rows a grouped matmul's blocks hold per row routed to it: each expert's rows padded to whole blocks
# adds at most 1/8 with ``auto_block``'s block size (models/kernels/grouped_matmul.py).
BLOCK_PADDING = 9 / 8


def _sorted_terms(cfg: ExpertsConfig, tensor: int, experts: int, wide: float = 1.0
                  ) -> tuple[float, float, float, float]:
    """As ``_one_hot_terms``, for the sorted dispatch. Units: ``k*d`` (the token's ``top_k`` choice
    rows, and their outputs), ``R*d`` with ``R = top_k * X`` rows on the experts' side (``X`` the
    exchange's buffers per even share: 1 without expert parallelism, ``experts``, the EP size, with
    the worst-case buffers, ``exchange_buffer_factor`` otherwise; the exchange's buffers and the
    experts' padded blocks) and ``R*f`` (the experts' hidden units); ``(top_k + 2) * E`` fp32 router
    values. ``none`` keeps 3 k*d, 3.5 R*d and 3 R*f; ``dots`` the three grouped matmuls' outputs as
    the blocked kernel stacks them, ``[blocks, block, width]`` in fp32 (down's R*d, gate's and up's
    R*f each), padded to whole blocks (``BLOCK_PADDING``; XLA:CPU's stash of DeepSeek-V3's 8-layer
    dots step at EP 8: 1.12 R*d and 2.24 R*f); one layer's backward holds 3 k*d, 10 R*d (the buffers
    and their gradients) and 5 R*f. Counted from the buffers ``grouped_swiglu`` and
    ``meshtrain/parallel/experts.py`` make, the R*d counts then set against XLA:CPU's temp bytes of
    configs/moe_tiny.yaml's step (9 layouts; docs/memory.md has the errors). ``wide``: how many
    compute-dtype vectors one held row buffer takes: XLA:CPU scatters and gathers the rows of a bf16
    step as 4-byte words (Qwen3-30B-A3B's 8 layers at EP 8: ``4 / c``)."""
    rows = cfg.top_k * (1 if experts == 1 else (cfg.exchange_buffer_factor or experts))
    choice_d, rows_d, rows_f = cfg.top_k * cfg.embed_dim, rows * cfg.embed_dim, rows * cfg.expert_mlp_dim / tensor
    return (3 * choice_d + 3.5 * rows_d + 3 * rows_f, BLOCK_PADDING * (rows_d + 2 * rows_f),
            3 * choice_d + wide * 10 * rows_d + 5 * rows_f, (cfg.top_k + 2) * cfg.num_experts * 4)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Routing:
    """One group's routing decisions.

    logits: fp32 router logits [batch, groups, group, experts]. probs: their softmax. experts: int
    [batch, groups, group, top_k], the chosen experts, most probable first. weights: [batch,
    groups, group, top_k], their gate weights.
    """

    logits: jax.Array
    probs: jax.Array
    experts: jax.Array
    weights: jax.Array

    @property
    def chosen(self) -> jax.Array:
        """[batch, groups, group, experts]: 1 where the expert is among the token's choices."""
        return jnp.sum(jax.nn.one_hot(self.experts, self.probs.shape[-1], dtype=jnp.float32), axis=3)

    def slots(self) -> tuple[jax.Array, jax.Array]:
        """(the gate weight of each expert, 0 where not chosen; the 0-based arrival order of the choice
        at its expert, meaningful where chosen), each [batch, groups, group, experts]: all first
        choices of the group in position order, then all second choices, and so on (GShard)."""
        top_k, group = self.experts.shape[-1], self.experts.shape[-2]
        choice = jax.nn.one_hot(self.experts, self.probs.shape[-1], dtype=jnp.float32)  # [b, n, s, k, E]
        by_rank = jnp.swapaxes(choice, 2, 3).reshape(*choice.shape[:2], top_k * group, -1)
        arrival = (jnp.cumsum(by_rank, axis=2) - 1).reshape(*choice.shape[:2], top_k, group, -1)
        slot = jnp.sum(jnp.swapaxes(arrival, 2, 3) * choice, axis=3)  # a token picks an expert at most once
        return jnp.sum(choice * self.weights[..., None], axis=3), slot


def _check_routing_groups(cfg: ExpertsConfig) -> None:
    """``InvalidField`` for group-limited routing fields (``expert_groups``, ``groups_per_token``,
    ``routed_scaling_factor``) that cannot route ``cfg.top_k`` of ``cfg.num_experts`` experts."""
    if cfg.expert_groups < 1 or cfg.num_experts % cfg.expert_groups:
        raise InvalidField("expert_groups", f"must divide num_experts={cfg.num_experts}, got {cfg.expert_groups}")
    if cfg.expert_groups > 1 and cfg.num_experts // cfg.expert_groups < 2:
        raise InvalidField("expert_groups", f"leaves {cfg.num_experts // cfg.expert_groups} expert per group; a "
                           "group is scored by its two best experts (at least 2 per group, or 1 group)")
    if not 1 <= cfg.groups_per_token <= cfg.expert_groups:
        raise InvalidField("groups_per_token", f"must be between 1 and expert_groups={cfg.expert_groups}, "
                           f"got {cfg.groups_per_token}")
    reachable = cfg.groups_per_token * cfg.num_experts // cfg.expert_groups
    if cfg.top_k > reachable:
        raise InvalidField("top_k", f"must be at most the {reachable} experts of groups_per_token="
                           f"{cfg.groups_per_token} groups, got {cfg.top_k}")
    if not (cfg.routed_scaling_factor > 0 and math.isfinite(cfg.routed_scaling_factor)):
        raise InvalidField("routed_scaling_factor", f"must be a finite number > 0, got {cfg.routed_scaling_factor}")


def route(logits: jax.Array, top_k: int, norm_topk_prob: bool, score: RouterScore = RouterScore.SOFTMAX,
          bias: jax.Array | None = None, expert_groups: int = 1, groups_per_token: int = 1,
          scaling: float = 1.0) -> Routing:
    """Top-k routing of fp32 ``logits`` [batch, groups, group, experts] (see ``Routing``): the
    experts chosen by their scores plus ``bias`` [experts] (no gradient through it) among the
    ``groups_per_token`` best of ``expert_groups`` consecutive groups of experts (a group scored by
    the sum of its two best biased scores), their gate weights the scores alone, renormalised to sum
    to 1 when ``norm_topk_prob``, times ``scaling``."""
    scores = jax.nn.softmax(logits, axis=-1) if score is RouterScore.SOFTMAX else jax.nn.sigmoid(logits)
    selection = scores if bias is None else scores + jax.lax.stop_gradient(bias).astype(scores.dtype)
    if expert_groups > 1:
        grouped = selection.reshape(*selection.shape[:-1], expert_groups, -1)
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [b, n, s, groups]
        best_groups = jax.lax.top_k(group_scores, groups_per_token)[1]
        kept = jnp.sum(jax.nn.one_hot(best_groups, expert_groups, dtype=jnp.bool_), axis=-2, dtype=jnp.bool_)
        selection = jnp.where(kept[..., None], grouped, -jnp.inf).reshape(selection.shape)
    top_experts = jax.lax.top_k(selection, top_k)[1]  # [b, n, s, k]
    top_scores = jnp.take_along_axis(scores, top_experts, axis=-1)
    if norm_topk_prob:
        top_scores = top_scores / jnp.sum(top_scores, axis=-1, keepdims=True)
    top_scores = top_scores * scaling
    probs = scores if score is RouterScore.SOFTMAX else scores / jnp.sum(scores, axis=-1, keepdims=True)
    return Routing(logits=logits, probs=probs, experts=top_experts, weights=top_scores)


def load_balancing_loss(routing: Routing) -> jax.Array:
    """[batch, groups]: the Switch loss of each group, ``E * sum_e f_e * P_e`` (``f_e``: the group's
    token choices routed to e per token, summing to top_k; ``P_e``: e's mean router probability)."""
    num_experts = routing.probs.shape[-1]
    return num_experts * jnp.sum(jnp.mean(routing.chosen, axis=2) * jnp.mean(routing.probs, axis=2), axis=-1)


def router_z_loss(routing: Routing) -> jax.Array:
    """[batch, groups]: the mean over the group's tokens of ``logsumexp(logits)^2`` (ST-MoE)."""
    return jnp.mean(jax.nn.logsumexp(routing.logits, axis=-1) ** 2, axis=2)


def grouped_swiglu(rows: jax.Array, ids: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, *,
                   spec: GroupedSpec) -> jax.Array:
    """The SwiGLU experts over exactly their rows (``models.common.ExpertCompute``): rows [m, embed],
    int ``ids`` [m] (an id >= the experts held: no expert, a zero result), gate, up [experts, embed,
    mlp], down [experts, mlp, embed] -> [m, embed], by ``spec``'s grouped-matmul kernel, resolved for
    the devices (``GroupedSpec.resolved``; ``models/kernels/grouped_matmul.py``: ``2 * m * embed * mlp`` FLOPs
    per matmul, plus the blocked kernel's padding, for any number of experts). Each matmul's result
    is tagged ``CHECKPOINT_DOT``
    (no batch dimension: ``RematPolicy.DOTS`` keeps it as a plain matmul's). ``ragged`` and ``tokamax``
    run over the rows sorted by expert. FP8 weights (``models.kernels.fp8.Fp8Weight``) always run the
    blocked kernel (``fp8_blocked_matmul``)."""
    tagged = lambda y: checkpoint_name(y, CHECKPOINT_DOT)
    fp8 = isinstance(gate, Fp8Weight)
    if spec.kernel is GroupedKernel.AUTO:
        raise ValueError("grouped_swiglu needs a resolved kernel: GroupedSpec.resolved(platform) first")
    if not fp8 and spec.kernel in (GroupedKernel.RAGGED, GroupedKernel.TOKAMAX):
        product = ragged_matmul if spec.kernel is GroupedKernel.RAGGED else tokamax_matmul
        order = jnp.argsort(ids, stable=True)
        sizes = jnp.bincount(ids, length=gate.shape[0]).astype(jnp.int32)  # ids past the experts: not counted
        ordered = rows[order]
        hidden = (jax.nn.silu(tagged(product(ordered, gate, sizes)))
                  * tagged(product(ordered, up, sizes)))
        out = tagged(product(checkpoint_name(hidden, "expert_hidden"), down, sizes))
        return jnp.zeros_like(out).at[order].set(out, unique_indices=True)
    groups = (gate.weight if fp8 else gate).shape[0]
    slots = BlockSlots.of(ids, groups, spec.block or auto_block(ids.shape[0], groups))
    x = slots.gather(rows)
    hidden = (jax.nn.silu(tagged(grouped_product(x, gate, slots.block_group)))
              * tagged(grouped_product(x, up, slots.block_group)))
    return slots.scatter(tagged(grouped_product(checkpoint_name(hidden, "expert_hidden"), down,
                                                slots.block_group)))


EXPERT_PARAM_AXES = (("experts", "expert_embed", "expert_mlp"),) * 2 + (("experts", "expert_mlp", "expert_embed"),)


class SparseMoE(nnx.Module):
    """Router + ``num_experts`` SwiGLU experts, dispatched as ``cfg.dispatch`` says (module docstring)."""

    def __init__(self, cfg: ExpertsConfig, rngs: nnx.Rngs):
        d, e, f = cfg.embed_dim, cfg.num_experts, cfg.expert_mlp_dim
        self.cfg = cfg
        self.router = logical_param(normal(rngs, (d, e), d ** -0.5), ("embed", "expert_logits"))
        # One-hot dispatch multiplies the experts through ``matmul``, the sorted one through the
        # blocked kernel: FP8 either way when the framework asks.
        group = MatmulGroup.EXPERTS
        self.gate = logical_param(normal(rngs, (e, d, f), d ** -0.5), EXPERT_PARAM_AXES[0], group)
        self.up = logical_param(normal(rngs, (e, d, f), d ** -0.5), EXPERT_PARAM_AXES[1], group)
        self.down = logical_param(normal(rngs, (e, f, d), f ** -0.5 / math.sqrt(2 * cfg.num_layers)),
                                  EXPERT_PARAM_AXES[2], group)
        self.routing_bias = (sign_descent_variable(jnp.zeros((e,), jnp.float32), ("expert_logits",),
                                                   cfg.bias_update_rate) if cfg.bias_update_rate > 0 else None)

    def __call__(self, x: jax.Array, shard: ActivationSharding, dropless: bool = False
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """x: [batch, length, embed] -> (y [batch, length, embed], this layer's statistics, each
        summed over the rows: ``load_balancing`` and ``z_loss`` (per-group losses averaged over
        the row's groups), ``expert_load`` [experts] (the fraction of the row's token choices each
        expert was picked for), ``dropped`` (the fraction of them dropped for capacity) and
        ``overflow`` (the fraction dropped by a full expert-exchange buffer)). ``dropless``
        (generation) routes the call's tokens as one group and drops nothing, which gives what any
        dropless grouping gives."""
        cfg = self.cfg
        rows, length, width = x.shape
        group = length if dropless else cfg.group_size or length
        grouped = x.reshape(rows, length // group, group, width)
        logits = jnp.einsum("bnsd,de->bnse", grouped.astype(jnp.float32), self.router[...].astype(jnp.float32))
        bias = None if self.routing_bias is None else self.routing_bias[...]
        routing = route(shard(logits, ("batch", None, None, "expert_logits")), cfg.top_k, cfg.norm_topk_prob,
                        cfg.router_score, bias, cfg.expert_groups, cfg.groups_per_token, cfg.routed_scaling_factor)
        dropped = overflow = jnp.zeros((), jnp.float32)
        if cfg.dispatch is Dispatch.DROPLESS:
            y, overflow = self._sorted(x, routing, shard)
        else:
            y, dropped = self._one_hot(grouped, routing, shard, group if dropless else cfg.slots(group))
        choices = length * cfg.top_k
        stats = {"load_balancing": jnp.sum(jnp.mean(load_balancing_loss(routing), axis=1)),
                 "z_loss": jnp.sum(jnp.mean(router_z_loss(routing), axis=1)),
                 "expert_load": jnp.sum(routing.chosen, axis=(0, 1, 2)) / choices,
                 "dropped": dropped / choices, "overflow": overflow / choices,
                 "bias_direction": jnp.zeros((), jnp.float32)}
        if bias is not None:
            # Zero in value; its gradient, each expert's load above the mean summed over the rows, is
            # the direction the optimizer's sign descent moves the bias against (``SignDescent``).
            load = jnp.sum(routing.chosen, axis=(1, 2)) / choices  # [batch, experts]
            excess = jax.lax.stop_gradient(load - 1.0 / cfg.num_experts)
            stats["bias_direction"] = jnp.sum(excess * (bias - jax.lax.stop_gradient(bias)))
        return y.reshape(rows, length, width), stats

    def _sorted(self, x: jax.Array, routing: Routing, shard: ActivationSharding) -> tuple[jax.Array, jax.Array]:
        """DROPLESS: the framework takes each choice's row to its expert (``run_experts``), where
        ``grouped_swiglu`` runs; the outputs are summed with the gate weights."""
        rows, length, _ = x.shape
        choices = routing.experts.reshape(rows, length, self.cfg.top_k)
        params = (self.gate[...], self.up[...], self.down[...])
        compute = functools.partial(grouped_swiglu, spec=self.cfg.grouped_spec.resolved(shard.platform, x.dtype))
        out, dropped = shard.run_experts(compute, x, choices, params, EXPERT_PARAM_AXES,
                                         self.cfg.exchange_buffer_factor)
        weights = routing.weights.reshape(rows, length, self.cfg.top_k, 1).astype(x.dtype)
        return jnp.sum(out * weights, axis=2), dropped.astype(jnp.float32)

    def _one_hot(self, grouped: jax.Array, routing: Routing, shard: ActivationSharding, slots: int
                 ) -> tuple[jax.Array, jax.Array]:
        """ONEHOT and CAPACITY: ``slots`` per expert and group, one-hot dispatch and combine tensors
        [batch, groups, group, experts, slots]; the experts' buffers batch-split, then experts-split
        (the reshard between them is the all-to-all)."""
        weights, slot = routing.slots()
        chosen = routing.chosen
        kept = chosen * (slot < slots)
        dispatch = (jax.nn.one_hot(slot.astype(jnp.int32), slots, dtype=grouped.dtype)
                    * kept[..., None].astype(grouped.dtype))
        combine = dispatch * weights[..., None].astype(grouped.dtype)  # [b, n, s, E, C]
        expert_in = shard(matmul("bnsd,bnsec->ebncd", grouped, dispatch), ROW_AXES)
        expert_in = shard(expert_in, EXPERT_AXES)
        hidden = (jax.nn.silu(matmul("ebncd,edf->ebncf", expert_in, self.gate[...]))
                  * matmul("ebncd,edf->ebncf", expert_in, self.up[...]))
        hidden = checkpoint_name(shard(hidden, ("experts", "expert_rows", None, None, "expert_mlp")), "expert_hidden")
        expert_out = shard(matmul("ebncf,efd->ebncd", hidden, self.down[...]), EXPERT_AXES)
        expert_out = shard(expert_out, ROW_AXES)
        return matmul("ebncd,bnsec->bnsd", expert_out, combine), jnp.sum(chosen - kept)


class MoELayer(PreNormLayer):
    """Pre-norm residual layer: x + attention(norm(x)) (``attention_class``), then + (experts + shared
    experts)(norm(x))."""

    attention_class: type[nnx.Module] = QKNormAttention  # built as attention_class(cfg, rngs)

    def __init__(self, cfg: ExpertsConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps)
        self.attention = self.attention_class(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps)
        self.moe = SparseMoE(cfg, rngs)
        self.shared = SwiGLU(cfg, cfg.shared_mlp_dim, rngs) if cfg.shared_mlp_dim else None

    def feed_forward(self, x: jax.Array, shard: ActivationSharding, generating: bool = False
                     ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """-> (x + experts(mlp_norm(x)) + shared(mlp_norm(x)), the experts' statistics); generating
        (the KV-cache path) routes dropless (nothing dropped)."""
        normed = self.mlp_norm(x)
        y, stats = self.moe(normed, shard, generating)
        if self.shared is not None:
            y = y + self.shared(normed, shard)
        return shard(x + y, RESIDUAL_AXES), stats


class ExpertsDecoder(Decoder):
    """``blocks.Decoder`` over layers that hold ``SparseMoE``s (a family sets ``layer_class``): the
    experts' auxiliary terms out of ``run_layers``."""

    def run_layers(self, x: jax.Array, shard: ActivationSharding = unconstrained,
                   documents: Documents | None = None) -> tuple[jax.Array, LayerAux]:
        """The layers this module holds, scanned with the remat policy: [batch, length, embed] ->
        same, and the auxiliary terms summed over rows (``models.api.DecoderModel.run_layers``):
        ``loss`` = load_balancing_coef * (the layers' load-balancing losses, summed) + z_loss_coef
        * (their z-losses, summed); and, averaged over the model's layers (a module holding some of
        them gives their share), ``moe_load_balancing_loss``, ``moe_router_z_loss``,
        ``moe_expert_load`` [experts], ``moe_dropped_fraction`` and ``moe_exchange_overflow``."""
        cfg = self.cfg
        x, stats = self._scan_layers(x, shard, documents)
        # Divided by the model's layer count, not this module's: pipeline stages' shares add up.
        mean = lambda name: jnp.sum(stats[name], axis=0) / cfg.num_layers
        return x, {AUX_LOSS: cfg.load_balancing_coef * jnp.sum(stats["load_balancing"])
                   + cfg.z_loss_coef * jnp.sum(stats["z_loss"]) + jnp.sum(stats["bias_direction"]),
                   "moe_load_balancing_loss": mean("load_balancing"), "moe_router_z_loss": mean("z_loss"),
                   "moe_expert_load": mean("expert_load"), "moe_dropped_fraction": mean("dropped"),
                   "moe_exchange_overflow": mean("overflow")}


# How the experts' logical axes map to mesh axes (``models.api.AxisRole``): the experts split by
# expert parallelism, their hidden units by tensor parallelism, the router whole.
EXPERT_AXIS_ROLES = {"experts": AxisRole.EXPERT, "expert_embed": AxisRole.REPLICATED,
                     "expert_mlp": AxisRole.TENSOR, "expert_logits": AxisRole.REPLICATED,
                     "expert_rows": AxisRole.EXPERT_ROWS}
# What the framework says when the experts report it (``ModelFamily.alerts``).
EXPERT_ALERTS = {"moe_exchange_overflow": "token choices were dropped by a full expert-exchange buffer; raise "
                                          "model.exchange_buffer_factor (0: buffers for the worst case, never "
                                          "dropping)"}

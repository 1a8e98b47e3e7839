"""A mixture-of-experts decoder (Mixtral, Qwen3-MoE shapes) in Flax NNX, annotated with logical axes only.

Each layer is the shared pre-norm attention of ``models/blocks.py`` (optionally with Qwen3's
per-head RMSNorm of queries and keys) followed by a sparse feed-forward block: a router picks
``top_k`` of ``num_experts`` SwiGLU experts per token, and optional shared experts (a dense
``blocks.SwiGLU``) run on every token.

Parameters (logical axes in brackets, ``layers`` leading every per-layer parameter)::

    embedding                 [vocab, embed]
    layers.attn_norm.scale    [layers, embed]
    layers.attention.query/key/value/out   as Llama's (models/blocks.py: QKNormAttention)
    layers.attention.query_norm.scale, key_norm.scale   [layers, head_dim]   (qk_norm only)
    layers.mlp_norm.scale     [layers, embed]
    layers.moe.router         [layers, embed, expert_logits]               replicated, run in fp32
    layers.moe.routing_bias   [layers, expert_logits]   (bias_update_rate > 0 only; SignDescent, no gradient)
    layers.moe.gate, .up      [layers, experts, expert_embed, expert_mlp]  experts split by EP
    layers.moe.down           [layers, experts, expert_mlp, expert_embed]
    layers.shared.gate, .up   [layers, embed, mlp]    (shared_mlp_dim > 0 only)
    layers.shared.down        [layers, mlp, embed]
    final_norm.scale          [embed]
    head                      [embed, vocab]  (absent when tied)

Routing, dispatch and the auxiliary losses: ``models/experts.py`` (shared with DeepSeek-V3).
"""

from __future__ import annotations

import dataclasses
import math


from models.blocks import AttentionKernel, RopeScalingConfig, check_attention_fields
from models.common import (InvalidField, RematPolicy, coerce_enums)
from models.experts import (CHECKPOINT_NAMES, Dispatch, ExpertsDecoder, MoELayer, RouterScore, check_routing_groups)
from models.kernels.attention import AttentionSpec
from models.kernels.grouped_matmul import GroupedKernel, GroupedSpec


# Activations a NAMED remat policy may keep: the blocks', and the experts' hidden units.
@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Shape, routing and execution options of a mixture-of-experts decoder."""

    vocab_size: int = 96
    embed_dim: int = 40
    num_layers: int = 2
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 6
    num_experts: int = 8
    top_k: int = 2
    expert_mlp_dim: int = 32
    shared_mlp_dim: int = 0  # hidden size of the shared experts (0: none)
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
    qk_norm: bool = False
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
    seq_len: int = 32
    rope_theta: float = 10000.0
    rope_scaling: RopeScalingConfig = dataclasses.field(default_factory=RopeScalingConfig)
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    attention: AttentionKernel = AttentionKernel.AUTO
    attention_block: int = 512  # positions per query and key block of the blockwise kernel
    sliding_window: int = 0  # positions a query attends, itself included (Mistral); 0 = all earlier
    remat: RematPolicy = RematPolicy.NONE
    remat_names: tuple[str, ...] = ("attention", "mlp_hidden", "expert_hidden")

    def __post_init__(self):
        coerce_enums(self)
        for name in ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "num_experts", "expert_mlp_dim", "seq_len"):
            if getattr(self, name) <= 0:
                raise InvalidField(name, f"must be a positive integer, got {getattr(self, name)}")
        if not 1 <= self.top_k <= self.num_experts:
            raise InvalidField("top_k", f"must be between 1 and num_experts={self.num_experts}, got {self.top_k}")
        check_routing_groups(self)
        if self.shared_mlp_dim < 0:
            raise InvalidField("shared_mlp_dim", f"must be >= 0 (0: no shared experts), got {self.shared_mlp_dim}")
        if not (self.capacity_factor > 0 and math.isfinite(self.capacity_factor)):
            raise InvalidField("capacity_factor", f"must be a finite number > 0, got {self.capacity_factor}")
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
        for name in ("load_balancing_coef", "z_loss_coef"):
            if not (getattr(self, name) >= 0 and math.isfinite(getattr(self, name))):
                raise InvalidField(name, f"must be a finite number >= 0, got {getattr(self, name)}")
        check_attention_fields(self, CHECKPOINT_NAMES)

    @property
    def attention_spec(self) -> AttentionSpec:
        return AttentionSpec(self.attention, self.sliding_window, self.attention_block)

    @property
    def grouped_spec(self) -> GroupedSpec:
        return GroupedSpec(self.grouped_matmul, self.expert_block)

    @property
    def sorted_dispatch(self) -> bool:
        return self.dispatch is Dispatch.DROPLESS

    @property
    def attention_dim(self) -> int:
        return self.num_heads * self.head_dim

    def slots(self, group: int) -> int:
        """Slots per expert of the one-hot dispatches in a routing group of ``group`` positions (at
        most ``group``)."""
        if self.dispatch is not Dispatch.CAPACITY:
            return group
        return min(group, math.ceil(self.capacity_factor * group * self.top_k / self.num_experts))

    @property
    def attention_params(self) -> int:
        qkv = self.embed_dim * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        return qkv + self.attention_dim * self.embed_dim

    @property
    def expert_params(self) -> int:
        """Parameters of one expert of one layer."""
        return 3 * self.embed_dim * self.expert_mlp_dim

    def _layer_params(self, experts: int) -> int:
        norms = 2 * self.embed_dim + (2 * self.head_dim if self.qk_norm else 0)
        return (self.attention_params + self.embed_dim * self.num_experts + experts * self.expert_params
                + 3 * self.embed_dim * self.shared_mlp_dim + norms)

    @property
    def num_params(self) -> int:
        """All parameters (the embedding counted once when tied)."""
        head = 0 if self.tie_embeddings else self.embed_dim * self.vocab_size
        return (self.vocab_size * self.embed_dim + head + self.num_layers * self._layer_params(self.num_experts)
                + self.embed_dim)

    @property
    def active_matmul_params(self) -> int:
        """Matmul weights one token passes through: attention, router, ``top_k`` experts, the shared
        experts and the head (no input embedding, no norms)."""
        norms = 2 * self.embed_dim + (2 * self.head_dim if self.qk_norm else 0)
        return self.num_layers * (self._layer_params(self.top_k) - norms) + self.embed_dim * self.vocab_size


class MoE(ExpertsDecoder):
    """Token ids [batch, length] -> logits [batch, length, vocab]: ``blocks.Decoder`` (embedding,
    head, generation path) over ``MoELayer``s, with the experts' auxiliary terms
    (``experts.ExpertsDecoder``)."""

    layer_class = MoELayer

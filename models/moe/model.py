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

from models.blocks import GroupedQueryConfig
from models.common import InvalidField
from models.experts import ExpertsConfig, ExpertsDecoder, MoELayer


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig(GroupedQueryConfig, ExpertsConfig):
    """Shape, routing and execution options of a mixture-of-experts decoder: the shared decoder,
    grouped-query attention and experts fields, and the shared experts' width."""

    shared_mlp_dim: int = 0  # hidden size of the shared experts (0: none)
    # Restated: GroupedQueryConfig (first in the bases) carries DecoderConfig's default, not the experts'.
    remat_names: tuple[str, ...] = ("attention", "mlp_hidden", "expert_hidden")

    def __post_init__(self):
        super().__post_init__()
        if self.shared_mlp_dim < 0:
            raise InvalidField("shared_mlp_dim", f"must be >= 0 (0: no shared experts), got {self.shared_mlp_dim}")

    def _layer_params(self, experts: int) -> int:
        return (self.attention_params + self.embed_dim * self.num_experts + experts * self.expert_params
                + 3 * self.embed_dim * self.shared_mlp_dim + self.layer_norm_params)

    @property
    def expert_params(self) -> int:
        """Parameters of one expert of one layer."""
        return 3 * self.embed_dim * self.expert_mlp_dim

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
        return (self.num_layers * (self._layer_params(self.top_k) - self.layer_norm_params)
                + self.embed_dim * self.vocab_size)


class MoE(ExpertsDecoder):
    """Token ids [batch, length] -> logits [batch, length, vocab]: ``blocks.Decoder`` (embedding,
    head, generation path) over ``MoELayer``s, with the experts' auxiliary terms
    (``experts.ExpertsDecoder``)."""

    layer_class = MoELayer

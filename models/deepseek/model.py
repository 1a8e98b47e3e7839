"""A DeepSeek-V3 decoder in Flax NNX, annotated with logical axes only.

Each layer is pre-norm multi-head latent attention (``models/deepseek/attention.py``) and a
feed-forward block: a dense SwiGLU for the first ``num_dense_layers`` layers, then the mixture of
experts of ``models/moe`` (sorted, one-hot or capacity dispatch; expert parallelism) with shared
experts, sigmoid scores, the auxiliary-loss-free routing bias used for the choice only, group-limited
routing (``expert_groups`` groups of experts, a token's experts taken from its ``groups_per_token``
best groups, a group scored by the sum of its two best biased scores) and the gate weights times
``routed_scaling_factor``. Multi-token prediction (``mtp_layers``) is ``models/deepseek/mtp.py``.

Parameters (logical axes in brackets)::

    embedding                    [vocab, embed]
    dense_layers.*               [dense_layers, ...]  the dense layers: attention as below, then
        .mlp.gate, .up [dense_layers, embed, mlp], .mlp.down [dense_layers, mlp, embed]
    layers.attn_norm.scale       [layers, embed]
    layers.attention.*           [layers, ...]  LatentAttention's
    layers.mlp_norm.scale        [layers, embed]
    layers.moe.*                 [layers, ...]  models/experts.py's SparseMoE (router, routing_bias, experts)
    layers.shared.gate, .up      [layers, embed, mlp]  the shared experts (num_shared_experts *
        .down                    [layers, mlp, embed]   expert_mlp_dim hidden units)
    final_norm.scale             [embed]
    head                         [embed, vocab]  (absent when tied)
    mtp.*                        [mtp_layers, ...]  models/deepseek/mtp.py (mtp_layers > 0)

``num_layers`` counts the mixture-of-experts layers: the stacked ``layers`` that pipeline stages
split. The dense layers run inside ``embed`` (under a pipeline, on the first stage, with the
embedding); a Hugging Face config's ``num_hidden_layers`` is ``num_dense_layers + num_layers``.

Generation keeps the compressed cache (``LatentCache``): per position and layer the latent and the
rotary key, ``kv_lora_rank + qk_rope_head_dim`` values.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from models.blocks import DecoderLayer, rotary_tables
from models.common import (ActivationSharding, InvalidField, check_finite, check_non_negative, check_positive,
                           stacked_layers, unconstrained)
from models.deepseek.attention import LatentAttention
from models.deepseek.mtp import PredictionDepth, predict_ahead
from models.experts import ExpertsConfig, ExpertsDecoder, MoELayer, RouterScore
from models.kernels.attention import AttentionSpec

# The leading axis of the dense layers' stack (kept whole: the pipeline splits ``layers`` only).
DENSE_LAYERS = "dense_layers"
# The leading axis of the multi-token prediction modules' stack.
MTP_LAYERS = "mtp_layers"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeepSeekConfig(ExpertsConfig):
    """Shape, routing and execution options of a DeepSeek-V3 model (module docstring): the shared
    decoder and experts fields (``num_layers``: the mixture-of-experts layers, stacked), latent
    attention's, the dense layers' and multi-token prediction's."""

    num_heads: int = 4
    norm_eps: float = 1e-6
    num_dense_layers: int = 1  # dense layers before them (HF first_k_dense_replace)
    q_lora_rank: int = 24  # 0: a plain query projection
    kv_lora_rank: int = 16
    qk_nope_head_dim: int = 8
    qk_rope_head_dim: int = 4
    v_head_dim: int = 6
    mlp_dim: int = 56  # the dense layers' hidden units
    expert_mlp_dim: int = 16
    num_shared_experts: int = 1
    expert_groups: int = 4  # HF n_group
    groups_per_token: int = 2  # HF topk_group
    router_score: RouterScore = RouterScore.SIGMOID
    bias_update_rate: float = 0.001
    load_balancing_coef: float = 0.0001  # DeepSeek-V3's sequence-wise balance loss (per row: group_size 0)
    mtp_layers: int = 0  # multi-token prediction depth (HF num_nextn_predict_layers)
    mtp_loss_coef: float = 0.3  # the weight of the mean of the prediction depths' losses
    rope_interleave: bool = False  # rotary pairs interleaved in the weights (DeepSeek's checkpoints)

    def __post_init__(self):
        super().__post_init__()
        check_positive(self, "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mlp_dim")
        check_non_negative(self, "num_dense_layers", "q_lora_rank", "num_shared_experts", "mtp_layers")
        if self.qk_rope_head_dim % 2:
            raise InvalidField("qk_rope_head_dim", f"must be even for rotary embeddings, got {self.qk_rope_head_dim}")
        check_finite(self, "mtp_loss_coef", positive=False)

    # What the shared blocks (models/blocks.py) and the MoE block read under their own names.
    @property
    def head_dim(self) -> int:
        """The rotary width: the blocks' rotary tables are built for the shared rotary key part."""
        return self.qk_rope_head_dim

    @property
    def num_kv_heads(self) -> int:
        return self.num_heads  # keys and values are expanded per head from the latent

    @property
    def sliding_window(self) -> int:
        return 0

    @property
    def shared_mlp_dim(self) -> int:
        return self.num_shared_experts * self.expert_mlp_dim

    @property
    def attention_spec(self) -> AttentionSpec:
        return AttentionSpec(self.attention, 0, self.attention_block)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def attention_dim(self) -> int:
        """The mean width of the score and value matmuls, heads * (qk + v) / 2 (PaLM's attention term)."""
        return self.num_heads * (self.qk_head_dim + self.v_head_dim) // 2

    @property
    def attention_params(self) -> int:
        d, n = self.embed_dim, self.num_heads
        query = (d * self.q_lora_rank + self.q_lora_rank * n * self.qk_head_dim if self.q_lora_rank
                 else d * n * self.qk_head_dim)
        latent = d * (self.kv_lora_rank + self.qk_rope_head_dim)
        expand = self.kv_lora_rank * n * (self.qk_nope_head_dim + self.v_head_dim)
        return query + latent + expand + n * self.v_head_dim * d

    @property
    def attention_norms(self) -> int:
        return 2 * self.embed_dim + self.q_lora_rank + self.kv_lora_rank

    def _sparse_layer_params(self, experts: int) -> int:
        return (self.attention_params + self.embed_dim * self.num_experts
                + (experts + self.num_shared_experts) * 3 * self.embed_dim * self.expert_mlp_dim)

    @property
    def dense_layer_params(self) -> int:
        return self.attention_params + 3 * self.embed_dim * self.mlp_dim

    @property
    def mtp_layer_params(self) -> int:
        """One prediction depth's parameters beyond its layer: eh_proj and three norms."""
        return 2 * self.embed_dim * self.embed_dim + 3 * self.embed_dim

    @property
    def num_params(self) -> int:
        """All parameters (the embedding counted once when tied)."""
        d = self.embed_dim
        head = 0 if self.tie_embeddings else d * self.vocab_size
        bias = self.num_experts if self.bias_update_rate else 0  # the routing bias
        sparse = self._sparse_layer_params(self.num_experts) + self.attention_norms + bias
        dense = self.dense_layer_params + self.attention_norms
        return (self.vocab_size * d + head + d + self.num_dense_layers * dense
                + (self.num_layers + self.mtp_layers) * sparse + self.mtp_layers * self.mtp_layer_params)

    @property
    def active_matmul_params(self) -> int:
        """Matmul weights one token passes through (the head once per prediction: 1 + mtp_layers)."""
        d = self.embed_dim
        sparse = self._sparse_layer_params(self.top_k)
        return (self.num_dense_layers * self.dense_layer_params + self.num_layers * sparse
                + self.mtp_layers * (sparse + 2 * d * d) + (1 + self.mtp_layers) * d * self.vocab_size)

    @property
    def all_layers(self) -> int:
        """Layers a token's loss passes through: dense, sparse and one per prediction depth."""
        return self.num_dense_layers + self.num_layers + self.mtp_layers


class DenseLayer(DecoderLayer):
    """A dense layer: x + latent attention(norm(x)), then + SwiGLU(norm(x)) (``mlp_dim`` units)."""

    attention_class = LatentAttention


class SparseLayer(MoELayer):
    """A mixture-of-experts layer: x + latent attention(norm(x)), then + (experts + shared
    experts)(norm(x)), with the MoE family's statistics."""

    attention_class = LatentAttention


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LatentCache:
    """The compressed cache: per layer and position the normed latent and the rotated shared key.

    latents: [layers, batch, max_len, kv_lora_rank]; rope_keys: [layers, batch, max_len, rope]
    (the mixture-of-experts layers); dense_latents, dense_rope_keys: the same for the dense layers.
    """

    latents: jax.Array
    rope_keys: jax.Array
    dense_latents: jax.Array
    dense_rope_keys: jax.Array


class DeepSeek(ExpertsDecoder):
    """Token ids [batch, length] -> logits [batch, length, vocab]: the embedding and the dense
    layers (``embed``), the mixture-of-experts layers (``run_layers``, the MoE family's auxiliary
    terms), the final norm and head (``logits``)."""

    layer_class = SparseLayer

    def __init__(self, cfg: DeepSeekConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        self.dense_layers = (stacked_layers(lambda layer_rngs: DenseLayer(cfg, layer_rngs), cfg.num_dense_layers,
                                            rngs, axis=DENSE_LAYERS) if cfg.num_dense_layers else None)
        self.mtp = (stacked_layers(lambda depth_rngs: PredictionDepth(cfg, SparseLayer, depth_rngs), cfg.mtp_layers,
                                   rngs, axis=MTP_LAYERS) if cfg.mtp_layers else None)

    # ``models.api.PredictsAhead``: multi-token prediction (models/deepseek/mtp.py).
    @property
    def ahead_depths(self) -> int:
        return self.cfg.mtp_layers

    @property
    def ahead_weight(self) -> float:
        return self.cfg.mtp_loss_coef

    def predict_ahead(self, x: jax.Array, ahead_inputs: jax.Array, shard: ActivationSharding = unconstrained,
                      documents=None) -> tuple[jax.Array, dict[str, jax.Array]]:
        return predict_ahead(self, x, ahead_inputs, shard, documents)

    def embed(self, tokens: jax.Array, shard: ActivationSharding = unconstrained,
              documents=None) -> jax.Array:
        """tokens [batch, length] -> the dense layers' output [batch, length, embed]."""
        x = super().embed(tokens, shard)
        if self.dense_layers is not None:
            x, _ = self._scan_layers(x, shard, documents, self.dense_layers)
        return x

    def init_cache(self, batch: int, max_len: int, dtype: jnp.dtype = jnp.float32) -> LatentCache:
        """An empty compressed cache for ``batch`` sequences of up to ``max_len`` positions."""
        cfg = self.cfg
        shape = lambda layers, width: (layers, batch, max_len, width)
        return LatentCache(jnp.zeros(shape(cfg.num_layers, cfg.kv_lora_rank), dtype),
                           jnp.zeros(shape(cfg.num_layers, cfg.qk_rope_head_dim), dtype),
                           jnp.zeros(shape(cfg.num_dense_layers, cfg.kv_lora_rank), dtype),
                           jnp.zeros(shape(cfg.num_dense_layers, cfg.qk_rope_head_dim), dtype))

    def cached_forward(self, tokens: jax.Array, cache: LatentCache, start: jax.Array,
                       shard: ActivationSharding = unconstrained) -> tuple[jax.Array, LatentCache]:
        """tokens [batch, length] at positions start.. -> (logits [batch, length, vocab], the cache
        with these positions written), as ``blocks.Decoder.cached_forward``."""
        cfg = self.cfg
        x = super().embed(tokens, shard)
        rotary = rotary_tables(start + jnp.arange(tokens.shape[1])[None], cfg.head_dim, cfg.rope_theta,
                               cfg.rope_scaling)
        dense_latents, dense_rope_keys = cache.dense_latents, cache.dense_rope_keys
        if self.dense_layers is not None:
            x, dense_latents, dense_rope_keys = self._scan_cached(self.dense_layers, x, rotary, dense_latents,
                                                                  dense_rope_keys, start, shard)
        x, latents, rope_keys = self._scan_cached(self.layers, x, rotary, cache.latents, cache.rope_keys, start,
                                                  shard)
        return self.logits(x, shard), LatentCache(latents, rope_keys, dense_latents, dense_rope_keys)

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
import math

import jax
import jax.numpy as jnp
from flax import nnx

from models.kernels.attention import AttentionSpec
from models.blocks import AttentionKernel, RopeScalingConfig, rotary_tables
from models.common import (ActivationSharding, InvalidField, RematPolicy, coerce_enums, stacked_layers, unconstrained)
from models.deepseek.attention import LatentAttention
from models.deepseek.mtp import PredictionDepth, predict_ahead
from models.kernels.grouped_matmul import GroupedKernel, GroupedSpec
from models.blocks import DecoderLayer
from models.experts import CHECKPOINT_NAMES as EXPERT_CHECKPOINT_NAMES
from models.experts import Dispatch, ExpertsDecoder, MoELayer, RouterScore, check_routing_groups

CHECKPOINT_NAMES = EXPERT_CHECKPOINT_NAMES
# The leading axis of the dense layers' stack (kept whole: the pipeline splits ``layers`` only).
DENSE_LAYERS = "dense_layers"
# The leading axis of the multi-token prediction modules' stack.
MTP_LAYERS = "mtp_layers"


@dataclasses.dataclass(frozen=True)
class DeepSeekConfig:
    """Shape, routing and execution options of a DeepSeek-V3 model (module docstring)."""

    vocab_size: int = 96
    embed_dim: int = 40
    num_layers: int = 2  # mixture-of-experts layers (stacked)
    num_dense_layers: int = 1  # dense layers before them (HF first_k_dense_replace)
    num_heads: int = 4
    q_lora_rank: int = 24  # 0: a plain query projection
    kv_lora_rank: int = 16
    qk_nope_head_dim: int = 8
    qk_rope_head_dim: int = 4
    v_head_dim: int = 6
    mlp_dim: int = 56  # the dense layers' hidden units
    num_experts: int = 8
    top_k: int = 2
    expert_mlp_dim: int = 16
    num_shared_experts: int = 1
    expert_groups: int = 4  # HF n_group
    groups_per_token: int = 2  # HF topk_group
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    router_score: RouterScore = RouterScore.SIGMOID
    bias_update_rate: float = 0.001
    dispatch: Dispatch = Dispatch.DROPLESS
    capacity_factor: float = 1.25
    exchange_buffer_factor: float = 0.0
    grouped_matmul: GroupedKernel = GroupedKernel.AUTO
    expert_block: int = 0
    group_size: int = 0
    load_balancing_coef: float = 0.0001  # DeepSeek-V3's sequence-wise balance loss (per row: group_size 0)
    z_loss_coef: float = 0.0
    mtp_layers: int = 0  # multi-token prediction depth (HF num_nextn_predict_layers)
    mtp_loss_coef: float = 0.3  # the weight of the mean of the prediction depths' losses
    seq_len: int = 32
    rope_theta: float = 10000.0
    rope_scaling: RopeScalingConfig = dataclasses.field(default_factory=RopeScalingConfig)
    rope_interleave: bool = False  # rotary pairs interleaved in the weights (DeepSeek's checkpoints)
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    init_std: float = 0.02
    attention: AttentionKernel = AttentionKernel.AUTO
    attention_block: int = 512
    remat: RematPolicy = RematPolicy.NONE
    remat_names: tuple[str, ...] = ("attention", "mlp_hidden", "expert_hidden")

    def __post_init__(self):
        coerce_enums(self)
        for name in ("vocab_size", "embed_dim", "num_layers", "num_heads", "kv_lora_rank", "qk_nope_head_dim",
                     "qk_rope_head_dim", "v_head_dim", "mlp_dim", "num_experts", "expert_mlp_dim", "seq_len",
                     "attention_block"):
            if getattr(self, name) <= 0:
                raise InvalidField(name, f"must be a positive integer, got {getattr(self, name)}")
        for name in ("num_dense_layers", "q_lora_rank", "num_shared_experts", "mtp_layers", "group_size",
                     "expert_block"):
            if getattr(self, name) < 0:
                raise InvalidField(name, f"must be >= 0, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise InvalidField("qk_rope_head_dim", f"must be even for rotary embeddings, got {self.qk_rope_head_dim}")
        if not 1 <= self.top_k <= self.num_experts:
            raise InvalidField("top_k", f"must be between 1 and num_experts={self.num_experts}, got {self.top_k}")
        check_routing_groups(self)
        for name in ("capacity_factor", "rope_theta", "norm_eps", "init_std"):
            if not (getattr(self, name) > 0 and math.isfinite(getattr(self, name))):
                raise InvalidField(name, f"must be a finite number > 0, got {getattr(self, name)}")
        for name in ("bias_update_rate", "exchange_buffer_factor", "load_balancing_coef", "z_loss_coef",
                     "mtp_loss_coef"):
            if not (getattr(self, name) >= 0 and math.isfinite(getattr(self, name))):
                raise InvalidField(name, f"must be a finite number >= 0, got {getattr(self, name)}")
        if self.group_size and self.seq_len % self.group_size:
            raise InvalidField("group_size", f"must divide seq_len={self.seq_len} (0: one group per row), "
                               f"got {self.group_size}")
        unknown = sorted(set(self.remat_names) - set(CHECKPOINT_NAMES))
        if unknown:
            raise InvalidField("remat_names", f"unknown names {unknown}; valid: {list(CHECKPOINT_NAMES)}")

    @property
    def sorted_dispatch(self) -> bool:
        return self.dispatch is Dispatch.DROPLESS

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
    def grouped_spec(self) -> GroupedSpec:
        return GroupedSpec(self.grouped_matmul, self.expert_block)

    def slots(self, group: int) -> int:
        if self.dispatch is not Dispatch.CAPACITY:
            return group
        return min(group, math.ceil(self.capacity_factor * group * self.top_k / self.num_experts))

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

    def ahead_logits(self, stream: jax.Array, shard: ActivationSharding = unconstrained) -> jax.Array:
        """A prediction depth's normed stream [batch, length, embed] -> logits through the shared head."""
        return self.vocab_logits(stream, shard)

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

"""A Llama-family decoder (Llama 2/3, Mistral, Qwen3 dense shapes) in Flax NNX, annotated with logical axes only.

Parameters (logical axes in brackets; ``layers`` leads every per-layer parameter, which is
stacked and run with ``lax.scan`` so compile time does not grow with depth):

    embedding      [vocab, embed]
    layers.attn_norm.scale   [layers, embed]
    layers.attention.query   [layers, embed, heads, head_dim]      column-parallel under TP
    layers.attention.key     [layers, embed, kv_heads, head_dim]
    layers.attention.value   [layers, embed, kv_heads, head_dim]
    layers.attention.out     [layers, heads, head_dim, embed]      row-parallel under TP
    layers.attention.query_norm.scale, key_norm.scale   [layers, head_dim]   (``qk_norm`` only: Qwen3)
    layers.mlp_norm.scale    [layers, embed]
    layers.mlp.gate, .up     [layers, embed, mlp]                  column-parallel under TP
    layers.mlp.down          [layers, mlp, embed]                  row-parallel under TP
    final_norm.scale         [embed]
    head           [embed, vocab]   (absent when ``tie_embeddings``: the embedding is reused)

The attention, norms, rotary embeddings, MLP and the decoder around the layers are the shared
blocks of ``models/blocks.py``; this module holds the config and the layer that combines them
(its FLOPs and activation-memory formulas: ``models/llama/costs.py``). Compute runs in the dtype of
the parameters handed in (the trainer casts fp32 master weights to bf16/fp16); norms, rotary
embeddings and the softmax run in fp32.

Generation uses ``Llama.cached_forward`` with a ``blocks.KVCache`` (``init_cache``): keys and values
of earlier positions are kept per layer, so each new token costs one position's compute.
"""

from __future__ import annotations

import dataclasses


from models.kernels.attention import AttentionSpec
from models.blocks import (BLOCK_CHECKPOINT_NAMES, AttentionKernel, Decoder, DecoderLayer, RopeScalingConfig,
                           check_attention_fields)
from models.common import InvalidField, RematPolicy, coerce_enums

# Activations a NAMED remat policy may keep: the blocks' (tagged with ``checkpoint_name``).
CHECKPOINT_NAMES = BLOCK_CHECKPOINT_NAMES


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shape and execution options of a Llama-style model."""

    vocab_size: int = 96
    embed_dim: int = 40
    num_layers: int = 2
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 6
    mlp_dim: int = 72
    seq_len: int = 32
    rope_theta: float = 10000.0
    rope_scaling: RopeScalingConfig = dataclasses.field(default_factory=RopeScalingConfig)
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    qk_norm: bool = False  # RMSNorm of each query and key head before the rotary embedding (Qwen3)
    attention: AttentionKernel = AttentionKernel.AUTO
    attention_block: int = 512  # positions per query and key block of the blockwise kernel
    sliding_window: int = 0  # positions a query attends, itself included (Mistral); 0 = all earlier
    remat: RematPolicy = RematPolicy.NONE
    remat_names: tuple[str, ...] = ("attention", "mlp_hidden")

    def __post_init__(self):
        coerce_enums(self)
        for name in ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "mlp_dim", "seq_len"):
            if getattr(self, name) <= 0:
                raise InvalidField(name, f"must be a positive integer, got {getattr(self, name)}")
        check_attention_fields(self, CHECKPOINT_NAMES)

    @property
    def attention_spec(self) -> AttentionSpec:
        return AttentionSpec(self.attention, self.sliding_window, self.attention_block)

    @property
    def attention_dim(self) -> int:
        """heads * head_dim: the width of the attention score/value matmuls."""
        return self.num_heads * self.head_dim

    @property
    def layer_norm_params(self) -> int:
        """Norm scales of one decoder layer: attention and MLP norms, and the per-head query and key
        norms when ``qk_norm``."""
        return 2 * self.embed_dim + (2 * self.head_dim if self.qk_norm else 0)

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer."""
        qkv = self.embed_dim * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        out = self.attention_dim * self.embed_dim
        mlp = 3 * self.embed_dim * self.mlp_dim
        return qkv + out + mlp + self.layer_norm_params

    @property
    def num_params(self) -> int:
        """All parameters (the embedding counted once when tied)."""
        head = 0 if self.tie_embeddings else self.embed_dim * self.vocab_size
        return (self.vocab_size * self.embed_dim + head + self.num_layers * self.layer_params
                + self.embed_dim)

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in matmuls: all but the input-embedding gather and norms."""
        per_layer = self.layer_params - self.layer_norm_params
        return self.num_layers * per_layer + self.embed_dim * self.vocab_size



class Llama(Decoder):
    """Token ids [batch, length] -> logits [batch, length, vocab]: ``blocks.Decoder`` over
    ``DecoderLayer``s (no auxiliary terms)."""

    layer_class = DecoderLayer

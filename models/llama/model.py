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

from models.blocks import Decoder, DecoderLayer, GroupedQueryConfig
from models.common import check_positive


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig(GroupedQueryConfig):
    """Shape and execution options of a Llama-style model: the shared decoder and grouped-query
    attention fields, and the MLP's width."""

    mlp_dim: int = 72

    def __post_init__(self):
        super().__post_init__()
        check_positive(self, "mlp_dim")

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer."""
        return self.attention_params + 3 * self.embed_dim * self.mlp_dim + self.layer_norm_params

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

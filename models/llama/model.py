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
blocks of ``models/blocks.py``; this module holds the config, the layer that combines them and the
FLOPs and activation-memory formulas. Compute runs in the dtype of the parameters handed in (the
trainer casts fp32 master weights to bf16/fp16); norms, rotary embeddings and the softmax run in fp32.

Generation uses ``Llama.cached_forward`` with a ``blocks.KVCache`` (``init_cache``): keys and values
of earlier positions are kept per layer, so each new token costs one position's compute.
"""

from __future__ import annotations

import dataclasses


from models.kernels.attention import AttentionSpec
from models.blocks import (BLOCK_CHECKPOINT_NAMES, AttentionKernel, Decoder, DecoderLayer, RopeScalingConfig,
                           check_attention_fields, score_bytes)
from models.common import InvalidField, RematPolicy, coerce_enums, palm_train_flops_per_token
from models.kernels.fp8 import MatmulGroup

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



def flops_per_token(cfg: LlamaConfig) -> float:
    """Training FLOPs per token (PaLM convention, ``models.common.palm_train_flops_per_token``)."""
    return palm_train_flops_per_token(matmul_params=cfg.matmul_params, num_layers=cfg.num_layers,
                                      seq_len=cfg.seq_len, attention_dim=cfg.attention_dim)


def recompute_flops_per_token(cfg: LlamaConfig, remat: RematPolicy) -> float:
    """Forward FLOPs per token the backward recomputes: DOTS recomputes the attention matmuls,
    FULL every layer's forward but the MLP's down projection (its output, the layer's last, is not
    needed by the backward, and XLA drops it). Both equal the count of the traced step
    (``meshtrain.flops``, tests/test_flops.py). NAMED and OFFLOAD count 0, an underestimate: they
    recompute whatever their names do not keep (with the default names, the q/k/v, gate/up and
    output projections and the attention scores)."""
    attention_forward = 4 * cfg.num_layers * cfg.seq_len * cfg.attention_dim
    layer_matmul = cfg.num_layers * (cfg.layer_params - cfg.layer_norm_params)
    down_projection = cfg.num_layers * cfg.mlp_dim * cfg.embed_dim
    return {RematPolicy.DOTS: attention_forward,
            RematPolicy.FULL: 2 * (layer_matmul - down_projection) + attention_forward}.get(remat, 0.0)


def activation_bytes(cfg: LlamaConfig, tensor: int, remat: RematPolicy, compute_bytes: int,
                     sequence: int = 1, keys: float | None = None, experts: int = 1,
                     fp8: frozenset[MatmulGroup] = frozenset()) -> tuple[float, float]:
    """(saved, working) activation bytes per token and layer on one device.

    ``saved``: what the backward pass keeps per layer under ``remat``; ``working``: the live set of
    one layer while its backward runs (its recomputed activations and their gradients). Counts in
    vectors per token: d = embed / sequence (the residual stream, split ``sequence`` ways by sequence
    parallelism), q = heads*head_dim/tensor, k = kv_heads*head_dim/tensor, f = mlp/tensor in the
    compute dtype, s = heads/tensor * keys attention scores in fp32 (``keys``: the key positions a
    query's scores span at once, on average: the whole sequence, or under ring attention one tile's
    block^2 over the rank's positions). A dense model has no experts to split (``experts`` unused).
    Under FP8 (``fp8``: the groups whose matmuls run in FP8) ``none`` keeps the two values only an
    FP8 matmul reads, the attention's output (the output projection's input) and the hidden (the down
    projection's), as their E4M3 copies, 1 B each (XLA:CPU, 8B with ``remat=none``: 3.63 GB less
    temp than bf16's, 3 B x (q + f) per token and layer).
    """
    del experts
    d = cfg.embed_dim / sequence
    q = cfg.num_heads * cfg.head_dim / tensor
    k = cfg.num_kv_heads * cfg.head_dim / tensor
    f = cfg.mlp_dim / tensor
    saved_scores, working_scores = score_bytes(cfg, tensor, keys)
    c = compute_bytes
    # ``none`` keeps what XLA:CPU's stash of the 8B step holds per token and layer (its buffer
    # assignment, 32.7 GB): six residual-wide values, three query-wide (two [heads, head_dim] values
    # and the attention kernel's output), two key-wide (keys, values), and six MLP-wide: gate, up,
    # sigmoid(gate), its derivative sigmoid(gate)(1 - sigmoid(gate)), silu(gate) and the hidden
    # silu(gate) * up (autodiff's residuals of SwiGLU).
    attention_output = 1 if MatmulGroup.ATTENTION in fp8 else c
    hidden = 1 if MatmulGroup.MLP in fp8 else c
    everything = (6 * d + 2 * q + 2 * k + 5 * f) * c + q * attention_output + f * hidden + saved_scores
    # The backward of the MLP holds the gradients of gate, up, silu and hidden besides them.
    working = (8 * d + 3 * q + 3 * k + 8 * f) * c + working_scores
    saved = {RematPolicy.NONE: everything,
             # the input, q/k/v, the attention's output projection, gate/up (the down projection's output
             # is the next layer's input, kept as that)
             RematPolicy.DOTS: (2 * d + q + 2 * k + 2 * f) * c,
             RematPolicy.FULL: d * c}.get(remat, everything)
    return saved, working



class Llama(Decoder):
    """Token ids [batch, length] -> logits [batch, length, vocab]: ``blocks.Decoder`` over
    ``DecoderLayer``s (no auxiliary terms)."""

    layer_class = DecoderLayer

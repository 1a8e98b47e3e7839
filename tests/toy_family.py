"""A second model family, defined outside ``meshtrain/`` and ``models/``, to prove the plugin boundary.

``model.plugin=tests/toy_family.py model.family=toy_gpt`` makes a run use it from the repository root
(tests/toy_gpt.yaml names the file relative to itself; ``model.plugin=toy_family`` also works with
``tests/`` on the Python path, as under pytest). It differs from Llama where the framework could
have hidden an assumption: learned position embeddings (a table with its own logical axis
``positions``), LayerNorm, multi-head attention without rotary embeddings, a plain GELU MLP, and
an auxiliary loss (a weighted penalty on each layer's mean squared activation, summed over rows)
that must reach the objective through every pipeline schedule.

Parameters (logical axes)::

    token_embedding      [vocab, embed]
    position_embedding   [positions, embed]
    layers.attn_norm.scale / mlp_norm.scale   [layers, embed]
    layers.qkv           [layers, embed, qkv, heads, head_dim]   qkv = 3 (query, key, value)
    layers.out           [layers, heads, head_dim, embed]
    layers.up            [layers, embed, mlp]
    layers.down          [layers, mlp, embed]
    final_norm.scale     [embed]
    head                 [embed, vocab]
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from models.kernels.attention import AttentionKernel, AttentionSpec
from models.api import (AUX_LOSS, AxisRole, Documents, FamilyCosts, LayerBytes, LayerRequest, ModelFamily,
                        head_logits, positions_of, register)
from models.common import (ActivationSharding, InvalidField, RematPolicy, logical_param,
                           palm_train_flops_per_token, stacked_layers, unconstrained)

BLE = ("batch", "length", "embed")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToyGPTConfig:
    # The framework's fields (models.api.ModelConfig) ...
    vocab_size: int = 96
    embed_dim: int = 40
    num_layers: int = 2
    remat: RematPolicy = RematPolicy.NONE
    seq_len: int = 32  # also the size of the learned position table
    # ... and the family's own.
    num_heads: int = 4
    head_dim: int = 6
    mlp_dim: int = 72
    aux_loss_weight: float = 0.01  # weight of each layer's mean squared activation in the loss

    def __post_init__(self):
        for name in ("vocab_size", "embed_dim", "num_layers", "num_heads", "head_dim", "mlp_dim", "seq_len"):
            if getattr(self, name) <= 0:
                raise InvalidField(name, f"must be a positive integer, got {getattr(self, name)}")

    @property
    def attention_spec(self) -> AttentionSpec:
        return AttentionSpec(AttentionKernel.XLA)  # its layers apply their own dense mask

    @property
    def matmul_params(self) -> int:
        d, a = self.embed_dim, self.num_heads * self.head_dim
        return self.num_layers * (4 * d * a + 2 * d * self.mlp_dim) + d * self.vocab_size

    @property
    def num_params(self) -> int:
        d = self.embed_dim
        return self.matmul_params + (self.vocab_size + self.seq_len) * d + (2 * self.num_layers + 1) * d


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float) -> jax.Array:
    return std * jax.random.normal(rngs.params(), shape, jnp.float32)


def _layer_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    centred = x32 - x32.mean(-1, keepdims=True)
    normed = centred * jax.lax.rsqrt((centred * centred).mean(-1, keepdims=True) + 1e-5)
    return (normed * scale.astype(jnp.float32)).astype(x.dtype)


class Block(nnx.Module):
    def __init__(self, cfg: ToyGPTConfig, rngs: nnx.Rngs):
        d, n, h, m = cfg.embed_dim, cfg.num_heads, cfg.head_dim, cfg.mlp_dim
        self.attn_norm = logical_param(jnp.ones((d,)), ("embed",))
        self.qkv = logical_param(_normal(rngs, (d, 3, n, h), d ** -0.5), ("embed", "qkv", "heads", "head_dim"))
        self.out = logical_param(_normal(rngs, (n, h, d), (n * h) ** -0.5), ("heads", "head_dim", "embed"))
        self.mlp_norm = logical_param(jnp.ones((d,)), ("embed",))
        self.up = logical_param(_normal(rngs, (d, m), d ** -0.5), ("embed", "mlp"))
        self.down = logical_param(_normal(rngs, (m, d), m ** -0.5), ("mlp", "embed"))
        self.aux_loss_weight = cfg.aux_loss_weight

    def __call__(self, x: jax.Array, mask: jax.Array | None, shard: ActivationSharding) -> tuple[jax.Array, jax.Array]:
        qkv = jnp.einsum("btd,dcnh->cbtnh", _layer_norm(x, self.attn_norm[...]), self.qkv[...])
        q, k, v = (shard(part, ("batch", "length", "heads", "head_dim")) for part in qkv)
        attended = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=mask is None, implementation="xla")
        x = shard(x + jnp.einsum("btnh,nhd->btd", attended, self.out[...]), BLE)
        hidden = shard(jax.nn.gelu(_layer_norm(x, self.mlp_norm[...]) @ self.up[...]), ("batch", "length", "mlp"))
        x = shard(x + hidden @ self.down[...], BLE)
        x32 = x.astype(jnp.float32)
        aux = self.aux_loss_weight * jnp.sum(jnp.mean(x32 * x32, axis=(1, 2)))  # summed over rows
        return x, aux


class ToyGPT(nnx.Module):
    def __init__(self, cfg: ToyGPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.token_embedding = logical_param(_normal(rngs, (cfg.vocab_size, cfg.embed_dim), 0.02), ("vocab", "embed"))
        self.position_embedding = logical_param(_normal(rngs, (cfg.seq_len, cfg.embed_dim), 0.02),
                                                ("positions", "embed"))

        self.layers = stacked_layers(lambda layer_rngs: Block(cfg, layer_rngs), cfg.num_layers, rngs)
        self.final_norm = logical_param(jnp.ones((cfg.embed_dim,)), ("embed",))
        self.head = logical_param(_normal(rngs, (cfg.embed_dim, cfg.vocab_size), cfg.embed_dim ** -0.5),
                                  ("embed", "vocab"))

    def embed(self, tokens: jax.Array, shard: ActivationSharding = unconstrained,
              documents: Documents | None = None) -> jax.Array:
        # One-hot matmuls rather than gathers: they partition cleanly whatever splits the tables.
        dtype = self.token_embedding[...].dtype
        one_hot = jax.nn.one_hot(tokens, self.cfg.vocab_size, dtype=dtype)
        positions = jax.nn.one_hot(positions_of(documents, tokens.shape[1]), self.cfg.seq_len, dtype=dtype)
        return shard(one_hot @ self.token_embedding[...] + positions @ self.position_embedding[...], BLE)

    def run_layers(self, x: jax.Array, shard: ActivationSharding = unconstrained,
                   documents: Documents | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        layer_def, layer_state = nnx.split(self.layers)
        mask = None if documents is None else documents.attention_mask()

        def run_layer(x, one_layer_state):
            return nnx.merge(layer_def, one_layer_state)(x, mask, shard)

        # Each layer's aux loss is a scan output, not a carry: a carry created here would not match
        # the type the layers give it inside a pipeline stage (varying over the manual stage axis).
        x, aux = jax.lax.scan(self.cfg.remat.wrap(run_layer, ()), x, layer_state)
        return x, {AUX_LOSS: jnp.sum(aux)}

    def logits(self, x: jax.Array, shard: ActivationSharding = unconstrained) -> jax.Array:
        return head_logits(self.head_input(x, shard), self.head_weight(), shard)

    def head_input(self, x: jax.Array, shard: ActivationSharding = unconstrained) -> jax.Array:
        return _layer_norm(x, self.final_norm[...])

    def head_weight(self) -> jax.Array:
        return self.head[...]


@dataclasses.dataclass(frozen=True)
class ToyCosts(FamilyCosts):
    """The toy family's costs (the planner bounds its keys' and values' width: ``FamilyCosts``' default)."""

    def flops_per_token(self) -> float:
        cfg = self.cfg
        return palm_train_flops_per_token(matmul_params=cfg.matmul_params, num_layers=cfg.num_layers,
                                          seq_len=cfg.seq_len, attention_dim=cfg.num_heads * cfg.head_dim)

    def recompute_flops_per_token(self, remat: RematPolicy) -> float:
        forward = (self.flops_per_token() - 2 * self.cfg.embed_dim * self.cfg.vocab_size * 3) / 3
        return forward if remat is RematPolicy.FULL else 0.0

    def layer_bytes(self, request: LayerRequest) -> LayerBytes:
        # Its residual stream runs along `length`: sequence parallelism does not split it; FP8 copies not counted.
        cfg, tensor, c = self.cfg, request.block_ways, request.compute_bytes
        d, a, f = cfg.embed_dim, cfg.num_heads * cfg.head_dim / tensor, cfg.mlp_dim / tensor
        scores = cfg.num_heads / tensor * (request.keys or cfg.seq_len) * 4
        everything = (6 * d + 4 * a + 2 * f) * c + 2 * scores
        return LayerBytes(d * c if request.remat is RematPolicy.FULL else everything, everything + 2 * f * c)


FAMILY = register(ModelFamily(
    name="toy_gpt", config_class=ToyGPTConfig, model_class=ToyGPT,
    axis_roles={"positions": AxisRole.REPLICATED, "qkv": AxisRole.REPLICATED, "heads": AxisRole.TENSOR,
                "head_dim": AxisRole.REPLICATED, "mlp": AxisRole.TENSOR},
    costs=ToyCosts))

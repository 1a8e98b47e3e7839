"""Decoder building blocks shared by the model families, annotated with logical axes only.

What a pre-norm decoder with rotary attention is made of, whatever its feed-forward block:

* ``Attention``: grouped-query causal self-attention with rotary embeddings (``AttentionKernel``
  picks the training kernel; ``rotary_tables``/``apply_rotary``, rescaled by ``RopeScalingConfig``);
  parameters ``query`` [embed, heads, head_dim], ``key``/``value`` [embed, kv_heads, head_dim],
  ``out`` [heads, head_dim, embed]. ``QKNormAttention``: the same, with Qwen3's RMSNorm of each
  query and key head before the rotary embedding when the config's ``qk_norm`` is true (``query_norm``
  / ``key_norm``: ``scale`` [head_dim] each; absent otherwise).
* ``RMSNorm`` (``scale`` [embed], or [head_dim] for per-head norms) and the ``SwiGLU`` feed-forward
  (``gate``/``up`` [embed, mlp], ``down`` [mlp, embed]).
* ``PreNormLayer``: x + attention(norm(x)), then the family's feed-forward block, with the KV-cache
  path (``KVCache``) for generation.
* ``Decoder``: embedding [vocab, embed], the stacked layers (``layers`` leading every per-layer
  parameter, run with ``lax.scan``), the final norm and the head [embed, vocab] (absent when tied):
  the three pieces of ``models.api.DecoderModel`` and ``cached_forward``.

The blocks read a family's config through the field names of ``DecoderConfig`` (the fields every
family shares, and their checks) and ``GroupedQueryConfig`` (the grouped-query attention's). Norms, rotary
embeddings and the softmax run in fp32; matmuls in the dtype of the parameters handed in.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from models.kernels.attention import AttentionKernel, AttentionSpec, attention_mask
from models.api import (HEAD_AXES, RESIDUAL_AXES, AxisRole, Documents, FamilyCosts, LayerAux, forward, head_logits,
                        no_aux, positions_of)
from models.common import (ActivationSharding, InvalidField, RematPolicy, check_finite, check_positive, coerce_enums,
                           logical_param, matmul, stacked_layers, unconstrained)
from models.kernels.fp8 import MatmulGroup

# Activations the blocks tag with ``checkpoint_name``, which a NAMED remat policy may keep.
BLOCK_CHECKPOINT_NAMES = ("query", "key", "value", "attention", "mlp_hidden")

# Inside the attention and MLP blocks the positions are ``length`` (queries, hidden units) and
# ``kv_length`` (keys, values), while the residual stream between them runs along ``sequence``
# (``models.api.RESIDUAL_AXES``). Rules may split them differently: sequence parallelism splits
# ``sequence`` only; context parallelism splits all but ``kv_length`` (keys and values gathered).
KV_AXES = ("batch", "kv_length", "kv_heads", "head_dim")


class RopeScaling(str, enum.Enum):
    """How rotary frequencies are rescaled for long contexts.

    NONE: the plain frequencies ``theta ** (-2i / head_dim)``.
    LLAMA3: Llama 3.1's rule: wavelengths above ``original_max_len / low_freq_factor`` are divided
    by ``factor``, those below ``original_max_len / high_freq_factor`` kept, and those in between
    interpolated smoothly.
    YARN: YaRN (DeepSeek-V3, Qwen long context): frequencies whose wavelength makes fewer than
    ``beta_slow`` turns over ``original_max_len`` positions divided by ``factor``, more than
    ``beta_fast`` turns kept, a linear ramp between; cos and sin scaled by ``attention_factor``.
    """

    NONE = "none"
    LLAMA3 = "llama3"
    YARN = "yarn"


@dataclasses.dataclass(frozen=True)
class RopeScalingConfig:
    """``model.rope_scaling``: the rotary frequency rescaling (Llama 3.1's or YaRN); ``kind: none`` = off.
    ``low_freq_factor`` / ``high_freq_factor``: Llama 3.1's; ``beta_fast``, ``beta_slow``, ``mscale``,
    ``mscale_all_dim``, ``truncate``: YaRN's (as transformers reads them)."""

    kind: RopeScaling = RopeScaling.NONE
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    truncate: bool = True

    def __post_init__(self):
        coerce_enums(self)
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            if getattr(self, name) <= 0:
                raise InvalidField(f"rope_scaling.{name}", f"must be > 0, got {getattr(self, name)}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise InvalidField("rope_scaling.high_freq_factor", f"must be > low_freq_factor="
                               f"{self.low_freq_factor}, got {self.high_freq_factor}")
        if self.original_max_len <= 0:
            raise InvalidField("rope_scaling.original_max_len",
                               f"must be a positive integer, got {self.original_max_len}")
        if not self.beta_fast > self.beta_slow > 0:
            raise InvalidField("rope_scaling.beta_fast", f"must be > beta_slow={self.beta_slow} > 0, "
                               f"got {self.beta_fast}")
        for name in ("mscale", "mscale_all_dim"):
            if not (getattr(self, name) >= 0 and math.isfinite(getattr(self, name))):
                raise InvalidField(f"rope_scaling.{name}", f"must be a finite number >= 0, got {getattr(self, name)}")

    @property
    def attention_factor(self) -> float:
        """What YaRN multiplies cos and sin by (1 for the other kinds): ``mscale(factor, mscale) /
        mscale(factor, mscale_all_dim)`` when both are set, else ``mscale(factor, 1)``, with YaRN's
        ``mscale(s, m) = 0.1 m ln(s) + 1`` (1 for s <= 1)."""
        if self.kind is not RopeScaling.YARN:
            return 1.0
        if self.mscale and self.mscale_all_dim:
            return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(self.factor, self.mscale_all_dim)
        return _yarn_mscale(self.factor, 1.0)

    def softmax_scale(self, width: int) -> float:
        """The attention softmax scale of query/key heads ``width`` wide: ``width ** -0.5``, times
        ``mscale(factor, mscale_all_dim) ** 2`` under YaRN with ``mscale_all_dim`` (multi-head latent
        attention's rule; other attention keeps ``width ** -0.5``)."""
        scale = width ** -0.5
        if self.kind is RopeScaling.YARN and self.mscale_all_dim:
            scale *= _yarn_mscale(self.factor, self.mscale_all_dim) ** 2
        return scale


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_frequencies(inv_freq: jax.Array, head_dim: int, theta: float, scaling: RopeScalingConfig) -> jax.Array:
    """YaRN's blend of interpolated (``/ factor``) and kept frequencies (``RopeScaling.YARN``)."""
    def turns_dim(turns: float) -> float:  # the dimension whose wavelength turns that often
        return head_dim * math.log(scaling.original_max_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = turns_dim(scaling.beta_fast), turns_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    return inv_freq / scaling.factor * ramp + inv_freq * (1 - ramp)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    """The config fields every decoder family shares, checked in ``__post_init__`` (a family's
    config derives from it, or from ``GroupedQueryConfig`` / ``models.experts.ExpertsConfig``, and
    adds its own fields and checks after ``super().__post_init__()``). ``checkpoint_names``: what the
    family's NAMED remat may keep. The blocks read these names; ``Decoder`` also reads ``head_dim``
    (the rotary width) and its cache ``num_kv_heads``, which a family with other attention gives as
    properties."""

    checkpoint_names: ClassVar[tuple[str, ...]] = BLOCK_CHECKPOINT_NAMES

    vocab_size: int = 96
    embed_dim: int = 40
    num_layers: int = 2
    num_heads: int = 8
    seq_len: int = 32
    rope_theta: float = 10000.0
    rope_scaling: RopeScalingConfig = dataclasses.field(default_factory=RopeScalingConfig)
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    attention: AttentionKernel = AttentionKernel.AUTO
    attention_block: int = 512  # positions per query and key block of the blockwise kernel
    remat: RematPolicy = RematPolicy.NONE
    remat_names: tuple[str, ...] = ("attention", "mlp_hidden")

    def __post_init__(self):
        coerce_enums(self)
        check_positive(self, "vocab_size", "embed_dim", "num_layers", "num_heads", "seq_len", "attention_block")
        check_finite(self, "rope_theta", "norm_eps", "init_std", positive=True)
        unknown = sorted(set(self.remat_names) - set(self.checkpoint_names))
        if unknown:
            raise InvalidField("remat_names", f"unknown names {unknown}; valid: {list(self.checkpoint_names)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupedQueryConfig(DecoderConfig):
    """``DecoderConfig`` and the fields of the grouped-query ``Attention`` / ``QKNormAttention``."""

    num_kv_heads: int = 4
    head_dim: int = 6
    qk_norm: bool = False  # RMSNorm of each query and key head before the rotary embedding (Qwen3)
    sliding_window: int = 0  # positions a query attends, itself included (Mistral); 0 = all earlier

    def __post_init__(self):
        super().__post_init__()
        check_positive(self, "num_kv_heads", "head_dim")
        if self.num_heads % self.num_kv_heads:
            raise InvalidField("num_kv_heads", f"must divide num_heads={self.num_heads}, got {self.num_kv_heads}")
        if self.head_dim % 2:
            raise InvalidField("head_dim", f"must be even for rotary embeddings, got {self.head_dim}")
        if self.sliding_window < 0:
            raise InvalidField("sliding_window", f"must be >= 0 (0: no window), got {self.sliding_window}")

    @property
    def attention_spec(self) -> AttentionSpec:
        return AttentionSpec(self.attention, self.sliding_window, self.attention_block)

    @property
    def attention_dim(self) -> int:
        """heads * head_dim: the width of the attention score/value matmuls."""
        return self.num_heads * self.head_dim

    @property
    def attention_params(self) -> int:
        """Parameters of one layer's attention projections (query, key, value, out)."""
        qkv = self.embed_dim * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        return qkv + self.attention_dim * self.embed_dim

    @property
    def layer_norm_params(self) -> int:
        """Norm scales of one decoder layer: attention and MLP norms, and the per-head query and key
        norms when ``qk_norm``."""
        return 2 * self.embed_dim + (2 * self.head_dim if self.qk_norm else 0)


def score_bytes(cfg: DecoderConfig, tensor: int, keys: float | None) -> tuple[float, float]:
    """(saved, working) fp32 attention-score bytes per token and layer on one device (``heads /
    tensor`` heads). ``keys`` None: the dense kernel, whose backward keeps the scores and
    probabilities over the whole sequence. Else the key positions per query of the tile a blockwise
    kernel (or a ring step) holds at once: nothing is kept (its backward recomputes the scores from
    the output's log-sum-exp). Either way a layer's backward holds two score-sized buffers (scores
    and probabilities, or their gradients: XLA fuses the rest), fitted with the planner's
    coefficients (docs/memory.md)."""
    scores = cfg.num_heads / tensor * (cfg.seq_len if keys is None else keys) * 4
    return (2 * scores if keys is None else 0.0), 2 * scores


@dataclasses.dataclass(frozen=True)
class BlockCosts(FamilyCosts):
    """The costs the shared blocks fix for any family built of them: the attention's keys and values."""

    def key_value_width(self, block_ways: int) -> float:
        """``kv_heads * head_dim`` keys and as many values per token, the heads split ``block_ways`` ways."""
        return 2 * self.cfg.num_kv_heads * self.cfg.head_dim / block_ways


def normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float) -> jax.Array:
    """fp32 [shape] drawn from N(0, std^2) with the next ``params`` key of ``rngs``."""
    return std * jax.random.normal(rngs.params(), shape, jnp.float32)


class RMSNorm(nnx.Module):
    """x / rms(x) * scale over the last axis (logical ``axis``: ``embed``, or ``head_dim`` for a
    per-head query/key norm), in fp32."""

    def __init__(self, dim: int, eps: float, axis: str = "embed"):
        self.scale = logical_param(jnp.ones((dim,), jnp.float32), (axis,))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def rotary_frequencies(head_dim: int, theta: float,
                       scaling: RopeScalingConfig = RopeScalingConfig()) -> jax.Array:
    """[head_dim // 2] fp32 angular frequencies, rescaled as ``scaling`` says."""
    inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    if scaling.kind is RopeScaling.NONE:
        return inv_freq
    if scaling.kind is RopeScaling.YARN:
        return _yarn_frequencies(inv_freq, head_dim, theta, scaling)
    wavelength = 2 * math.pi / inv_freq
    long_limit = scaling.original_max_len / scaling.low_freq_factor  # longer: divided by factor
    short_limit = scaling.original_max_len / scaling.high_freq_factor  # shorter: kept
    smooth = ((scaling.original_max_len / wavelength - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    between = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    return jnp.where(wavelength > long_limit, inv_freq / scaling.factor,
                     jnp.where(wavelength < short_limit, inv_freq, between))


def rotary_tables(positions: jax.Array, head_dim: int, theta: float,
                  scaling: RopeScalingConfig = RopeScalingConfig()) -> tuple[jax.Array, jax.Array]:
    """cos, sin: [batch or 1, length, head_dim // 2] in fp32 for positions int [batch or 1, length]
    (times YaRN's ``attention_factor``)."""
    angles = positions.astype(jnp.float32)[..., None] * rotary_frequencies(head_dim, theta, scaling)
    factor = scaling.attention_factor
    return jnp.cos(angles) * factor, jnp.sin(angles) * factor


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates x: [batch, length, heads, head_dim] by position (half-split convention, as HF Llama);
    cos, sin: [batch or 1, length, head_dim // 2]."""
    x32 = x.astype(jnp.float32)
    first, second = jnp.split(x32, 2, axis=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query causal self-attention with rotary embeddings."""

    def __init__(self, cfg: GroupedQueryConfig, rngs: nnx.Rngs):
        d, n, k, h = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        in_std, out_std = d ** -0.5, (n * h) ** -0.5 / math.sqrt(2 * cfg.num_layers)
        attention = MatmulGroup.ATTENTION
        self.query = logical_param(normal(rngs, (d, n, h), in_std), ("embed", "heads", "head_dim"), attention)
        self.key = logical_param(normal(rngs, (d, k, h), in_std), ("embed", "kv_heads", "head_dim"), attention)
        self.value = logical_param(normal(rngs, (d, k, h), in_std), ("embed", "kv_heads", "head_dim"), attention)
        self.out = logical_param(normal(rngs, (n, h, d), out_std), ("heads", "head_dim", "embed"), attention)
        self.spec = cfg.attention_spec

    def _project(self, x: jax.Array, rotary: tuple[jax.Array, jax.Array],
                 shard: ActivationSharding) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x: [batch, length, embed] -> rotated q [batch, length, heads, head_dim], rotated k and
        v [batch, length, kv_heads, head_dim]."""
        q = shard(matmul("btd,dnh->btnh", x, self.query[...]), ("batch", "length", "heads", "head_dim"))
        k = shard(matmul("btd,dkh->btkh", x, self.key[...]), KV_AXES)
        v = shard(matmul("btd,dkh->btkh", x, self.value[...]), KV_AXES)
        q, k = self._normalize_heads(q, k)
        q = checkpoint_name(apply_rotary(q, *rotary), "query")
        k = checkpoint_name(apply_rotary(k, *rotary), "key")
        return q, k, checkpoint_name(v, "value")

    def _output(self, attended: jax.Array, shard: ActivationSharding) -> jax.Array:
        attended = checkpoint_name(shard(attended, ("batch", "length", "heads", "head_dim")), "attention")
        return matmul("btnh,nhd->btd", attended, self.out[...])

    def _normalize_heads(self, q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Queries and keys before the rotary embedding (here unchanged; ``QKNormAttention`` norms them)."""
        return q, k

    def __call__(self, x: jax.Array, rotary: tuple[jax.Array, jax.Array], positions: jax.Array,
                 segments: jax.Array | None, shard: ActivationSharding) -> jax.Array:
        """x: [batch, length, embed] -> [batch, length, embed]: causal attention over the row (by
        ``positions``, int [batch or 1, length]), within each document of ``segments`` (int [batch,
        length]) when given and the sliding window if any, by the framework's scheme
        (``shard.attend``: ``models.kernels.attention.attend`` or ring attention)."""
        q, k, v = self._project(x, rotary, shard)
        return self._output(shard.attend(q, k, v, positions, segments, self.spec), shard)

    def cached(self, x: jax.Array, rotary: tuple[jax.Array, jax.Array], keys: jax.Array,
               values: jax.Array, start: jax.Array, shard: ActivationSharding
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x: [batch, length, embed] at positions start.. ; keys, values: this layer's cache
        [batch, max_len, kv_heads, head_dim]. Writes the new keys/values at ``start`` and attends
        causally (and within the sliding window) over the cache. Returns (output [batch, length,
        embed], keys, values)."""
        q, k, v = self._project(x, rotary, shard)
        keys = jax.lax.dynamic_update_slice(keys, k.astype(keys.dtype), (0, start, 0, 0))
        values = jax.lax.dynamic_update_slice(values, v.astype(values.dtype), (0, start, 0, 0))
        visible = attention_mask(start + jnp.arange(x.shape[1]), jnp.arange(keys.shape[1]), window=self.spec.window)
        attended = jax.nn.dot_product_attention(q, keys.astype(q.dtype), values.astype(q.dtype), mask=visible)
        return self._output(attended, shard), keys, values


class QKNormAttention(Attention):
    """The shared attention, with Qwen3's RMSNorm of each query and key head (over ``head_dim``,
    before the rotary embedding, with the config's ``norm_eps``) when ``cfg.qk_norm``; exactly
    ``Attention`` otherwise."""

    def __init__(self, cfg: GroupedQueryConfig, rngs: nnx.Rngs):
        super().__init__(cfg, rngs)
        self.query_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, "head_dim") if cfg.qk_norm else None
        self.key_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, "head_dim") if cfg.qk_norm else None

    def _normalize_heads(self, q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
        if self.query_norm is None:
            return q, k
        return self.query_norm(q), self.key_norm(k)


class SwiGLU(nnx.Module):
    """SwiGLU feed-forward, down(silu(x @ gate) * (x @ up)), over [embed, mlp] with ``hidden`` units
    (a dense layer's MLP, or a mixture's shared experts)."""

    def __init__(self, cfg: DecoderConfig, hidden: int, rngs: nnx.Rngs):
        d, m = cfg.embed_dim, hidden
        self.gate = logical_param(normal(rngs, (d, m), d ** -0.5), ("embed", "mlp"), MatmulGroup.MLP)
        self.up = logical_param(normal(rngs, (d, m), d ** -0.5), ("embed", "mlp"), MatmulGroup.MLP)
        self.down = logical_param(normal(rngs, (m, d), m ** -0.5 / math.sqrt(2 * cfg.num_layers)),
                                  ("mlp", "embed"), MatmulGroup.MLP)

    def __call__(self, x: jax.Array, shard: ActivationSharding) -> jax.Array:
        """x: [batch, length, embed] -> [batch, length, embed]."""
        hidden = jax.nn.silu(matmul("btd,dm->btm", x, self.gate[...])) * matmul("btd,dm->btm", x, self.up[...])
        hidden = checkpoint_name(shard(hidden, ("batch", "length", "mlp")), "mlp_hidden")
        return matmul("btm,md->btd", hidden, self.down[...])


class PreNormLayer(nnx.Module):
    """Pre-norm residual layer: x + attention(attn_norm(x)), then ``feed_forward`` (which adds its
    block's output of ``mlp_norm(x)`` to x). A subclass builds ``attn_norm``, ``attention`` (an
    ``Attention``), ``mlp_norm`` and its feed-forward block, and defines ``feed_forward``."""

    attn_norm: RMSNorm
    attention: Attention
    mlp_norm: RMSNorm

    def feed_forward(self, x: jax.Array, shard: ActivationSharding, generating: bool = False
                     ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """x [batch, length, embed] -> (x + the block's output, this layer's statistics);
        ``generating``: the call comes from the cached (generation) path."""
        raise NotImplementedError

    def __call__(self, x: jax.Array, rotary: tuple[jax.Array, jax.Array], positions: jax.Array,
                 segments: jax.Array | None, shard: ActivationSharding) -> tuple[jax.Array, dict[str, jax.Array]]:
        """-> (x, this layer's statistics)."""
        x = shard(x + self.attention(self.attn_norm(x), rotary, positions, segments, shard), RESIDUAL_AXES)
        return self.feed_forward(x, shard)

    def cached(self, x: jax.Array, rotary: tuple[jax.Array, jax.Array], keys: jax.Array,
               values: jax.Array, start: jax.Array, shard: ActivationSharding
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The layer at positions start.. with this layer's KV cache (see ``Attention.cached``)."""
        attended, keys, values = self.attention.cached(self.attn_norm(x), rotary, keys, values, start, shard)
        x, _ = self.feed_forward(shard(x + attended, RESIDUAL_AXES), shard, generating=True)
        return x, keys, values


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Keys and values of the positions seen so far: [layers, batch, max_len, kv_heads, head_dim]."""

    keys: jax.Array
    values: jax.Array


class Decoder(nnx.Module):
    """Token ids [batch, length] -> logits [batch, length, vocab] (fp32: the head's sums are kept).

    A family sets ``layer_class``: ``layer_class(cfg, rngs)`` builds each layer, ``layer(x, rotary,
    positions, segments, shard) -> (x, statistics)`` and ``layer.cached(...)`` as ``PreNormLayer``'s.
    """

    layer_class: type[PreNormLayer]

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embedding = logical_param(normal(rngs, (cfg.vocab_size, cfg.embed_dim), cfg.init_std),
                                       ("vocab", "embed"))

        self.layers = stacked_layers(lambda layer_rngs: self.layer_class(cfg, layer_rngs), cfg.num_layers, rngs)
        self.final_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps)
        self.head = None if cfg.tie_embeddings else logical_param(
            normal(rngs, (cfg.embed_dim, cfg.vocab_size), cfg.embed_dim ** -0.5), ("embed", "vocab"))

    def __call__(self, tokens: jax.Array, shard: ActivationSharding = unconstrained,
                 documents: Documents | None = None) -> jax.Array:
        """tokens: [batch, length] -> logits [batch, length, vocab]."""
        return forward(self, tokens, shard, documents)

    # The three pieces of ``models.api.DecoderModel``: a pipeline runs the stacked layers over
    # stages while the embedding and the head stay outside the stage loop.

    def embed(self, tokens: jax.Array, shard: ActivationSharding = unconstrained,
              documents: Documents | None = None) -> jax.Array:
        """tokens: [batch, length] -> x: [batch, length, embed] (``documents`` unused: positions
        enter through the rotary embeddings)."""
        del documents
        return shard.lookup(self.embedding[...], tokens, RESIDUAL_AXES)

    def run_layers(self, x: jax.Array, shard: ActivationSharding = unconstrained,
                   documents: Documents | None = None) -> tuple[jax.Array, LayerAux]:
        """Applies every layer this module holds (``layers`` may be a pipeline stage's slice) in
        order with ``lax.scan`` and the configured remat policy: [batch, length, embed] -> same,
        and the auxiliary terms (here none: ``no_aux()``; a family with some overrides this). With
        ``documents``, rotary positions restart at each document and attention stays within it."""
        x, _ = self._scan_layers(x, shard, documents)
        return x, no_aux()

    def _scan_layers(self, x: jax.Array, shard: ActivationSharding, documents: Documents | None,
                     layers: nnx.Module | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        """x through the stacked ``layers`` (default: ``self.layers``) -> (x, each layer's statistics
        stacked on a leading layers axis)."""
        cfg = self.cfg
        positions = positions_of(documents, x.shape[1])
        rotary = rotary_tables(positions, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        segments = None if documents is None else documents.segments
        layer_def, layer_state = nnx.split(self.layers if layers is None else layers)

        def run_layer(x: jax.Array, one_layer_state) -> tuple[jax.Array, dict[str, jax.Array]]:
            return nnx.merge(layer_def, one_layer_state)(x, rotary, positions, segments, shard)

        # Per-layer statistics are scan outputs, not a carry (a carry would not be stage-varying).
        return jax.lax.scan(cfg.remat.wrap(run_layer, cfg.remat_names), x, layer_state)

    def logits(self, x: jax.Array, shard: ActivationSharding = unconstrained) -> jax.Array:
        """x: [batch, length, embed] -> logits [batch, length, vocab] in fp32 (the head's fp32 sums,
        not rounded to the compute dtype)."""
        return self.vocab_logits(self.head_input(x, shard), shard)

    def head_input(self, x: jax.Array, shard: ActivationSharding = unconstrained) -> jax.Array:
        """x [batch, length, embed] -> the final norm's output, the head's input [batch, length, embed]."""
        return self.final_norm(shard(x, HEAD_AXES))  # whole positions: the vocabulary may split over tensor

    def head_weight(self) -> jax.Array:
        """The output head's weight [embed, vocab] (the tied embedding's transpose)."""
        return self.embedding[...].T if self.head is None else self.head[...]

    def vocab_logits(self, normed: jax.Array, shard: ActivationSharding = unconstrained) -> jax.Array:
        """The output head alone: normed [batch, length, embed] -> fp32 logits [batch, length, vocab]."""
        return head_logits(normed, self.head_weight(), shard)

    def init_cache(self, batch: int, max_len: int, dtype: jnp.dtype = jnp.float32) -> KVCache:
        """An empty cache for ``batch`` sequences of up to ``max_len`` positions."""
        cfg = self.cfg
        shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    def cached_forward(self, tokens: jax.Array, cache: KVCache, start: jax.Array,
                       shard: ActivationSharding = unconstrained) -> tuple[jax.Array, KVCache]:
        """tokens: [batch, length] at positions start..start+length-1, attending to the cache's
        positions < start and causally among themselves -> (logits [batch, length, vocab], the
        cache with these positions written). A prompt is one call at ``start=0``; each generated
        token is one call of length 1."""
        cfg = self.cfg
        x = self.embed(tokens, shard)
        rotary = rotary_tables(start + jnp.arange(tokens.shape[1])[None], cfg.head_dim, cfg.rope_theta,
                               cfg.rope_scaling)
        x, keys, values = self._scan_cached(self.layers, x, rotary, cache.keys, cache.values, start, shard)
        return self.logits(x, shard), KVCache(keys, values)

    @staticmethod
    def _scan_cached(layers: nnx.Module, x: jax.Array, rotary: tuple[jax.Array, jax.Array], keys: jax.Array,
                     values: jax.Array, start: jax.Array, shard: ActivationSharding
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x through the stacked ``layers``' cached paths (``layer.cached``), each with its slice of the
        cache arrays ``keys`` and ``values`` [layers, ...] -> (x, keys, values) with the positions written."""
        layer_def, layer_state = nnx.split(layers)

        def run_layer(x: jax.Array, layer_and_cache) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
            one_layer_state, keys, values = layer_and_cache
            x, keys, values = nnx.merge(layer_def, one_layer_state).cached(x, rotary, keys, values,
                                                                           start, shard)
            return x, (keys, values)

        x, (keys, values) = jax.lax.scan(run_layer, x, (layer_state, keys, values))
        return x, keys, values


class DecoderLayer(PreNormLayer):
    """Pre-norm residual layer: x + attention(norm(x)) (``attention_class``: by default queries and
    keys normed per head when ``qk_norm``), then + mlp(norm(x))."""

    attention_class: type[nnx.Module] = QKNormAttention  # built as attention_class(cfg, rngs)

    def __init__(self, cfg, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps)
        self.attention = self.attention_class(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps)
        self.mlp = SwiGLU(cfg, cfg.mlp_dim, rngs)

    def feed_forward(self, x: jax.Array, shard: ActivationSharding, generating: bool = False
                     ) -> tuple[jax.Array, dict]:
        """-> (x + mlp(mlp_norm(x)), this layer's statistics: none)."""
        del generating
        return shard(x + self.mlp(self.mlp_norm(x), shard), RESIDUAL_AXES), {}


# How the shared blocks' logical axes map to mesh axes (``models.api.AxisRole``): attention heads and
# MLP units split by tensor parallelism, the head width kept whole.
BLOCK_AXIS_ROLES = {"heads": AxisRole.TENSOR, "kv_heads": AxisRole.TENSOR, "head_dim": AxisRole.REPLICATED,
                    "mlp": AxisRole.TENSOR}

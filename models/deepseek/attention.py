"""Multi-head latent attention (MLA, DeepSeek-V2/V3) in Flax NNX, annotated with logical axes only.

Queries come through a low-rank bottleneck (``q_lora_rank``; a plain projection when 0); keys and
values through one compressed latent per token (``kv_lora_rank`` values, RMS-normed) expanded per
head, plus one rotary key part (``qk_rope_head_dim``) shared by every head. Each head's query and
key are ``[nope | rope]``: ``qk_nope_head_dim`` values without position and ``qk_rope_head_dim``
rotated ones. Values have ``v_head_dim``.

Parameters (logical axes; ``latent`` is the bottleneck's width, never split, and ``latent_in`` the
same width where it enters an up-projection, which FSDP splits as it splits ``embed``; ``heads``
splits over tensor parallelism as Llama's)::

    query_down   [embed, latent]                 q_a_proj     (q_lora_rank > 0)
    query_norm   [latent]                        q_a_layernorm
    query_up     [latent_in, heads, head_dim]    q_b_proj, head_dim = nope + rope
    query        [embed, heads, head_dim]        q_proj       (q_lora_rank = 0)
    latent_down  [embed, latent]                 kv_a_proj_with_mqa, latent = kv_lora_rank + rope
    latent_norm  [latent]                        kv_a_layernorm (kv_lora_rank)
    latent_up    [latent_in, heads, head_dim]    kv_b_proj, head_dim = nope + v
    out          [heads, head_dim, embed]     o_proj, head_dim = v

Training expands the latent into per-head keys and values and calls the framework's attention
(``shard.attend``: any kernel, ring attention, packed documents), so it works wherever Llama's does.
Values keep ``v_head_dim`` (DeepSeek-V3's 128 < the queries' 192) in the blockwise and ring
kernels; the dense and cuDNN kernels pad them to the query width (``models/kernels/attention.py``), which
costs ``(qk - v) / (qk + v)`` more score-and-value FLOPs than the ideal there. Generation keeps only the
latent and the rotary key per position (``kv_lora_rank + qk_rope_head_dim`` values per token and
layer) and attends in the latent space, the key and value up-projections absorbed into the query and
the output (``cached``).

The softmax scale is ``qk_head_dim ** -0.5`` times YaRN's ``mscale(factor, mscale_all_dim) ** 2``
when the rotary scaling is YaRN (``RopeScalingConfig.softmax_scale``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from models.kernels.attention import attention_mask
from models.blocks import KV_AXES, RMSNorm, apply_rotary, normal
from models.common import ActivationSharding, logical_param, matmul
from models.kernels.fp8 import MatmulGroup

QUERY_AXES = ("batch", "length", "heads", "head_dim")


def interleaved_to_halves(x: jax.Array) -> jax.Array:
    """[..., rope] with rotary pairs interleaved (x0, x1), (x2, x3), ... -> the half-split order
    ``apply_rotary`` rotates (evens, then odds): DeepSeek's ``rope_interleave`` checkpoints. Only
    dot products of rotated queries and keys are used, so both permuted alike give the same scores."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


ATTENTION = MatmulGroup.ATTENTION  # the group of every projection here (train.fp8.matmuls)


class LatentAttention(nnx.Module):
    """Causal multi-head latent attention (module docstring); ``cfg`` a ``DeepSeekConfig``."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        d, n = cfg.embed_dim, cfg.num_heads
        nope, rope, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        qk = nope + rope
        self.nope, self.rope, self.v = nope, rope, v
        self.kv_rank = cfg.kv_lora_rank
        self.interleaved = cfg.rope_interleave
        self.spec = cfg.attention_spec
        self.scale = cfg.rope_scaling.softmax_scale(qk)
        if cfg.q_lora_rank:
            r = cfg.q_lora_rank
            self.query_down = logical_param(normal(rngs, (d, r), d ** -0.5), ("embed", "latent"), ATTENTION)
            self.query_norm = RMSNorm(r, cfg.norm_eps, "latent")
            self.query_up = logical_param(normal(rngs, (r, n, qk), r ** -0.5), ("latent_in", "heads", "head_dim"),
                                          ATTENTION)
            self.query = None
        else:
            self.query_down = self.query_norm = self.query_up = None
            self.query = logical_param(normal(rngs, (d, n, qk), d ** -0.5), ("embed", "heads", "head_dim"), ATTENTION)
        self.latent_down = logical_param(normal(rngs, (d, cfg.kv_lora_rank + rope), d ** -0.5),
                                         ("embed", "latent"), ATTENTION)
        self.latent_norm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps, "latent")
        self.latent_up = logical_param(normal(rngs, (cfg.kv_lora_rank, n, nope + v), cfg.kv_lora_rank ** -0.5),
                                       ("latent_in", "heads", "head_dim"), ATTENTION)
        self.out = logical_param(normal(rngs, (n, v, d), (n * v) ** -0.5 / math.sqrt(2 * cfg.num_layers)),
                                 ("heads", "head_dim", "embed"), ATTENTION)

    def _rotate(self, x: jax.Array, rotary: tuple[jax.Array, jax.Array]) -> jax.Array:
        """x [batch, length, heads, rope] rotated by position."""
        return apply_rotary(interleaved_to_halves(x) if self.interleaved else x, *rotary)

    def _queries(self, x: jax.Array, rotary: tuple[jax.Array, jax.Array], shard: ActivationSharding
                 ) -> tuple[jax.Array, jax.Array]:
        """x [batch, length, embed] -> (q_nope [batch, length, heads, nope], rotated q_rope [..., rope])."""
        if self.query is not None:
            q = matmul("btd,dnh->btnh", x, self.query[...])
        else:
            compressed = self.query_norm(matmul("btd,dr->btr", x, self.query_down[...]))
            q = matmul("btr,rnh->btnh", compressed, self.query_up[...])
        q = shard(q, QUERY_AXES)
        return q[..., :self.nope], self._rotate(q[..., self.nope:], rotary)

    def _latent(self, x: jax.Array, rotary: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        """x [batch, length, embed] -> (the normed latent [batch, length, kv_lora_rank], the rotated
        shared key [batch, length, rope]): what the cache keeps per position."""
        down = matmul("btd,dc->btc", x, self.latent_down[...])
        latent = self.latent_norm(down[..., :self.kv_rank])
        rope_key = self._rotate(down[..., None, self.kv_rank:], rotary)[:, :, 0]
        return latent, rope_key

    def _output(self, attended: jax.Array, shard: ActivationSharding) -> jax.Array:
        """attended [batch, length, heads, v] -> [batch, length, embed]."""
        attended = checkpoint_name(shard(attended, QUERY_AXES), "attention")
        return matmul("btnh,nhd->btd", attended, self.out[...])

    def __call__(self, x: jax.Array, rotary: tuple[jax.Array, jax.Array], positions: jax.Array,
                 segments: jax.Array | None, shard: ActivationSharding) -> jax.Array:
        """x [batch, length, embed] -> [batch, length, embed]: causal attention by the framework's
        kernel (``shard.attend``) over keys and values expanded from the latent."""
        q_nope, q_rope = self._queries(x, rotary, shard)
        latent, rope_key = self._latent(x, rotary)
        kv = matmul("btc,cnh->btnh", latent, self.latent_up[...])
        heads = kv.shape[2]
        k = jnp.concatenate([kv[..., :self.nope],
                             jnp.broadcast_to(rope_key[:, :, None], (*rope_key.shape[:2], heads, self.rope))], -1)
        v = kv[..., self.nope:]
        qk = self.nope + self.rope
        # The kernels scale scores by qk ** -0.5: the rest of the softmax scale goes into the queries.
        q = jnp.concatenate([q_nope, q_rope], -1) * jnp.asarray(self.scale * math.sqrt(qk), q_nope.dtype)
        q = checkpoint_name(shard(q, QUERY_AXES), "query")
        k = checkpoint_name(shard(k, KV_AXES), "key")
        v = checkpoint_name(shard(v, KV_AXES), "value")
        attended = shard.attend(q, k, v, positions, segments, self.spec)
        return self._output(attended, shard)

    def cached(self, x: jax.Array, rotary: tuple[jax.Array, jax.Array], latents: jax.Array,
               rope_keys: jax.Array, start: jax.Array, shard: ActivationSharding
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [batch, length, embed] at positions start.. with this layer's compressed cache: latents
        [batch, max_len, kv_lora_rank], rope_keys [batch, max_len, rope]. Writes the new positions
        and attends causally in the latent space: the key up-projection absorbed into the queries
        (``q_nope @ W_k^T`` per head), the value up-projection applied after the weighted sum of
        latents. Returns (output [batch, length, embed], latents, rope_keys)."""
        q_nope, q_rope = self._queries(x, rotary, shard)
        latent, rope_key = self._latent(x, rotary)
        latents = jax.lax.dynamic_update_slice(latents, latent.astype(latents.dtype), (0, start, 0))
        rope_keys = jax.lax.dynamic_update_slice(rope_keys, rope_key.astype(rope_keys.dtype), (0, start, 0))
        up = self.latent_up[...].astype(jnp.float32)
        cached_latents, cached_rope = latents.astype(jnp.float32), rope_keys.astype(jnp.float32)
        absorbed = jnp.einsum("btnh,cnh->btnc", q_nope.astype(jnp.float32), up[..., :self.nope])
        scores = (jnp.einsum("btnc,bsc->bnts", absorbed, cached_latents)
                  + jnp.einsum("btnh,bsh->bnts", q_rope.astype(jnp.float32), cached_rope)) * self.scale
        visible = attention_mask(start + jnp.arange(x.shape[1]), jnp.arange(latents.shape[1]))
        probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
        mixed = jnp.einsum("bnts,bsc->btnc", probs, cached_latents)
        attended = jnp.einsum("btnc,cnh->btnh", mixed, up[..., self.nope:]).astype(x.dtype)
        return self._output(attended, shard), latents, rope_keys

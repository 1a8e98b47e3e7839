"""DeepSeek-V3's multi-token prediction (MTP) modules, annotated with logical axes only.

Depth ``k`` (1..``mtp_layers``) predicts, at position t, the token k + 1 positions after t's own
target (t + k + 1). It combines the previous depth's stream ``h`` (depth 0: the main model's last
layer output, before the final norm) with the embedding of token t + k::

    h_k = layer_k(project_k([embed_norm_k(embedding[token t+k]) ; hidden_norm_k(h_{k-1})]))

and reads its prediction from ``head_norm_k(h_k)`` through the model's output head (shared, as the
embedding is). ``layer_k`` is a mixture-of-experts layer like the model's. Parameters, stacked on
a leading ``mtp_layers`` axis (``AxisRole.STACKED``)::

    mtp.embed_norm.scale, hidden_norm.scale, head_norm.scale   [mtp_layers, embed]
    mtp.project        [mtp_layers, mtp_inputs=2, mtp_embed, embed]   (DeepSeek's eh_proj)
    mtp.layer.*        [mtp_layers, ...]  a SparseLayer's

The framework adds ``mtp_loss_coef`` times the mean over depths of their token losses to the
objective (``meshtrain.loss.ahead_loss``), and the layers' auxiliary losses (load balancing, the
routing bias's direction).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.api import AUX_LOSS, RESIDUAL_AXES, Documents, LayerAux, positions_of
from models.blocks import RMSNorm, normal, rotary_tables
from models.common import ActivationSharding, logical_param, matmul


class PredictionDepth(nnx.Module):
    """One multi-token prediction module (module docstring); ``layer_class`` builds its layer."""

    def __init__(self, cfg, layer_class, rngs: nnx.Rngs):
        d = cfg.embed_dim
        self.embed_norm = RMSNorm(d, cfg.norm_eps)
        self.hidden_norm = RMSNorm(d, cfg.norm_eps)
        self.project = logical_param(normal(rngs, (2, d, d), (2 * d) ** -0.5), ("mtp_inputs", "mtp_embed", "embed"))
        self.layer = layer_class(cfg, rngs)
        self.head_norm = RMSNorm(d, cfg.norm_eps)

    def __call__(self, embedded: jax.Array, previous: jax.Array, rotary: tuple[jax.Array, jax.Array],
                 positions: jax.Array, segments: jax.Array | None, shard: ActivationSharding
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """embedded, previous [batch, length, embed] -> (this depth's stream [batch, length, embed],
        its layer's statistics)."""
        both = jnp.stack([self.embed_norm(embedded), self.hidden_norm(previous)], axis=2)
        h = shard(matmul("btie,ied->btd", both, self.project[...]), RESIDUAL_AXES)
        return self.layer(h, rotary, positions, segments, shard)


def predict_ahead(model, x: jax.Array, ahead_inputs: jax.Array, shard: ActivationSharding,
                  documents: Documents | None) -> tuple[jax.Array, LayerAux]:
    """``models.api.PredictsAhead.predict_ahead`` of a model with ``model.mtp`` (stacked
    ``PredictionDepth``s), ``model.embedding`` and the MoE family's config fields: x [batch, length,
    embed] (the last layer's output), ahead_inputs int [depths, batch, length] (depth k's token
    t + k at position t) -> (the depths' normed streams [depths, batch, length, embed], {AUX_LOSS:
    their layers' auxiliary loss})."""
    cfg = model.cfg
    positions = positions_of(documents, x.shape[1])
    rotary = rotary_tables(positions, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    segments = None if documents is None else documents.segments
    depth_def, depth_state = nnx.split(model.mtp)

    def run_depth(previous: jax.Array, depth_and_inputs) -> tuple[jax.Array, tuple[jax.Array, dict]]:
        one_depth_state, inputs = depth_and_inputs
        embedded = shard.lookup(model.embedding[...], inputs, RESIDUAL_AXES)
        depth = nnx.merge(depth_def, one_depth_state)
        h, stats = depth(embedded, previous, rotary, positions, segments, shard)
        return h, (depth.head_norm(h), stats)

    _, (streams, stats) = jax.lax.scan(cfg.remat.wrap(run_depth, cfg.remat_names), x, (depth_state, ahead_inputs))
    aux = (cfg.load_balancing_coef * jnp.sum(stats["load_balancing"]) + cfg.z_loss_coef * jnp.sum(stats["z_loss"])
           + jnp.sum(stats["bias_direction"]))
    return streams, {AUX_LOSS: aux}

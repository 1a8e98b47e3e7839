"""The training objective: the token cross-entropy, the ``Objective`` of a microbatch and ``head_loss``,
the model's head and the token loss over chunks of positions (``train.loss_chunk``).

``head_loss`` never holds the fp32 logits of every position: a ``lax.scan`` over chunks of
positions runs ``model.logits`` and the objective's token loss on one chunk at a time and sums them,
its body under ``jax.checkpoint``, so the backward recomputes one chunk's logits at a time too. At
most one chunk's fp32 ``[rows, chunk, vocab]`` logits, softmax and gradient are live, in place of
three ``[rows, length, vocab]`` arrays; the head's weight gradient accumulates through the scan as
autodiff does (in the compute dtype). Chunk j holds positions j, j + n, j + 2n, ... of the n chunks
(strided, as ``split_microbatches`` takes rows), so where the rules split ``length`` over devices
each device keeps its share of every chunk and nothing moves; under tensor parallelism the logits
stay split over ``vocab`` and the loss reduces over the split vocabulary (no device gathers it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from flax import nnx

from meshtrain.precision import LossScale, cast_floating
from models.api import AUX_LOSS, MTP_LOSS, Documents, LayerAux, PredictsAhead
from models.common import ActivationSharding

Batch = dict[str, jax.Array]  # the step's arrays by name: inputs, targets, mask [rows, length], ...
# params (in the compute dtype, possibly one stage's slice of the layers) -> the model on them.
ModelOf = Callable[[nnx.State], Any]
# (params, microbatch) -> (its loss, the layers' aux terms).
Loss = Callable[[nnx.State, Batch], tuple[jax.Array, LayerAux]]

# The head's input: whole positions, as ``DecoderModel.logits`` takes them.
HEAD_AXES = ("batch", "length", "embed")


def cross_entropy_sum(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> jax.Array:
    """Sum over [batch, length] of masked token cross-entropy, in fp32."""
    logits = logits.astype(jnp.float32)
    # A one-hot contraction rather than a gather: it partitions cleanly when vocab is split over
    # `tensor`, also inside a pipeline stage (XLA's partitioner aborts on the gather there).
    target_logits = jnp.sum(logits * jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype), axis=-1)
    losses = jax.nn.logsumexp(logits, axis=-1) - target_logits
    return jnp.sum(losses * mask)


@dataclasses.dataclass(frozen=True)
class Objective:
    """The two (linear) terms of one microbatch's scaled, normalised loss, and the chunks the token
    term is computed in.

    of_logits: (logits [batch, positions, vocab], the microbatch's [batch, positions] arrays at those
    positions) -> the token loss (a sum over tokens, so any split of the tokens adds up to it).
    of_aux: the layers' auxiliary-loss sum over the microbatch's rows (``aux[AUX_LOSS]`` of
    ``DecoderModel.run_layers``) -> its share of the loss.
    loss_chunk: positions per chunk and row (``train.loss_chunk``; 0: all positions at once).
    length_ways: how many ways the rules split ``length`` over the mesh: each chunk keeps that split.
    predicts_ahead: whether a model's multi-token prediction (``models.api.PredictsAhead``) is part
    of it (training: yes; evaluation: the main loss alone).
    """

    of_logits: Callable[[jax.Array, Batch], jax.Array]
    of_aux: Callable[[jax.Array], jax.Array]
    loss_chunk: int = 0
    length_ways: int = 1
    predicts_ahead: bool = False

    @classmethod
    def training(cls, target_count: jax.Array, rows: int, loss_scale: LossScale, loss_chunk: int,
                 length_ways: int) -> Objective:
        """The train step's objective on a global batch of ``rows`` rows and ``target_count`` target
        tokens: the token cross-entropy summed over a microbatch's tokens / ``target_count``, the
        layers' aux losses as a mean over rows, multi-token prediction included, all scaled by
        ``loss_scale`` (fp16); so the microbatches' terms sum to the step's loss."""
        def of_logits(logits: jax.Array, microbatch: Batch) -> jax.Array:
            loss = cross_entropy_sum(logits, microbatch["targets"], microbatch["mask"]) / target_count
            return loss_scale.scale_loss(loss)

        def of_aux(aux_sum: jax.Array) -> jax.Array:
            return loss_scale.scale_loss(aux_sum.astype(jnp.float32) / rows)

        return cls(of_logits, of_aux, loss_chunk, length_ways, predicts_ahead=True)

    @classmethod
    def evaluation(cls, loss_chunk: int, length_ways: int) -> Objective:
        """The evaluation's objective: the summed token cross-entropy alone (no aux terms, no
        multi-token prediction)."""
        return cls(lambda logits, mb: cross_entropy_sum(logits, mb["targets"], mb["mask"]),
                   lambda aux_sum: jnp.zeros((), jnp.float32), loss_chunk, length_ways)

    def of_layers(self, aux: LayerAux) -> jax.Array:
        """The share of the loss of the layers' aux terms ``aux``."""
        return self.of_aux(aux[AUX_LOSS])

    def chunk_length(self, length: int) -> int:
        """Positions per chunk of a head over ``length`` positions: see ``chunk_length``."""
        return chunk_length(length, self.loss_chunk, self.length_ways)


def chunk_length(length: int, loss_chunk: int, length_ways: int = 1) -> int:
    """Positions per chunk: the largest divisor of ``length`` not above ``loss_chunk`` that is a
    multiple of ``length_ways`` (every device then holds an equal share of each chunk; at least
    ``length_ways`` positions); ``length`` when ``loss_chunk`` is 0 or at least ``length``. A length
    with no divisor near ``loss_chunk`` (e.g. a prime) runs in many small chunks."""
    if loss_chunk <= 0 or loss_chunk >= length:
        return length
    ways = length_ways if length % length_ways == 0 else 1
    local = length // ways
    return ways * max(d for d in range(1, max(loss_chunk // ways, 1) + 1) if local % d == 0)


def _strided(x: jax.Array, chunks: int) -> jax.Array:
    """[batch, length, ...] -> [chunks, batch, length / chunks, ...]: chunk j holds positions j,
    j + chunks, j + 2 chunks, ... (a device holding a contiguous block of positions holds its block's
    share of every chunk)."""
    rows, length = x.shape[:2]
    return jnp.moveaxis(x.reshape(rows, length // chunks, chunks, *x.shape[2:]), 2, 0)


def head_loss(logits_of: Callable[[jax.Array, ActivationSharding], jax.Array], x: jax.Array, batch: Batch,
              shard: ActivationSharding, objective: Objective) -> jax.Array:
    """The token loss ``objective.of_logits`` of a head ``logits_of`` (the model's ``logits``, or a
    prediction depth's ``ahead_logits``) on ``x`` [batch, length, embed] (the layers' output), in
    chunks of ``objective.chunk_length(length)`` positions per row (see the module docstring).
    ``batch``: the microbatch's [batch, length] arrays at the same positions."""
    def chunk_loss(x_chunk: jax.Array, batch_chunk: Batch) -> jax.Array:
        return objective.of_logits(logits_of(x_chunk, shard), batch_chunk)

    length = x.shape[1]
    chunks = length // objective.chunk_length(length)
    if chunks == 1:
        return chunk_loss(x, batch)
    x_chunks = shard(_strided(shard(x, HEAD_AXES), chunks), (None, *HEAD_AXES))
    # prevent_cse off: inside a scan nothing can merge the backward's recomputation with the forward.
    # The chunks' losses are the scan's outputs, not a carry (inside a pipeline stage a fresh carry
    # would not be varying over the stage axis).
    remat_loss = jax.checkpoint(chunk_loss, prevent_cse=False)
    _, losses = jax.lax.scan(lambda _, chunk: (None, remat_loss(*chunk)), None,
                             (x_chunks, jax.tree.map(lambda a: _strided(a, chunks), batch)))
    return jnp.sum(losses)


def documents_of(batch: Batch) -> Documents | None:
    """The batch's document layout (``positions`` and ``segments`` [rows, length]) when its rows are
    packed from several documents, else None."""
    return Documents(batch["positions"], batch["segments"]) if "segments" in batch else None


def sequential_loss(model_of: ModelOf, objective: Objective, shard: ActivationSharding, compute_dtype) -> Loss:
    """No pipeline: the whole model's loss (the head's in the objective's chunks of positions)."""

    def loss(params: nnx.State, batch: Batch) -> tuple[jax.Array, LayerAux]:
        model, documents = model_of(cast_floating(params, compute_dtype)), documents_of(batch)
        x, aux = model.run_layers(model.embed(batch["inputs"], shard, documents), shard, documents)
        ahead, ahead_aux = ahead_loss(model, x, batch, shard, objective, documents)
        loss = head_loss(model.logits, x, batch, shard, objective) + objective.of_layers(aux) + ahead
        return loss, {**aux, **ahead_aux}

    return loss


def ahead_key(name: str, depth: int) -> str:
    """The batch key of ``name`` (inputs, targets, mask) ``depth`` positions later."""
    return f"{name}+{depth}"


def with_ahead_targets(batch: Batch, depths: int) -> Batch:
    """``batch`` (rows in sequence order) with, for each depth k in 1..``depths``, its inputs, targets
    and mask k positions later (``ahead_key``; zero past the row's end, and the mask zero where that
    position lies in another document of a packed row): what multi-token prediction reads. Made
    before anything permutes the positions (ring attention's balanced order), so that it follows the
    tokens."""
    later = lambda a, k: jnp.pad(a[:, k:], [(0, 0), (0, k)])
    out = dict(batch)
    for k in range(1, depths + 1):
        mask = later(batch["mask"], k)
        if "segments" in batch:
            mask = mask * (later(batch["segments"], k) == batch["segments"])
        out.update({ahead_key("inputs", k): later(batch["inputs"], k),
                    ahead_key("targets", k): later(batch["targets"], k),
                    ahead_key("mask", k): mask.astype(batch["mask"].dtype)})
    return out


def ahead_loss(model, x: jax.Array, batch: Batch, shard: ActivationSharding, objective: Objective,
               documents: Documents | None) -> tuple[jax.Array, LayerAux]:
    """Multi-token prediction's share of the loss (``models.api.PredictsAhead``) on the layers'
    output ``x`` [batch, length, embed] and its statistic: (``ahead_weight`` x the mean over depths
    of their token losses + the depths' auxiliary loss, {MTP_LOSS: that mean}); (0, {}) for a model
    without it or an objective that leaves it out. ``batch`` holds the depths' arrays
    (``with_ahead_targets``); each depth's head runs in the objective's chunks."""
    if not (objective.predicts_ahead and isinstance(model, PredictsAhead) and model.ahead_depths):
        return jnp.zeros((), jnp.float32), {}
    depths = range(1, model.ahead_depths + 1)
    streams, aux = model.predict_ahead(x, jnp.stack([batch[ahead_key("inputs", k)] for k in depths]), shard, documents)
    losses = [head_loss(model.ahead_logits, streams[k - 1],
                        {"targets": batch[ahead_key("targets", k)], "mask": batch[ahead_key("mask", k)]}, shard,
                        objective) for k in depths]
    mean = sum(losses) / len(losses)
    return model.ahead_weight * mean + objective.of_layers(aux), {MTP_LOSS: mean}

"""The training objective: the token cross-entropy, the ``Objective`` of a microbatch and ``head_loss``,
the model's output head and the token loss over chunks of the vocabulary (``train.loss_chunk``).

``head_loss`` never holds the fp32 logits of the whole vocabulary: a ``lax.scan`` over chunks of the
head weight's columns projects every position onto one chunk at a time and carries the softmax's
pieces online (the running max, the sum of exponentials, the target's logit: [rows, length] each),
its body under ``jax.checkpoint``, so the backward recomputes one chunk's logits at a time too. At
most one chunk's fp32 ``[rows, length, chunk]`` logits, softmax and gradient are live. Each chunk's
slice of the weight is a scan input, so its gradient is a scan output: reduced over the batch's
devices (a reduce-scatter to the parameter's split) once per slice, never carried whole and
unsplit across the chunks; the gradient of the head's input is carried in fp32. Chunk j holds the
vocabulary entries j, j + n, j + 2n, ... of the n chunks (strided), so where tensor parallelism
splits ``vocab`` each device keeps its share of every chunk and the loss reduces over the split
vocabulary (no device gathers it); the positions keep whatever split they have (context parallelism).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from flax import nnx

from meshtrain.precision import LossScale, cast_floating
from models.api import AUX_LOSS, HEAD_AXES, MTP_LOSS, Documents, LayerAux, PredictsAhead, head_logits
from models.common import ActivationSharding

Batch = dict[str, jax.Array]  # the step's arrays by name: inputs, targets, mask [rows, length], ...
# params (in the compute dtype, possibly one stage's slice of the layers) -> the model on them.
ModelOf = Callable[[nnx.State], Any]
# (params, microbatch) -> (its loss, the layers' aux terms).
Loss = Callable[[nnx.State, Batch], tuple[jax.Array, LayerAux]]


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
    """The two (linear) terms of one microbatch's scaled, normalised loss, and the chunks of the
    vocabulary the token term is computed in.

    token_weights: the microbatch's [batch, positions] arrays -> each token's weight [batch, positions]
    (fp32): the token loss is the sum over tokens of weight x cross-entropy.
    of_aux: the layers' auxiliary-loss sum over the microbatch's rows (``aux[AUX_LOSS]`` of
    ``DecoderModel.run_layers``) -> its share of the loss.
    loss_chunk: vocabulary entries per chunk (``train.loss_chunk``; 0: the whole vocabulary at once).
    vocab_ways: how many ways the rules split ``vocab`` over the mesh: each chunk keeps that split.
    predicts_ahead: whether a model's multi-token prediction (``models.api.PredictsAhead``) is part
    of it (training: yes; evaluation: the main loss alone).
    """

    token_weights: Callable[[Batch], jax.Array]
    of_aux: Callable[[jax.Array], jax.Array]
    loss_chunk: int = 0
    vocab_ways: int = 1
    predicts_ahead: bool = False

    @classmethod
    def training(cls, target_count: jax.Array, rows: int, loss_scale: LossScale, loss_chunk: int,
                 vocab_ways: int) -> Objective:
        """The train step's objective on a global batch of ``rows`` rows and ``target_count`` target
        tokens: the token cross-entropy summed over a microbatch's tokens / ``target_count``, the
        layers' aux losses as a mean over rows, multi-token prediction included, all scaled by
        ``loss_scale`` (fp16); so the microbatches' terms sum to the step's loss."""
        def token_weights(microbatch: Batch) -> jax.Array:
            return loss_scale.scale_loss(microbatch["mask"].astype(jnp.float32) / target_count)

        def of_aux(aux_sum: jax.Array) -> jax.Array:
            return loss_scale.scale_loss(aux_sum.astype(jnp.float32) / rows)

        return cls(token_weights, of_aux, loss_chunk, vocab_ways, predicts_ahead=True)

    @classmethod
    def evaluation(cls, loss_chunk: int, vocab_ways: int) -> Objective:
        """The evaluation's objective: the summed token cross-entropy alone (no aux terms, no
        multi-token prediction)."""
        return cls(lambda mb: mb["mask"].astype(jnp.float32), lambda aux_sum: jnp.zeros((), jnp.float32),
                   loss_chunk, vocab_ways)

    def of_layers(self, aux: LayerAux) -> jax.Array:
        """The share of the loss of the layers' aux terms ``aux``."""
        return self.of_aux(aux[AUX_LOSS])

    def chunk_size(self, vocab: int) -> int:
        """Vocabulary entries per chunk of a head over ``vocab`` entries: see ``chunk_size``."""
        return chunk_size(vocab, self.loss_chunk, self.vocab_ways)


# The most chunks a head may run the vocabulary in (``train.loss_chunk``; ``Layout.problems`` refuses more):
# each is one trip of the head's loop, with a matmul of ``chunk`` columns. 256 keeps the planner's
# smallest choice (1,024 entries) within it up to a vocabulary of 262,144, and refuses a chunk of a few
# entries (a vocabulary with no divisor near the request, or a value meant as positions).
MAX_LOSS_CHUNKS = 256


def smallest_allowed_chunk(size: int, ways: int = 1) -> int:
    """The fewest entries per chunk (``chunk_size``'s result) that cut ``size`` into at most
    ``MAX_LOSS_CHUNKS`` chunks, with ``ways`` as ``chunk_size``'s."""
    ways = ways if size % ways == 0 else 1
    local = size // ways
    return ways * min(d for d in _divisors(local) if local // d <= MAX_LOSS_CHUNKS)


def chunk_size(size: int, request: int, ways: int = 1) -> int:
    """Entries per chunk of ``size`` (the vocabulary): the largest divisor of ``size`` not above
    ``request`` that is a multiple of ``ways`` (every device then holds an equal share of each chunk;
    at least ``ways`` entries); ``size`` when ``request`` is 0 or at least ``size``. A size with no
    divisor near ``request`` (e.g. a prime) runs in many small chunks."""
    if request <= 0 or request >= size:
        return size
    ways = ways if size % ways == 0 else 1
    limit = max(request // ways, 1)
    return ways * max(d for d in _divisors(size // ways) if d <= limit)


@functools.cache
def _divisors(n: int) -> tuple[int, ...]:
    """Every divisor of ``n`` (the planner asks ``chunk_size`` for each chunk of each layout it estimates)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return tuple(small + [n // d for d in small])


def _strided_columns(weight: jax.Array, chunks: int) -> jax.Array:
    """[embed, vocab] -> [chunks, embed, vocab / chunks]: chunk j holds columns j, j + chunks, ... (a
    device holding a contiguous block of the vocabulary holds its block's share of every chunk)."""
    embed, vocab = weight.shape
    return jnp.moveaxis(weight.reshape(embed, vocab // chunks, chunks), 2, 0)


Softmax = tuple[jax.Array, jax.Array, jax.Array]  # (max, sum of exp(logit - max), target's logit) [batch, length]


def _softmax_pieces(logits: jax.Array, targets: jax.Array) -> Softmax:
    """fp32 logits [batch, length, entries] and int ``targets`` [batch, length] (an entry's index, or
    -1 where the target lies in another chunk) -> their ``Softmax`` pieces. The max carries no
    gradient: the log-sum-exp does not depend on it. The target's logit is a one-hot contraction, not
    a gather: it partitions cleanly when the vocabulary is split over ``tensor``, also inside a
    pipeline stage (XLA's partitioner aborts on the gather there)."""
    peak = jax.lax.stop_gradient(jnp.max(logits, axis=-1))
    sum_exp = jnp.sum(jnp.exp(logits - peak[..., None]), axis=-1)
    target = jnp.sum(logits * jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype), axis=-1)
    return peak, sum_exp, target


def _merge(a: Softmax, b: Softmax) -> Softmax:
    """The ``Softmax`` pieces of two disjoint sets of entries -> those of their union."""
    peak = jnp.maximum(a[0], b[0])
    return peak, a[1] * jnp.exp(a[0] - peak) + b[1] * jnp.exp(b[0] - peak), a[2] + b[2]


def head_loss(normed: jax.Array, weight: jax.Array, batch: Batch, shard: ActivationSharding,
              objective: Objective) -> jax.Array:
    """The token loss (``objective.token_weights`` x cross-entropy, summed) of the output head on
    ``normed`` [batch, length, embed] (the model's ``head_input``, or a prediction depth's stream)
    through ``weight`` [embed, vocab] (the model's ``head_weight``), in chunks of
    ``objective.chunk_size(vocab)`` vocabulary entries (see the module docstring). ``batch``: the
    microbatch's [batch, length] arrays at the same positions."""
    targets = batch["targets"]
    vocab = weight.shape[1]
    chunks = vocab // objective.chunk_size(vocab)
    if chunks == 1:  # one pass: nothing recomputed
        pieces = _softmax_pieces(head_logits(normed, weight, shard), targets)
    else:
        # The head's input is closed over in fp32: its gradient accumulates over the chunks in fp32.
        wide = shard(normed, HEAD_AXES).astype(jnp.float32)
        # The initial pieces derive from the input: inside a pipeline stage a fresh carry would not be
        # varying over the stage axis. The max starts at -inf: the first chunk's max replaces it.
        zeros = jax.lax.stop_gradient(wide[..., 0] * 0)

        def chunk(carry: Softmax, weight_and_index: tuple[jax.Array, jax.Array]) -> tuple[Softmax, None]:
            w, j = weight_and_index
            local = jnp.where(targets % chunks == j, targets // chunks, -1)
            logits = head_logits(wide.astype(normed.dtype), w, shard)
            return _merge(carry, _softmax_pieces(logits, local)), None

        # prevent_cse off: inside a scan nothing can merge the backward's recomputation with the forward.
        pieces, _ = jax.lax.scan(jax.checkpoint(chunk, prevent_cse=False), (zeros - jnp.inf, zeros, zeros),
                                 (_strided_columns(weight, chunks), jnp.arange(chunks)))
    peak, sum_exp, target = pieces
    return jnp.sum(objective.token_weights(batch) * (peak + jnp.log(sum_exp) - target))


def documents_of(batch: Batch) -> Documents | None:
    """The batch's document spans (``positions`` and ``segments`` [rows, length]) when its rows are
    packed from several documents, else None."""
    return Documents(batch["positions"], batch["segments"]) if "segments" in batch else None


def sequential_loss(model_of: ModelOf, objective: Objective, shard: ActivationSharding, compute_dtype) -> Loss:
    """No pipeline: the whole model's loss (the head's in the objective's chunks of the vocabulary)."""

    def loss(params: nnx.State, batch: Batch) -> tuple[jax.Array, LayerAux]:
        model, documents = model_of(cast_floating(params, compute_dtype)), documents_of(batch)
        x, aux = model.run_layers(model.embed(batch["inputs"], shard, documents), shard, documents)
        ahead, ahead_aux = ahead_loss(model, x, batch, shard, objective, documents)
        loss = head_loss(model.head_input(x, shard), model.head_weight(), batch, shard, objective)
        loss = loss + objective.of_layers(aux) + ahead
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
    (``with_ahead_targets``); each depth's stream goes through the output head (``head_weight``) in the
    objective's chunks."""
    if not (objective.predicts_ahead and isinstance(model, PredictsAhead) and model.ahead_depths):
        return jnp.zeros((), jnp.float32), {}
    depths = range(1, model.ahead_depths + 1)
    streams, aux = model.predict_ahead(x, jnp.stack([batch[ahead_key("inputs", k)] for k in depths]), shard, documents)
    losses = [head_loss(streams[k - 1], model.head_weight(),
                        {"targets": batch[ahead_key("targets", k)], "mask": batch[ahead_key("mask", k)]}, shard,
                        objective) for k in depths]
    mean = sum(losses) / len(losses)
    return model.ahead_weight * mean + objective.of_layers(aux), {MTP_LOSS: mean}

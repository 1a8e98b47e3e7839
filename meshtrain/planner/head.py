"""The loss and the head's phase: the head's forward and backward, one chunk of the vocabulary at a
time (``meshtrain.loss``): the vocabulary weights in the compute dtype (the projection ``projection_copies``
times when ZeRO-3 gathers it, one chunk's columns of it when chunked), the projection's fp32 gradient (in
one pass its sum over the batch's devices, an all-reduce on XLA:CPU; chunked, each chunk's gradient is
reduced to the parameter's split as it is made), one chunk's logits and their fp32 softmax pieces (the
compiler's ``logits_fp32_copies``; a head in one pass: ``one_pass_fp32_copies``, which the gradient may
share: ``one_pass_shares_gradient``), and chunked, the head's input and its gradient in fp32."""

from __future__ import annotations

import dataclasses

from meshtrain.loss import MAX_LOSS_CHUNKS, chunk_size
from meshtrain.parallel.layout import Layout
from meshtrain.planner.constants import FP32, Constants
from meshtrain.planner.layer import LayerShape
from meshtrain.planner.state import ParamTerms

# The smallest chunk (vocabulary entries) the estimate's choice tries: a [tokens, embed] x [embed, 1,024]
# matmul still fills a GPU's matrix units, and below it the chunks' count (and their collectives) grows
# while the memory the loss phase saves shrinks beside the head's fixed part (its weights, their gradient).
SMALLEST_CHOSEN_CHUNK = 1024


@dataclasses.dataclass(frozen=True)
class HeadPhase:
    """``length``: the positions of a row the head sees on a stage; ``chunk``: the vocabulary entries
    its loss takes at a time (``chunk < vocab``: chunked, its backward recomputes the logits);
    ``vocab_bytes``: bytes per element of the vocabulary weights' working copies; ``work``: the
    projection's gradient and one chunk's logits; ``loss_phase``: the whole phase's bytes (the weights'
    copies and ``work``)."""

    length: int
    chunk: int
    vocab_bytes: int
    work: float
    loss_phase: float


def head_length(layout: Layout) -> int:
    """The positions of a row the head sees on a stage."""
    return layout.model.seq_len // layout.stages


def loss_chunks(layout: Layout, smallest: int = SMALLEST_CHOSEN_CHUNK) -> list[int]:
    """The ``train.loss_chunk`` values the estimate chooses among (``choose_loss_chunk``), largest first:
    0 (one pass), then halvings of the vocabulary down to ``smallest`` entries (each run as
    ``chunk_size``'s divisor), one value per distinct chunk."""
    vocab, ways = layout.model.vocab_size, layout.vocab_ways
    values, chunks, request = [0], {vocab}, vocab // 2
    while request >= smallest:
        chunk = chunk_size(vocab, request, ways)
        if chunk not in chunks and vocab // chunk <= MAX_LOSS_CHUNKS:
            values.append(chunk)
            chunks.add(chunk)
        request //= 2
    return values


def head_phase(layout: Layout, shape: LayerShape, terms: ParamTerms, compute_bytes: int,
               constants: Constants, loss_chunk: int) -> HeadPhase:
    """The loss phase of ``layout`` (``HeadPhase``) in chunks of ``loss_chunk`` vocabulary entries (a
    ``train.loss_chunk`` value) with ``constants``, the compiler's."""
    model = layout.model
    length = head_length(layout)
    chunk = chunk_size(model.vocab_size, loss_chunk, layout.vocab_ways)
    tokens = shape.rows / shape.micro * length / shape.cp
    chunk_local = chunk / shape.tensor
    vocab_bytes = compute_bytes if compute_bytes != FP32 else (FP32 if terms.gathering else 0)
    copies = constants.projection_copies
    one_pass = chunk == model.vocab_size
    # ZeRO-3 gathers the projection as the loop reads it: one chunk's columns at a time when chunked.
    gathered = terms.projection * copies * (1 if one_pass else chunk / model.vocab_size)
    vocab_copies = (terms.lookup + (gathered if terms.gathering else terms.projection)) * vocab_bytes
    fp32 = tokens * chunk_local * FP32 * (constants.one_pass_fp32_copies if one_pass else constants.logits_fp32_copies)
    logits = tokens * chunk_local * compute_bytes
    if one_pass:
        gradient = FP32 * terms.projection * (copies if terms.projection_reduced else 1)
        work = (max(gradient, fp32) if constants.one_pass_shares_gradient else gradient + fp32) + logits
    else:  # the chunks' gradients at the parameter's split (tied: the table's), one chunk's before its
        # reduction, the head's input and its gradient in fp32
        split_gradient = compute_bytes * (terms.projection_grads or terms.lookup_grads)
        chunk_gradient = model.embed_dim * chunk_local * compute_bytes
        work = split_gradient + chunk_gradient + fp32 + logits + 2 * tokens * model.embed_dim * FP32
    return HeadPhase(length, chunk, vocab_bytes, work, vocab_copies + work)

"""The loss and the head's phase: the head's forward and backward, one chunk of positions at a time
(``meshtrain.loss``): the vocabulary weights in the compute dtype (the projection ``projection_copies`` times when
ZeRO-3 gathers it), the projection's fp32 gradient (and its sum over the batch's devices, an all-reduce on
XLA:CPU), one chunk's logits and their fp32 softmax pieces (the compiler's ``logits_fp32_copies``)."""

from __future__ import annotations

import dataclasses

from meshtrain.loss import chunk_length
from meshtrain.parallel.layout import Layout
from meshtrain.planner.constants import FP32, Constants
from meshtrain.planner.layer import LayerShape
from meshtrain.planner.state import ParamTerms


@dataclasses.dataclass(frozen=True)
class HeadPhase:
    """``length``: the positions of a row the head sees on a stage; ``chunk``: the positions its loss
    takes at a time (``chunk < length``: chunked, its backward recomputes the logits); ``vocab_bytes``:
    bytes per element of the vocabulary weights' working copies; ``work``: the projection's gradient
    and one chunk's logits; ``loss_phase``: the whole phase's bytes (the weights' copies and ``work``)."""

    length: int
    chunk: int
    vocab_bytes: int
    work: float
    loss_phase: float


def head_phase(layout: Layout, shape: LayerShape, terms: ParamTerms, compute_bytes: int,
               constants: Constants) -> HeadPhase:
    """The loss phase of ``layout`` (``HeadPhase``) with ``constants``, the compiler's."""
    model = layout.model
    length = model.seq_len // layout.stages
    chunk = chunk_length(length, layout.train.loss_chunk, shape.cp)
    loss_tokens = shape.rows / shape.micro * chunk / shape.cp
    vocab_local = model.vocab_size / shape.tensor
    vocab_bytes = compute_bytes if compute_bytes != FP32 else (FP32 if terms.gathering else 0)
    copies = constants.projection_copies
    vocab_copies = (terms.lookup + terms.projection * (copies if terms.gathering else 1)) * vocab_bytes
    work = (FP32 * terms.projection * (copies if terms.projection_reduced else 1)
            + loss_tokens * vocab_local * (compute_bytes + constants.logits_fp32_copies * FP32))
    return HeadPhase(length, chunk, vocab_bytes, work, vocab_copies + work)

"""The pipeline's phase: what the executor's carry holds through the schedule's table (the stash,
ZB-H1's cut, the fp32 buffers of received activations and gradients, the layers' gradient sums)
and, per XLA while loop of its ticks (``tick_loops``), the head's gathered weights, a second copy of
a buffer the loop both writes and reads, and the loop's largest slot (forward, backward, ZB-H1's
halves, head). Modelled on XLA:CPU's buffers of 8B and 10B steps under every schedule; the
compiler's ``Constants`` say which of XLA:CPU's habits XLA:GPU lacks."""

from __future__ import annotations

import dataclasses

from meshtrain.errors import ConfigError
from meshtrain.parallel.executor import Signature, tick_runs
from meshtrain.parallel.layout import Layout
from meshtrain.parallel.schedules import SENDS_GRADIENT, ScheduleTable, Work
from meshtrain.planner.cache import Cache
from meshtrain.planner.constants import FP32, Constants
from meshtrain.planner.head import HeadPhase
from meshtrain.planner.layer import LayerPhase, LayerShape
from meshtrain.planner.state import ParamTerms
from models.api import FamilyCosts
from models.common import RematPolicy


def schedule_table(layout: Layout) -> ScheduleTable | None:
    """The run's pipeline table (None without a pipeline, or when it cannot run: ``problems`` says why)."""
    if layout.stages == 1:
        return None
    try:
        table = layout.pipeline.schedule_table(layout.stages)
    except ConfigError:
        return None
    return None if table.problems() else table


def _loops(table: ScheduleTable) -> tuple[ScheduleTable, list[Signature]]:
    return table, [signature for _, block in tick_runs(table) for signature, _ in block]


def tick_loops(table: ScheduleTable, cache: Cache) -> list[Signature]:
    """The executor's loops over ``table``'s ticks, in order, as (slot kinds, runs the head): one XLA
    while loop per run of ticks with one signature (``meshtrain.parallel.executor.tick_runs``; a
    repeated block's runs are one loop each). Kept per table in ``cache`` (with the table, so that
    its id names it while the cache lives)."""
    return cache.get(_loops, id(table), table)[1]


def _traffic(table: ScheduleTable) -> tuple[ScheduleTable, tuple[int, int]]:
    signatures = [table.signature(t) for t in range(len(table.ticks))]
    sends = sum((Work.FORWARD in works) + any(w in SENDS_GRADIENT for w in works) for works, _ in signatures)
    return table, (sends, sum(head for _, head in signatures))


def tick_traffic(table: ScheduleTable, cache: Cache) -> tuple[int, int]:
    """(sends, heads) of ``table`` on a stage: per tick one activation forward and one gradient back
    where its slots make them, and the ticks that run the head. Kept per table in ``cache``."""
    return cache.get(_traffic, id(table), table)[1]


@dataclasses.dataclass(frozen=True)
class Stash:
    """What a pipeline's backward keeps (``pipeline_stash``): ``loops``, the table's tick loops;
    ``chunk_tokens``, one chunk's layers x one microbatch's tokens; ``stash`` and ``cut`` bytes with
    ``cut_copy``, a loop's second copy of the cut (its compute-dtype values); ``cut_per_token``, the
    cut per token and layer in the compute dtype and in fp32; ``activations``, all of it with the
    executor's buffers."""

    loops: list[Signature]
    chunk_tokens: float
    stash: float
    cut_copy: float
    cut_per_token: tuple[float, float]
    activations: int


def pipeline_stash(layout: Layout, table: ScheduleTable, shape: LayerShape, costs: FamilyCosts, layer: LayerPhase,
                   compute_bytes: int, constants: Constants, cache: Cache) -> Stash:
    """The stash: its slots of one chunk's residuals (1/V of a stage's layers, one microbatch) in the
    compute dtype, as the forward makes them; ZB-H1's cut: its slots of what a microbatch's
    input-gradient half hands its weight-gradient half for the chunk's layers. And the executor's fp32
    buffers of received activations and gradients, one microbatch each."""
    model = layout.model
    _, buffers = table.buffers()
    chunk_tokens = shape.layers_here / table.chunks * shape.working_tokens
    # ZB-H1's cut per token and layer, what the input-gradient half hands the weight-gradient half:
    # each weight matmul's input and its output's cotangent, counted as twice the outputs ``dots``
    # keeps (XLA:CPU, 8B: 4d + 2q + 2k + 4f in the compute dtype), and beside them four
    # residual-width vectors in fp32 (``cut_fp32_residuals``); the weight-gradient half holds
    # all of it at ``held_bytes`` (``cut_per_token``: compute dtype, fp32).
    cut_residuals = constants.cut_fp32_residuals * model.embed_dim / shape.sp * FP32
    cut_per_token = tuple(2 * costs.layer_bytes(shape.request(RematPolicy.DOTS, nbytes)).saved + cut_residuals
                          for nbytes in (compute_bytes, constants.held_bytes(compute_bytes)))
    stash = buffers.stash * chunk_tokens * layer.kept
    cut = buffers.cut * chunk_tokens * cut_per_token[0] if table.splits_backward else 0.0
    # A loop's second copy of the cut is of its compute-dtype values only (the fp32 ones stay single).
    cut_copy = buffers.cut * chunk_tokens * (cut_per_token[0] - cut_residuals) if table.splits_backward else 0.0
    activations = round(stash + cut + (buffers.inputs + buffers.gradients + 2) * shape.working_tokens
                        * model.embed_dim * FP32)
    return Stash(tick_loops(table, cache), chunk_tokens, stash, cut_copy, cut_per_token, activations)


def pipeline_temporaries(table: ScheduleTable, stash: Stash, terms: ParamTerms, layer: LayerPhase, head: HeadPhase,
                         compute_bytes: int, accumulation: float, constants: Constants) -> int:
    """A pipeline's temp bytes besides the stash: through the whole table the stage holds its layers'
    compute copy, its layers' and the rest's gradients summed over the microbatches in fp32 (the
    executor's carry, with ``accumulation``: ``meshtrain.planner.state.accumulation_bytes``); the rest
    is per loop of ticks (``tick_loops``)."""
    low_precision = compute_bytes != FP32
    loops, chunk_tokens, cut_per_token = stash.loops, stash.chunk_tokens, stash.cut_per_token
    # A stage gathers one layer of its compute copy at a time (cast before the gather: ``held_bytes``).
    # Beside it, a layer's fp32 gradients with their sum over fsdp are ``layer.gathered``.
    gathered = terms.layer_gathered * constants.held_bytes(compute_bytes)
    layer_experts, layer_work = layer.layer_experts, layer.layer_work
    held = (FP32 * terms.layer_loop_grads + (compute_bytes * terms.layer_copy if low_precision else 0.0)
            + FP32 * (terms.lookup_grads + terms.projection_grads) + accumulation)
    # The head's weights in the compute dtype: the lookup table where it rests and the projection,
    # which ZeRO-3 gathers: each loop that runs the head takes ``Constants.pipeline_head_copies`` gathered
    # copies, all made before the first loop and each released when its loop ends (none: the projection
    # rests as its shard, the loss gathering one chunk's columns at a time).
    heads_left = [sum(has_head for _, has_head in loops[i:]) for i in range(len(loops))]
    head_copies = constants.pipeline_head_copies
    projection = [(terms.projection * head_copies * left if head_copies else terms.projection_stored)
                  if terms.gathering else terms.projection for left in heads_left]
    head_weights = [(compute_bytes * terms.lookup_stored if low_precision else 0.0) + head.vocab_bytes * elements
                    for elements in projection]
    # A chunk's layers widened to fp32 while they run (XLA:CPU computes bf16 matmuls in fp32).
    chunk_fp32 = (FP32 * terms.layer_copy if low_precision and constants.widened_chunk else 0.0) / table.chunks
    # A forward slot: one layer's gathered weights, the microbatch's residuals as its layers make
    # them, and on the first stage the lookup table gathered for the embedding.
    forward = (chunk_fp32 + gathered + chunk_tokens * layer.kept
               + (terms.lookup - terms.lookup_stored) * head.vocab_bytes)
    # A backward slot: the microbatch's stash widened to fp32, the chunk's gradients as its backward
    # writes them (compute dtype), and per layer its gathered weights and its experts with its
    # working set, then (the larger at 8B-10B widths) its full fp32 gradients with their sum over
    # fsdp (an all-reduce on XLA:CPU; it reduce-scatters the gradients of a gathered weight).
    backward = (chunk_fp32 + chunk_tokens * layer.saved + compute_bytes * terms.layer_loop_grads / table.chunks
                + gathered + layer_experts + max(layer_work, layer.gathered))
    # ZB-H1's halves: the input-gradient half as a backward slot without the weights' gradients,
    # making the cut (of the chunk for its microbatch); the weight-gradient half, which needs no
    # weights, the cut widened to fp32 and the chunk's gradients (XLA:CPU, 8B: 53.1 GB of temp
    # against 17.9 GB for 1F1B on the same layout).
    input_grad = (chunk_fp32 + chunk_tokens * (layer.saved + cut_per_token[0]) + gathered + layer_experts
                  + max(layer_work, layer.gathered))
    weight_grad = chunk_tokens * cut_per_token[1] + compute_bytes * terms.layer_loop_grads / table.chunks
    slot = {Work.FORWARD: forward, Work.BACKWARD: backward, Work.INPUT_GRAD: input_grad,
            Work.WEIGHT_GRAD: weight_grad}
    # A loop that both writes and reads the stash (a forward and a backward half) or the cut (the
    # two halves) holds that buffer twice: XLA:CPU copies the carried buffer there instead of
    # updating it in place (1F1B's, interleaved's and ZB-H1's steady loops; GPipe's forwards and
    # backwards are separate loops, and ZB-H1's cut is single until its W slots start). XLA:GPU
    # updates it in place, holding the forward's new chunk of residuals beside the backward slot.
    backward_kinds, copies = (Work.BACKWARD, Work.INPUT_GRAD, Work.WEIGHT_GRAD), constants.copied_carries
    written = stash.stash if copies else chunk_tokens * layer.kept
    phases = [weights + max([slot[w] for w in works] + ([head.work] if has_head else []))
              + (written if Work.FORWARD in works and any(w in works for w in backward_kinds) else 0.0)
              + (stash.cut_copy if copies and Work.INPUT_GRAD in works and Work.WEIGHT_GRAD in works else 0.0)
              for (works, has_head), weights in zip(loops, head_weights)]
    return round(held + max(phases) + layer.residual)

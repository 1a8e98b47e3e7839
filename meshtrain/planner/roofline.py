"""Communication and time: the roofline step time of a layout. Compute is the family's training
FLOPs (with what the remat policy and a chunked head recompute) over the devices' peak, stretched by
the pipeline's bubble; each collective's bytes per device go over the bandwidth of the links its
mesh axis spans (inside a node or across nodes); step = compute + collectives (no overlap)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from meshtrain.mesh import DEVICE_ORDER
from meshtrain.parallel.layout import Layout
from meshtrain.parallel.rules import mesh_axes_of
from meshtrain.parallel.schedules import ScheduleTable
from meshtrain.planner.cache import Cache
from meshtrain.planner.constants import FP32, Compiler
from meshtrain.planner.head import HeadPhase
from meshtrain.planner.layer import LayerShape
from meshtrain.planner.pipeline import tick_traffic
from meshtrain.planner.state import ParamTerms
from models.api import FamilyCosts
from models.common import RematPolicy


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Roofline constants: peak FLOP/s per device, link bandwidths (bytes/s), devices per node; and
    the compiler that builds the step for these devices, whose fitted constants the memory estimate
    takes (``meshtrain.planner.constants.TABLES``): XLA:GPU for GPUs, XLA:CPU for the CPU devices
    the tests simulate."""

    peak_flops: float = 989e12
    intra_node_bandwidth: float = 450e9
    inter_node_bandwidth: float = 50e9
    node_size: int = 8
    compiler: Compiler = Compiler.XLA_GPU


@dataclasses.dataclass(frozen=True)
class StepTime:
    """``compute_s``; ``comm_s``: seconds per mesh axis of its collectives; ``bubble``: the pipeline
    table's idle share; ``in_flight``: its peak chunk activations on a stage (0 without a pipeline)."""

    compute_s: float
    comm_s: dict[str, float]
    bubble: float = 0.0
    in_flight: int = 0


def axis_bandwidth(axis: str, mesh: Mapping[str, int], hw: Hardware) -> float:
    """The bandwidth of ``axis``'s links: inside a node while the axes inside it span no more than a node."""
    inner = math.prod(mesh[a] for a in DEVICE_ORDER[DEVICE_ORDER.index(axis):])
    return hw.intra_node_bandwidth if inner <= hw.node_size else hw.inter_node_bandwidth


def step_time(layout: Layout, remat: RematPolicy, zero: int, devices: int, costs: FamilyCosts, terms: ParamTerms,
              shape: LayerShape, head: HeadPhase, table: ScheduleTable | None, compute_bytes: int,
              hw: Hardware, cache: Cache) -> StepTime:
    """The roofline step time of ``layout`` (``StepTime``; ``cache``: the search's, for the table's traffic)."""
    model, mesh, stages = layout.model, layout.mesh_shape, layout.stages
    grad_accum, rows, cp = layout.train.grad_accum, shape.rows, shape.cp
    global_tokens = layout.train.batch_size * model.seq_len
    flops = costs.flops_per_token() + costs.recompute_flops_per_token(remat)
    if head.chunk < head.length:  # the chunked head's backward recomputes its logits (meshtrain.loss)
        flops += 2 * model.embed_dim * model.vocab_size
    bubble, in_flight = (table.bubble(), table.peak_in_flight) if table is not None else (0.0, 0)
    compute_s = global_tokens * flops / (devices * hw.peak_flops) / (1 - bubble)
    ring = lambda n: (n - 1) / n
    comm: dict[str, float] = {}
    local_tokens_step = shape.tokens * grad_accum
    if mesh["tensor"] > 1:
        # Two all-reduces of [tokens, embed] per layer forward, two backward, two more to recompute.
        count = 4 + (2 if remat is RematPolicy.FULL else 0)
        comm["tensor"] = (model.num_layers / stages * count * 2 * ring(mesh["tensor"]) * local_tokens_step
                          * model.embed_dim * compute_bytes)
    if mesh["fsdp"] > 1:
        # ZeRO's parameters are gathered and their gradients reduced over fsdp; parameters held in
        # their compute layout (expert parallelism's experts) are neither gathered nor reduced.
        f = mesh["fsdp"]
        nbytes = 0.0
        if zero >= 3:
            # Gathers, forward and backward: fp32 (see above), FP8 weights as E4M3 (1 B).
            nbytes += 2 * grad_accum * ring(f) * ((terms.zero_sharded_total - terms.fp8_gathered) * FP32
                                                  + terms.fp8_gathered)
        nbytes += grad_accum * (1 if zero >= 2 else 2) * ring(f) * terms.fsdp_reduced * FP32  # RS or AR
        if 1 <= zero <= 2:
            nbytes += ring(f) * terms.zero_sharded_total * FP32  # all-gather of the updated parameters
        comm["fsdp"] = nbytes
    if cp > 1:
        # Context parallelism: keys and values gathered (all-gather scheme) or passed round the ring
        # (ring scheme: the same (CP-1)/CP of them per device) per layer forward and again to
        # recompute, their gradients reduced backward (``key_value_width`` wide, together).
        count = 1 + 1 + (1 if remat is RematPolicy.FULL else 0)
        kv_width = costs.key_value_width(shape.tensor)
        for axis in mesh_axes_of(layout.rules.activation_spec(("length",))[0]):
            comm[axis] = comm.get(axis, 0.0) + (model.num_layers / stages * count * ring(cp) * rows * grad_accum
                                                * model.seq_len * kv_width * compute_bytes)
    if mesh["data"] > 1:
        comm["data"] = grad_accum * 2 * ring(mesh["data"]) * terms.data_reduced * FP32
    if shape.experts > 1:
        # Expert parallelism: the rows to the experts and the results back per layer forward, their
        # transposes backward, the forward's again to recompute; on the outermost axis it spans.
        count = 4 + (2 if remat is RematPolicy.FULL else 0)
        axis = next(a for a in DEVICE_ORDER if a in shape.expert_mesh_axes)
        comm[axis] = comm.get(axis, 0.0) + (model.num_layers * count * ring(shape.experts) * local_tokens_step
                                            * costs.exchange_bytes(shape.experts, compute_bytes))
    if table is not None:
        # Per tick one activation forward, one gradient back; per head the reduce-scatter of the
        # last stage's output and the all-gather of its gradient.
        sends, heads = tick_traffic(table, cache)
        comm["stage"] = (grad_accum * (sends + 2 * ring(stages) * heads) * shape.working_tokens * model.embed_dim
                         * FP32)
    return StepTime(compute_s, {axis: nbytes / axis_bandwidth(axis, mesh, hw) for axis, nbytes in comm.items()},
                    bubble, in_flight)

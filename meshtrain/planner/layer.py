"""The layer's phase: how one stacked layer's tokens split on a device (``LayerShape``), what the
backward keeps of each layer under the remat policy, and one layer's working set while its backward
runs (``LayerPhase``): the family's ``FamilyCosts.layer_bytes`` scaled by the compiler's fitted
``Constants.activation_coefficients``, with the layer's ZeRO-gathered weights, its experts, and
tensor and context parallelism's buffers."""

from __future__ import annotations

import dataclasses
import math

from meshtrain.parallel.layout import Layout
from meshtrain.parallel.ring_attention import sub_block_length
from meshtrain.parallel.rules import mesh_axes_of
from meshtrain.planner.constants import FP32, Constants
from meshtrain.planner.state import ParamTerms
from models.api import FamilyCosts, LayerRequest
from models.common import RematPolicy
from models.kernels.attention import AttentionKernel


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """How a layer's tokens split on one device. ``rows``: rows per shard; ``micro``: pipeline
    microbatches (1 without a pipeline); ``cp``: context parallelism's split of the positions;
    ``sp``: sequence parallelism's further split of the residual stream; ``tokens``: per device per
    accumulation step, ``working_tokens`` per microbatch; ``layers_here``: the stage's layers;
    ``ring_size``: ring attention's ranks (1: none); ``keys``: the key positions a query's scores span
    at once (``LayerRequest.keys``); ``expert_mesh_axes`` and ``experts``: expert parallelism's mesh
    axes and size."""

    tensor: int
    rows: int
    micro: int
    cp: int
    sp: int
    tokens: float
    working_tokens: float
    layers_here: int
    ring_size: int
    keys: float | None
    expert_mesh_axes: tuple[str, ...]
    experts: int
    fp8: frozenset

    def request(self, remat: RematPolicy, compute_bytes: int) -> LayerRequest:
        """The family's query for one layer at ``remat`` in ``compute_bytes`` per element."""
        return LayerRequest(self.tensor, remat, compute_bytes, self.sp, self.keys, self.experts, self.fp8)


def layer_shape(layout: Layout) -> LayerShape:
    """``layout``'s ``LayerShape``. Context parallelism splits the positions ``cp`` ways; sequence
    parallelism splits the residual stream ``sp`` ways more. The blockwise kernels hold one [query
    block, key block] tile of scores at a time: per query of the device's seq_len / CP, q_block x
    k_block / (seq_len / CP) keys. Ring attention's tiles are sub-blocks of a rank's positions; the
    blockwise kernel's ``model.attention_block`` positions (its queries: the device's share under
    all-gather CP, its keys: the whole row). The dense kernel (``xla``) spans every key."""
    model, mesh, stages = layout.model, layout.mesh_shape, layout.stages
    rows = layout.rows_per_shard
    micro = layout.pipeline.microbatches if stages > 1 else 1
    cp = layout.length_ways
    sp = max(1, layout.ways(layout.rules.activation_spec(("sequence",)))[0] // cp)
    tokens = rows * model.seq_len / cp
    layers_here = model.num_layers // stages if model.num_layers % stages == 0 else model.num_layers
    ring_name = layout.rules.ring_axis
    ring_size = mesh[ring_name] if ring_name is not None else 1
    spec = model.attention_spec
    keys = None
    if ring_size > 1:
        rank_positions = model.seq_len // ring_size
        keys = sub_block_length(rank_positions, layout.rules.ring_block) ** 2 / rank_positions
    elif spec.kernel is not AttentionKernel.XLA:
        queries = model.seq_len // cp
        keys = min(spec.block, queries) * min(spec.block, model.seq_len) / queries
    # Expert parallelism's size (its exchange runs inside pipeline stages too: meshtrain/parallel/experts.py).
    expert_mesh_axes = tuple(a for axis in layout.expert_axes
                             for a in mesh_axes_of(layout.rules.activation_spec((axis,))[0]) if mesh[a] > 1)
    experts = math.prod(mesh[a] for a in expert_mesh_axes)
    return LayerShape(mesh["tensor"], rows, micro, cp, sp, tokens, tokens / micro, layers_here, ring_size, keys,
                      expert_mesh_axes, experts, layout.train.fp8_groups)


@dataclasses.dataclass(frozen=True)
class LayerPhase:
    """Per token and layer: ``saved`` (what the backward keeps, at the compiler's ``held_bytes``: XLA:CPU
    widens it to fp32), ``kept`` (the same in the compute dtype: a pipeline's stash), ``working`` (one layer's live
    set). Per device: ``gathered``, one layer's ZeRO-gathered weights (fp32); ``layer_experts``, its
    experts; ``layer_work``, its backward's working set; ``residual``, one microbatch's residual stream
    in fp32."""

    saved: float
    kept: float
    working: float
    gathered: float
    layer_experts: float
    layer_work: float
    residual: float


def layer_phase(layout: Layout, shape: LayerShape, costs: FamilyCosts, terms: ParamTerms, remat: RematPolicy,
                compute_bytes: int, constants: Constants) -> LayerPhase:
    """One layer's phase of ``layout`` under ``remat`` (``LayerPhase``) with ``constants``, the compiler's."""
    model = layout.model
    held = constants.held_bytes(compute_bytes)
    saved = costs.layer_bytes(shape.request(remat, held)).saved
    kept = costs.layer_bytes(shape.request(remat, compute_bytes))
    # And one layer's experts, which no gather counts: their weight gradients in fp32 as the backward
    # sums them (the blocked kernel's accumulators ``dw``, models/kernels/grouped_matmul.py; the one-hot
    # dispatch's einsums likewise sum in fp32), those cast to the compute dtype, and the layer's
    # expert weights in the compute dtype (XLA:CPU's buffers of DeepSeek-V3's 8-layer dropless step
    # at EP 8: 5.6 + 2.8 + 2.8 GB).
    layer_experts = terms.layer_experts * (FP32 + 2 * compute_bytes)
    layer_work = constants.activation_coefficients.get(remat, 1.0) * shape.working_tokens * kept.working
    if shape.tensor > 1 and compute_bytes != FP32:
        # Tensor parallelism's partial sums of the residual stream: XLA:CPU promotes the bf16
        # all-reduces of one layer's backward to fp32, operands and results beside the bf16 ones.
        layer_work += constants.tensor_reduction_buffers * shape.working_tokens * model.embed_dim / shape.sp * FP32
    if shape.cp > 1 and shape.ring_size == 1:
        # Context parallelism's all-gather scheme: the whole rows' keys and values and their
        # gradients (held: in fp32 on XLA:CPU).
        layer_work += 2 * shape.rows / shape.micro * model.seq_len * costs.key_value_width(shape.tensor) * held
    return LayerPhase(saved, kept.saved, kept.working, constants.gathered_copies * terms.layer_gathered * FP32,
                      layer_experts, layer_work,
                      shape.working_tokens * model.embed_dim * FP32)

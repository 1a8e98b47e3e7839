"""The held state and the parameters' terms: what a layout's parameters, gradients and optimizer
moments take per device as the ZeRO stage stores them (``held_state``), read from the specs of each
parameter at rest, under the ZeRO stage and in compute (``spec_tables``), summed per device by role
(``ParamTerms``: stored state, the stacked layers' compute copy, gathers and gradients, the
vocabulary's lookup and projection, the bytes each collective moves)."""

from __future__ import annotations

import dataclasses
import math

from flax import nnx

from meshtrain.lora import LoraTraining
from meshtrain.parallel.pipeline import STAGE
from meshtrain.parallel.layout import Layout
from meshtrain.parallel.rules import mesh_axes_of
from meshtrain.parallel.zero import ZERO_AXIS, ZeroStage
from meshtrain.planner.constants import BATCH_BYTES_PER_TOKEN, FP32, Constants
from models.api import LAYERS_KEY, AxisRole
from models.common import MATMUL_GROUP, logical_axes_of

SpecTables = tuple[dict, ...]


def spec_tables(layout: Layout) -> SpecTables:
    """Per parameter path, the specs the estimate reads: at rest under the rules, the ZeRO stage's
    params, grads and optimizer moments, and the compute layout. They depend on the rules, the ZeRO
    stage and whether there is a pipeline only, so a search computes them once for all candidates
    that share those (``meshtrain.planner.cache``)."""
    state, compute = layout.state_specs(), layout.state_specs(ZeroStage.NONE).params
    return tuple({path: spec.get_value() for path, spec in nnx.to_flat_state(tree)}
                 for tree in (layout.param_specs(), state.params, state.grads, state.optimizer, compute))


@dataclasses.dataclass(frozen=True)
class ParamTerms:
    """Per-device element counts of one layout's parameters, by role (``param_terms``).

    ``stored``/``grads``/``moments``: as the ZeRO stage stores them. Of the stacked layers (``layers``
    and the family's other stacks, ``AxisRole.STACKED``): ``layer_copy``, the elements the compute
    copy casts where they rest (the ZeRO shard of a gathered weight, else the compute layout: the
    rules' split less the ZeRO axis); ``layer_loop_grads``, their gradients as the layers' backward
    writes them (reduce-scattered in the loop under ZeRO-2/3, else in the compute layout). Of
    ``layers`` alone: ``layer_gathered``, one layer's ZeRO-gathered weights;
    ``layer_experts``, one layer's experts (weights with an axis of ``Layout.expert_axes``, which
    rest and compute where they are, never gathered); ``layer_split_moments``, the stacked layers'
    optimizer moments as stored (one moment's elements) of the weights that a mesh axis splits in
    compute besides the pipeline's stages (tensor parallelism);
    ``fp8_gathered``, of all ZeRO-gathered weights those whose matmuls run in FP8 (``train.precision:
    fp8``, the recipe's groups), gathered as E4M3. Of the ``vocab`` parameters, in the compute
    layout: ``lookup``, tables indexed by token id (``[vocab, ...]``), with ``lookup_stored`` and
    ``lookup_grads`` the elements and gradients as stored; ``projection``, matmuls onto the
    vocabulary (``[..., vocab]``, or a tied table), with ``projection_stored`` its elements as stored,
    ``projection_grads`` its stored gradients (0 when tied) and ``projection_reduced`` when its
    gradient is summed over the batch's devices.
    ``gathering``: ZeRO-3 gathers weights (fsdp > 1). The rest: the elements the ZeRO axis shards
    (gathered and as stored) and the gradient elements reduced over fsdp and over data."""

    stored: float
    grads: float
    moments: float
    layer_copy: float
    layer_loop_grads: float
    layer_split_moments: float
    layer_gathered: float
    layer_experts: float
    lookup: float
    lookup_stored: float
    lookup_grads: float
    projection: float
    projection_stored: float
    projection_grads: float
    projection_reduced: bool
    gathering: bool
    zero_sharded_total: float
    zero_sharded_local: float
    fp8_gathered: float
    fsdp_reduced: float
    data_reduced: float


def param_terms(layout: Layout, flat: SpecTables) -> ParamTerms:
    """``ParamTerms`` of ``layout`` from its spec tables; they depend on the mesh, the rules and the
    ZeRO stage only."""
    stages = layout.stages
    sums = dict(stored=0.0, grads=0.0, moments=0.0, layer_copy=0.0, layer_loop_grads=0.0, layer_split_moments=0.0,
                layer_gathered=0.0, layer_experts=0.0,
                lookup=0.0, lookup_stored=0.0, lookup_grads=0.0, projection=0.0, projection_stored=0.0,
                projection_grads=0.0,
                zero_sharded_total=0.0, zero_sharded_local=0.0,
                fp8_gathered=0.0, fsdp_reduced=0.0, data_reduced=0.0)
    fp8_groups = layout.train.fp8_groups
    gathering = layout.zero.stage >= ZeroStage.PARAMETERS and layout.mesh_shape[ZERO_AXIS] > 1
    projection_reduced, tables = False, []
    # The family's other stacks of layers (``AxisRole.STACKED``: dense layers, prediction depths): their
    # compute copy and gradients are held as the layers' are.
    other_stacks = {axis for axis, role in layout.family.axis_roles.items() if role is AxisRole.STACKED}
    for path, variable in nnx.to_flat_state(layout.abstract_params):
        size = math.prod(variable.shape)
        sharded, p, g, o, c = (size / math.prod(layout.ways(table[path])) for table in flat)
        compute_axes = {axis for entry in flat[-1][path] for axis in mesh_axes_of(entry)}
        sums["stored"] += p
        sums["grads"] += g
        sums["moments"] += o
        sums["fsdp_reduced"] += c if ZERO_AXIS not in compute_axes else 0.0
        sums["data_reduced"] += g if "data" not in compute_axes else 0.0
        zero_split = sharded < c
        if zero_split:
            sums["zero_sharded_total"] += c
            sums["zero_sharded_local"] += p
            group = variable.get_metadata().get(MATMUL_GROUP)
            if group in fp8_groups:
                sums["fp8_gathered"] += c
        axes = logical_axes_of(variable)
        if path[0] == LAYERS_KEY or (axes and axes[0] in other_stacks):
            sums["layer_copy"] += p if gathering and zero_split else c
            sums["layer_loop_grads"] += g if layout.zero.stage >= ZeroStage.GRADIENTS and zero_split else c
            split = any(layout.mesh_shape[a] > 1 for a in compute_axes - {STAGE})
            sums["layer_split_moments"] += o if split else 0.0
        if path[0] == LAYERS_KEY:
            per_layer = c / (variable.shape[0] / (stages if stages > 1 else 1))
            if gathering and zero_split:
                sums["layer_gathered"] += per_layer
            if any(axis in layout.expert_axes for axis in axes):
                sums["layer_experts"] += per_layer
        elif "vocab" in axes and axes[0] == "vocab":
            sums["lookup"] += c
            sums["lookup_stored"] += p
            sums["lookup_grads"] += g
            tables.append(c)
        elif "vocab" in axes:
            sums["projection"] += c
            sums["projection_stored"] += p
            sums["projection_grads"] += g
            projection_reduced |= any(layout.mesh_shape[a] > 1 and a not in compute_axes for a in ("data", ZERO_AXIS))
    if not sums["projection"] and tables:  # tied: the table is the projection too
        sums["projection"], sums["projection_stored"] = sum(tables), sums["lookup_stored"]
        projection_reduced = any(layout.mesh_shape[a] > 1 for a in ("data", ZERO_AXIS))
    return ParamTerms(**sums, projection_reduced=projection_reduced, gathering=gathering)


def lora_terms(layout: Layout) -> tuple[float, float, float]:
    """Elements per device of ``train.lora``'s adapters as the ZeRO stage stores them: (stored,
    gradients, optimizer moments)."""
    abstract = LoraTraining(layout.train.lora, layout.abstract_params, layout.family).abstract_adapters()
    specs = layout.state_specs(params=abstract)
    sizes = [math.prod(variable.shape) for _, variable in nnx.to_flat_state(abstract)]
    return tuple(sum(size / math.prod(layout.ways(spec.get_value())) for size, (_, spec) in
                     zip(sizes, nnx.to_flat_state(part)))
                 for part in (specs.params, specs.grads, specs.optimizer))


@dataclasses.dataclass(frozen=True)
class HeldState:
    """Per-device bytes of the trained state (the step's arguments and outputs; the state is donated,
    so outputs alias it), of the update phase and of the batch; ``grad_elements``: the gradients'
    elements (an accumulator's size)."""

    params: int
    grads: int
    optimizer: int  # resting on the device (0 when offloaded)
    optimizer_host: int
    update: int
    batch: int
    grad_elements: float


def held_state(layout: Layout, terms: ParamTerms, adapters: tuple[float, float, float] | None,
               compute_bytes: int, offload: bool, constants: Constants) -> HeldState:
    """fp32 parameters (4 B), fp32 Adam ``mu`` + ``nu`` (8 B) as the ZeRO stage stores them; under
    ``train.lora`` (``adapters``: ``lora_terms``) the parameters frozen in the compute dtype and the
    adapters (fp32, laid out by the rules as their bases) alone with gradients and moments. The batch
    ``{inputs, targets, mask}``: 12 B per local token, whole rows."""
    p_local, g_local, o_local = terms.stored, terms.grads, terms.moments
    params = round(FP32 * p_local)
    if adapters is not None:
        a_local, g_local, o_local = adapters
        params = round(compute_bytes * p_local + FP32 * a_local)
    moments = round(2 * FP32 * o_local)
    # The update phase: an offloaded optimizer state is brought to the device, both moments of every
    # leaf at once (XLA:CPU: the offloaded 7B's temp is 8 B per parameter to within 2 kB); else the
    # fp32 gradients (cast from the compute dtype) and one fp32 temporary per optimizer element (the
    # step every leaf takes, formed before any is applied: 8B models, ZeRO-0 and ZeRO-3). A compiler
    # that updates in place (``Constants.update_in_place``) holds the fp32 gradients alone, and where
    # ZeRO-1/2 shards the optimizer but not the parameters the new shards (one fp32 per optimizer
    # element) and the parameters all-gathered from them (XLA:GPU, 8B ZeRO-0/1/2 on fsdp 8), and beside
    # them ``Constants.update_split_moments`` per element of the moments of the stacked layers' weights
    # that tensor parallelism splits too.
    if offload:
        update = 2 * FP32 * o_local
    elif not constants.update_in_place:
        update = FP32 * (g_local + o_local)
    else:
        gathers = 1 <= layout.zero.stage <= 2 and terms.zero_sharded_total > 0
        new_shards = o_local + (terms.zero_sharded_total + constants.update_split_moments * terms.layer_split_moments
                                if adapters is None else 0)
        update = FP32 * (g_local + (new_shards if gathers else 0))
    update = round(update)
    batch = BATCH_BYTES_PER_TOKEN * layout.rows_per_shard * layout.train.grad_accum * layout.model.seq_len
    return HeldState(params, round(FP32 * g_local), 0 if offload else moments, moments if offload else 0, update,
                     batch, g_local)


def held_through_backward(terms: ParamTerms, compute_bytes: int, constants: Constants) -> float:
    """Held from the forward through the backward besides the stash, without a pipeline: below fp32
    the compute copy of the layers' weights (where they rest: the ZeRO shard of a gathered weight,
    in fp32 on XLA:CPU: ``Constants.held``), the layers' gradients as the backward writes them (compute dtype,
    in the loop's layout) and the lookup tables' fp32 gradients (accumulation's buffers:
    ``accumulation_bytes``)."""
    held = ((constants.held_bytes(compute_bytes) * terms.layer_copy if compute_bytes != FP32 else 0.0)
            + compute_bytes * terms.layer_loop_grads)
    return held + FP32 * terms.lookup_grads


def accumulation_bytes(layout: Layout, state: HeldState, stash: float, constants: Constants) -> float:
    """Held through every microbatch's forward and backward under ``train.grad_accum`` > 1 (0 without):
    the fp32 gradient accumulator and more copies of ``stash``, the bytes the backward keeps:
    ``Constants.tensor_zero3_stash_copies`` where ZeRO-3 gathers tensor-parallel layers, else
    ``Constants.accumulated_stash_copies``."""
    if layout.train.grad_accum == 1:
        return 0.0
    tensor_zero3 = layout.zero.stage >= ZeroStage.PARAMETERS and layout.mesh_shape["tensor"] > 1
    copies = constants.tensor_zero3_stash_copies if tensor_zero3 else constants.accumulated_stash_copies
    return FP32 * state.grad_elements + copies * stash

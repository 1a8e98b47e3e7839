"""The analytic per-device memory and step-time model of one meshtrain layout (no compilation).

It reads the layout from the same ``Layout`` that ``meshtrain.trainer.Trainer`` builds from
(the rules, the ZeRO stage, the pipeline, every feasibility check), so the planner and the trainer
cannot disagree on what runs or how it is split (see docs/memory.md for the derivation):

* **State** (the step's arguments and outputs; the state is donated, so outputs alias it):
  fp32 parameters (4 B), fp32 Adam ``mu`` + ``nu`` (8 B) and a few scalars, split per parameter by
  the rules table (``embed -> fsdp``, ``heads/kv_heads/mlp/vocab -> tensor``, ``layers -> stage``
  when pipelining, ``experts -> data x fsdp`` for expert parallelism) and by the ZeRO stage
  (``zero.py``: stage < 3 drops ``fsdp`` from parameters, < 2 from gradients, < 1 from the
  optimizer state, except from the experts, which stay on their ranks): the specs of
  ``Layout.state_specs``. ``offload.optimizer`` moves the optimizer bytes to host memory.
  The batch ``{inputs, targets, mask}`` adds 12 B per local token.
* **Temporaries** (XLA's temp bytes), modelled on XLA:CPU's buffer assignment at 8B-class widths
  (``scripts/plan_accuracy.py``): the largest of three phases on top of what the step holds from
  the forward through the backward (the stash, in fp32 on XLA:CPU; below fp32 the layers' compute
  copy, fp32 on XLA:CPU; the layers' gradients as the backward writes them; the lookup table's
  gradient; the accumulator): the **loss phase** (the vocabulary weights in the compute dtype, the
  projection's fp32 gradient and its all-reduced sum, one chunk of logits), the **layer phase** (one
  layer's gathered weights and its working set, or tensor parallelism's fp32 reduction buffers) and
  the **update phase** (the fp32 gradients and one fp32 step per optimizer element; with an offloaded
  optimizer state, both moments brought to the device). A pipeline's backward is instead what the
  executor's carry holds through the table (stash, fp32 gradient sums, the layers' compute copy)
  plus, per XLA while loop of its ticks, the head's gathered weights, a second copy of a buffer the
  loop both writes and reads, and the loop's largest slot (forward, backward, ZB-H1's halves, head).

Activation bytes per token and layer are the model family's (``ModelFamily.activation_bytes``),
scaled by coefficients fitted to XLA:CPU's ``memory_analysis`` (fp32) of the real train step
(``ACTIVATION_COEFFICIENTS``, docs/memory.md).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from flax import nnx

from meshtrain.mesh import LAYOUT_ORDER, MESH_AXES
from meshtrain.parallel.executor import Signature, tick_runs
from meshtrain.param_terms import SpecTables, param_terms, spec_tables
from meshtrain.parallel.layout import Layout
from meshtrain.parallel.pipeline import Schedule
from meshtrain.errors import ConfigError
from meshtrain.lora import LoraTraining
from meshtrain.loss import chunk_length
from meshtrain.parallel.ring_attention import sub_block_length
from meshtrain.parallel.rules import Preset, mesh_axes_of
from meshtrain.parallel.schedules import SENDS_GRADIENT, ScheduleTable, Work
from meshtrain.parallel.sharding import ring_axis
from models.common import RematPolicy
from models.kernels.attention import AttentionKernel
FP32 = 4
BATCH_BYTES_PER_TOKEN = 3 * 4  # inputs, targets (int32) and mask (f32)
STATE_SCALAR_BYTES = 64  # step, skipped_steps, loss scale, Adam/schedule counts (rounded up)

# Why a pipeline layout's verdict is marked (docs/memory.md tables the measured errors).
UNRELIABLE = ("pipeline temp memory is estimated within 5% of XLA:CPU's memory analysis with every schedule (12 "
              "layouts at 8B and 10B widths, scripts/plan_accuracy.py), but pipelines stay ranked after the layouts "
              "that fit for certain; confirm with --verify, whose verdict overrules this one")
# The margin on temp bytes a layout without a pipeline must fit with to be vouched for (``fits``):
# set at 12% of the estimate when the accuracy matrix's largest shortfall was -10.5% of XLA:CPU's (8B,
# remat none, since modelled); on the matrix of 2026-12-05 (28 layouts, dropless MoE and FP8 included,
# scripts/plan_accuracy.py) the largest is -3.5%, and the margin is kept for the shapes it lacks.
TEMP_MARGIN = 0.12
# Multiplier of one layer's structural working set (``per_layer_bytes``), fitted (minimax)
# to XLA:CPU's temp bytes of the real fp32 train step on mesh (1, 8, 1, 1), ZeRO-3, over 13 model
# shapes per policy (docs/memory.md): XLA reuses some buffers within the layer's backward.
ACTIVATION_COEFFICIENTS: dict[RematPolicy, float] = {
    RematPolicy.NONE: 0.82,
    RematPolicy.FULL: 0.92,
    RematPolicy.DOTS: 0.75,
}
# The loss phase holds one chunk's logits (``train.loss_chunk`` positions per row: ``meshtrain.loss``)
# in the compute dtype and three fp32 [chunk tokens, vocab] buffers (fp32 logits, softmax, their
# gradient); it is live before the layers' backward, so the peak takes the larger of the two phases.
LOGITS_FP32_COPIES = 3
# Residual-stream-wide fp32 buffers per token that a layer's backward holds for tensor parallelism's
# reductions, fitted on 8B-class layouts (1, 1, 8, 1) and (1, 2, 4, 1) with sequence parallelism
# (docs/memory.md): 12.8 and 13.8 of them, 11 keeping the other TP layouts of the matrix within 10%.
TENSOR_REDUCTION_BUFFERS = 11
# Residual-stream-wide fp32 vectors per token and layer in ZB-H1's cut besides its compute-dtype
# values (XLA:CPU's buffers of the 8B ZB-H1 layouts: four, beside their bf16 copies).
CUT_FP32_RESIDUALS = 4
# XLA:CPU widens bf16 values the step keeps (stash, compute copies of the layers) to fp32.
HELD = 4


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One candidate: mesh sizes, ZeRO stage, remat policy, pipeline microbatches, offload, gradient
    accumulation steps, (with a pipeline) the schedule and its virtual stages (None: the config's),
    and the sharding preset (None: the config's; ``sharding.rules`` overrides apply to either)."""

    data: int
    fsdp: int
    tensor: int
    stage: int
    zero: int
    remat: RematPolicy
    microbatches: int = 1
    offload: bool = False
    grad_accum: int = 1
    schedule: Schedule | None = None
    virtual_stages: int = 1
    preset: Preset | None = None

    @property
    def mesh(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in MESH_AXES}

    @property
    def devices(self) -> int:
        return math.prod(self.mesh.values())

    def overrides(self) -> list[str]:
        """``section.field=value`` overrides that make a config use this layout."""
        out = [f"mesh.{axis}={size}" for axis, size in self.mesh.items()]
        out += [f"zero.stage={self.zero}", f"model.remat={self.remat.value}",
                f"offload.optimizer={str(self.offload).lower()}", f"train.grad_accum={self.grad_accum}"]
        if self.stage > 1:
            out.append(f"pipeline.microbatches={self.microbatches}")
            if self.schedule is not None:
                out += [f"pipeline.schedule={self.schedule.value}", f"pipeline.virtual_stages={self.virtual_stages}"]
        if self.preset is not None:
            out.append(f"sharding.preset={self.preset.value}")
        return out

    @property
    def schedule_label(self) -> str:
        """The pipeline column: ``1f1b``, ``interleaved x2``, ... (``-`` without a pipeline)."""
        if self.stage == 1 or self.schedule is None:
            return "-"
        return self.schedule.value + (f" x{self.virtual_stages}" if self.virtual_stages > 1 else "")

    def label(self) -> str:
        return f"({self.data},{self.fsdp},{self.tensor},{self.stage})"


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Roofline constants: peak FLOP/s per device, link bandwidths (bytes/s), devices per node."""

    peak_flops: float = 989e12
    intra_node_bandwidth: float = 450e9
    inter_node_bandwidth: float = 50e9
    node_size: int = 8


@dataclasses.dataclass
class Estimate:
    """Per-device bytes of one layout, its step-time estimate, and why it cannot run (if so)."""

    candidate: Candidate
    params: int = 0
    grads: int = 0
    optimizer: int = 0  # resting on the device (0 when offloaded)
    optimizer_host: int = 0
    activations: int = 0  # kept for the backward pass
    temporaries: int = 0  # compute copy, gathered weights, one layer's working set, a chunk of logits
    update: int = 0  # the update phase: an offloaded optimizer state's moments brought to the device
    batch: int = 0
    compute_s: float = 0.0
    comm_s: dict[str, float] = dataclasses.field(default_factory=dict)
    bubble: float = 0.0  # the pipeline table's idle share (F = 1, B = 2, I = W = 1)
    in_flight: int = 0  # the table's peak chunk activations in flight on a stage (0 without a pipeline)
    reasons: list[str] = dataclasses.field(default_factory=list)  # structural: cannot run at all

    @property
    def total(self) -> int:
        """Peak device bytes: the state, the batch and the temporaries."""
        return self.params + self.optimizer + self.batch + self.temp_bytes

    @property
    def argument_bytes(self) -> int:
        """XLA's argument bytes: the state and the batch."""
        return self.params + self.optimizer + self.optimizer_host + STATE_SCALAR_BYTES + self.batch

    @property
    def output_bytes(self) -> int:
        """XLA's output bytes: the new state (aliasing the donated one) and the metrics."""
        return self.params + self.optimizer + self.optimizer_host + STATE_SCALAR_BYTES

    @property
    def backward_bytes(self) -> int:
        """The backward phase's temp bytes: kept activations and temporaries (the gradients as the
        backward writes them among them)."""
        return self.activations + self.temporaries

    @property
    def temp_bytes(self) -> int:
        """XLA's temp bytes: everything the step allocates besides arguments and outputs. The compute
        copy, activations and temporaries are dead by the time the update runs, so the two phases
        share memory."""
        return max(self.backward_bytes, self.update)

    @property
    def reliable(self) -> bool:
        """False where the model is known to be far off: pipeline layouts' activation (temp) bytes."""
        return self.candidate.stage == 1

    @property
    def step_s(self) -> float:
        return self.compute_s + sum(self.comm_s.values())


def _axis_bandwidth(axis: str, mesh: Mapping[str, int], hw: Hardware) -> float:
    inner = math.prod(mesh[a] for a in LAYOUT_ORDER[LAYOUT_ORDER.index(axis):])
    return hw.intra_node_bandwidth if inner <= hw.node_size else hw.inter_node_bandwidth


def _schedule_table(layout: Layout) -> ScheduleTable | None:
    """The run's pipeline table (None without a pipeline, or when it cannot run: ``problems`` says why)."""
    if layout.stages == 1:
        return None
    try:
        table = layout.pipeline.schedule_table(layout.stages)
    except ConfigError:
        return None
    return None if table.problems() else table


_LOOPS: dict[int, tuple[ScheduleTable, list[Signature]]] = {}


def tick_loops(table: ScheduleTable) -> list[Signature]:
    """The executor's loops over ``table``'s ticks, in order, as (slot kinds, runs the head): one XLA
    while loop per run of ticks with one signature (``meshtrain.parallel.executor.tick_runs``; a
    repeated block's runs are one loop each). Kept per table (the builders return one per shape; a
    custom table is read anew each time, so the memo is emptied past a few hundred)."""
    if id(table) not in _LOOPS:
        if len(_LOOPS) >= 256:
            _LOOPS.clear()
        _LOOPS[id(table)] = (table, [signature for _, block in tick_runs(table) for signature, _ in block])
    return _LOOPS[id(table)][1]


def estimate(layout: Layout, candidate: Candidate, *, compute_bytes: int, hw: Hardware,
             specs: SpecTables | None = None, memo: dict | None = None) -> Estimate:
    """The analytic estimate of ``candidate``, laid out by ``layout`` (see the module docstring and
    docs/memory.md); ``specs``: ``spec_tables(layout)``, when the caller has them; ``memo``: a dict
    the caller keeps across the candidates of one config and rules, where what depends on the mesh
    and the ZeRO stage alone is computed once (the parameters' terms, ``param_terms``, and their
    divisibility, ``Layout.parameter_problems``)."""
    est = Estimate(candidate)
    model, family = layout.model, layout.family
    mesh = layout.mesh_shape
    stages = layout.stages
    batch_size, grad_accum = layout.train.batch_size, layout.train.grad_accum
    # Structural feasibility: the trainer's own checks (``Layout.problems``), as short reasons.
    if candidate.remat not in ACTIVATION_COEFFICIENTS:
        est.reasons.append(f"remat {candidate.remat.value} is not modelled")
    if memo is None:
        est.reasons += [problem.reason for problem in layout.problems()]
    else:
        est.reasons += [problem.reason for problem in layout.problems(parameters=False)]
        key = ("parameters", tuple(mesh.values()))
        if key not in memo:
            memo[key] = [problem.reason for problem in layout.parameter_problems()]
        est.reasons += [reason for reason in memo[key] if reason not in est.reasons]
    rows = layout.rows_per_shard
    micro = layout.pipeline.microbatches if stages > 1 else 1

    zero = candidate.zero
    flat = specs if specs is not None else spec_tables(layout)
    key = ("terms", tuple(mesh.values()), zero)
    terms = memo.get(key) if memo is not None else None
    if terms is None:
        terms = param_terms(layout, flat)
        if memo is not None:
            memo[key] = terms
    p_local, g_local, o_local = terms.stored, terms.grads, terms.moments
    zero_sharded_total, fsdp_reduced, data_reduced = terms.zero_sharded_total, terms.fsdp_reduced, terms.data_reduced
    est.params = round(FP32 * p_local)
    if layout.train.lora.enabled:
        # train.lora: the parameters frozen in the compute dtype; the adapters (fp32, laid out by the
        # rules as their bases) alone have gradients and moments.
        key = ("lora", tuple(mesh.values()), zero)
        adapters = memo.get(key) if memo is not None else None
        if adapters is None:
            adapters = lora_terms(layout)
            if memo is not None:
                memo[key] = adapters
        a_local, g_local, o_local = adapters
        est.params = round(compute_bytes * p_local + FP32 * a_local)
    est.grads = round(FP32 * g_local)
    if candidate.offload:
        est.optimizer_host = round(2 * FP32 * o_local)
    else:
        est.optimizer = round(2 * FP32 * o_local)
    # The update phase: an offloaded optimizer state is brought to the device, both moments of every
    # leaf at once (XLA:CPU: the offloaded 7B's temp is 8 B per parameter to within 2 kB); else the
    # fp32 gradients (cast from the compute dtype) and one fp32 temporary per optimizer element (the
    # step every leaf takes, formed before any is applied: 8B models, ZeRO-0 and ZeRO-3).
    est.update = round(2 * FP32 * o_local if candidate.offload else FP32 * (g_local + o_local))

    # Activations. Tokens per device per accumulation microbatch: context parallelism splits the
    # positions ``cp`` ways; sequence parallelism splits the residual stream ``sp`` ways more.
    cp = layout.length_ways
    sp = max(1, layout.ways(layout.rules.activation_spec(("sequence",)))[0] // cp)
    tokens = rows * model.seq_len / cp
    layers_here = model.num_layers // stages if model.num_layers % stages == 0 else model.num_layers
    vocab_local = model.vocab_size / mesh["tensor"]
    kv_width = (family.key_value_width(model, mesh["tensor"]) if family.key_value_width is not None
                else 2 * model.embed_dim)
    a_working = ACTIVATION_COEFFICIENTS.get(candidate.remat, 1.0)
    # The blockwise kernels hold one [query block, key block] tile of scores at a time: per query of
    # the device's seq_len / CP, q_block x k_block / (seq_len / CP) keys. Ring attention's tiles are
    # sub-blocks of a rank's positions; the blockwise kernel's ``model.attention_block`` positions
    # (its queries: the device's share under all-gather CP, its keys: the whole row). The dense
    # kernel (``xla``) spans every key.
    ring_name = ring_axis(layout.rules)
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
    expert_mesh_axes = [a for axis in layout.expert_axes
                        for a in mesh_axes_of(layout.rules.activation_spec((axis,))[0]) if mesh[a] > 1]
    experts = math.prod(mesh[a] for a in expert_mesh_axes)
    # XLA:CPU holds what the backward keeps, and the layers' compute copies, in fp32 whatever the
    # compute dtype (it widens bf16 arithmetic and all-gathers), so they count at HELD bytes; a
    # pipeline's stash keeps the compute dtype (``kept``: the executor's buffers) and is widened one
    # microbatch at a time, for its backward.
    fp8 = layout.train.fp8_groups
    saved, _ = family.activation_bytes(model, mesh["tensor"], candidate.remat, HELD, sp, keys, experts, fp8)
    kept, working = family.activation_bytes(model, mesh["tensor"], candidate.remat, compute_bytes, sp, keys, experts,
                                            fp8)
    est.activations = round(layers_here * tokens * saved)
    table = None if est.reasons else _schedule_table(layout)  # a layout that cannot be built has none
    working_tokens = tokens / micro
    loops: list[Signature] = []
    if table is not None:
        # The stash: its slots of one chunk's residuals (1/V of a stage's layers, one microbatch) in
        # the compute dtype, as the forward makes them; ZB-H1's cut: its slots of what a microbatch's
        # input-gradient half hands its weight-gradient half for the chunk's layers (below). And the
        # executor's fp32 buffers of received activations and gradients, one microbatch each.
        _, buffers = table.buffers()
        loops = tick_loops(table)
        chunk_tokens = layers_here / table.chunks * working_tokens  # one chunk's layers x one microbatch's tokens
        # ZB-H1's cut per token and layer, what the input-gradient half hands the weight-gradient half:
        # each weight matmul's input and its output's cotangent, counted as twice the outputs ``dots``
        # keeps (XLA:CPU, 8B: 4d + 2q + 2k + 4f in the compute dtype), and beside them four
        # residual-width vectors in fp32 (``CUT_FP32_RESIDUALS``); the weight-gradient half widens
        # all of it to fp32 (``cut_per_token``: compute dtype, fp32).
        cut_residuals = CUT_FP32_RESIDUALS * model.embed_dim / sp * FP32
        cut_per_token = [2 * family.activation_bytes(model, mesh["tensor"], RematPolicy.DOTS, nbytes, sp, keys,
                                                     experts, fp8)[0] + cut_residuals
                         for nbytes in (compute_bytes, HELD)]
        stash = buffers.stash * chunk_tokens * kept
        cut = buffers.cut * chunk_tokens * cut_per_token[0] if table.splits_backward else 0.0
        # A loop's second copy of the cut is of its compute-dtype values only (the fp32 ones stay single).
        cut_copy = buffers.cut * chunk_tokens * (cut_per_token[0] - cut_residuals) if table.splits_backward else 0.0
        est.activations = round(stash + cut + (buffers.inputs + buffers.gradients + 2) * working_tokens
                                * model.embed_dim * FP32)
    est.batch = BATCH_BYTES_PER_TOKEN * rows * grad_accum * model.seq_len  # token arrays: whole rows
    # Held from the forward through the backward besides the stash: below fp32 the compute copy of the
    # layers' weights (where they rest: the ZeRO shard of a gathered weight), the layers' gradients as
    # the backward writes them (compute dtype, in the loop's layout), the lookup tables' fp32
    # gradients, and with accumulation the fp32 accumulator.
    low_precision = compute_bytes != FP32
    accumulator = FP32 * g_local if grad_accum > 1 else 0.0
    held = (HELD * terms.layer_copy if low_precision else 0.0) + compute_bytes * terms.layer_loop_grads
    held += FP32 * terms.lookup_grads + accumulator
    # The loss phase (the head's forward and backward, one chunk of positions at a time): the
    # vocabulary weights in the compute dtype (the projection twice when ZeRO-3 gathers it) and the
    # projection's fp32 gradient (and its sum over the batch's devices, an all-reduce on XLA:CPU), one
    # chunk's logits and their fp32 softmax pieces.
    head_length = model.seq_len // stages
    head_chunk = chunk_length(head_length, layout.train.loss_chunk, cp)
    loss_tokens = rows / micro * head_chunk / cp
    vocab_bytes = compute_bytes if low_precision else (FP32 if terms.gathering else 0)
    vocab_copies = (terms.lookup + terms.projection * (2 if terms.gathering else 1)) * vocab_bytes
    head_work = (FP32 * terms.projection * (2 if terms.projection_reduced else 1)
                 + loss_tokens * vocab_local * (compute_bytes + LOGITS_FP32_COPIES * FP32))
    loss_phase = vocab_copies + head_work
    # The layers' backward: one layer's ZeRO-gathered weights (fp32) and one layer's working set.
    gathered = terms.layer_gathered * FP32
    # And one layer's experts, which no gather counts: their weight gradients in fp32 as the backward
    # sums them (the blocked kernel's accumulators ``dw``, models/kernels/grouped_matmul.py; the one-hot
    # dispatch's einsums likewise sum in fp32), those cast to the compute dtype, and the layer's
    # expert weights in the compute dtype (XLA:CPU's buffers of DeepSeek-V3's 8-layer dropless step
    # at EP 8: 5.6 + 2.8 + 2.8 GB).
    layer_experts = terms.layer_experts * (FP32 + 2 * compute_bytes)
    layer_work = a_working * working_tokens * working
    if mesh["tensor"] > 1 and low_precision:
        # Tensor parallelism's partial sums of the residual stream: XLA:CPU promotes the bf16
        # all-reduces of one layer's backward to fp32, operands and results beside the bf16 ones.
        layer_work += TENSOR_REDUCTION_BUFFERS * working_tokens * model.embed_dim / sp * FP32
    if cp > 1 and ring_size == 1:
        # Context parallelism's all-gather scheme: the whole rows' keys and values and their
        # gradients, in fp32 on XLA:CPU.
        layer_work += 2 * rows / micro * model.seq_len * kv_width * FP32
    residual = working_tokens * model.embed_dim * FP32
    if table is None:
        est.temporaries = round(held + max(gathered + layer_experts + layer_work, loss_phase) + residual)
    else:
        # A pipeline (XLA:CPU's buffers, 8B and 10B, every schedule): through the whole table the
        # stage holds its layers' compute copy, its layers' and the rest's gradients summed over the
        # microbatches in fp32 (the executor's carry); the rest is per loop of ticks (``tick_loops``).
        held = (FP32 * terms.layer_loop_grads + (compute_bytes * terms.layer_copy if low_precision else 0.0)
                + FP32 * (terms.lookup_grads + terms.projection_grads) + accumulator)
        # The head's weights in the compute dtype: the lookup table where it rests and the projection,
        # which ZeRO-3 gathers; each loop that runs the head takes its own two gathered copies (forward
        # and backward), all made before the first loop and each released when its loop ends.
        heads_left = [sum(has_head for _, has_head in loops[i:]) for i in range(len(loops))]
        head_weights = [(compute_bytes * terms.lookup_stored if low_precision else 0.0)
                        + vocab_bytes * terms.projection * (2 * left if terms.gathering else 1) for left in heads_left]
        # A chunk's layers widened to fp32 while they run (XLA:CPU computes bf16 matmuls in fp32).
        chunk_fp32 = (HELD * terms.layer_copy if low_precision else 0.0) / table.chunks
        # A forward slot: one layer's gathered weights, the microbatch's residuals as its layers make
        # them, and on the first stage the lookup table gathered for the embedding.
        forward = (chunk_fp32 + gathered + chunk_tokens * kept
                   + (terms.lookup - terms.lookup_stored) * vocab_bytes)
        # A backward slot: the microbatch's stash widened to fp32, the chunk's gradients as its backward
        # writes them (compute dtype), and per layer its gathered weights and its experts with its
        # working set, then (the larger at 8B-10B widths) its full fp32 gradients with their sum over
        # fsdp (an all-reduce on XLA:CPU; it reduce-scatters the gradients of a gathered weight).
        backward = (chunk_fp32 + chunk_tokens * saved + compute_bytes * terms.layer_loop_grads / table.chunks
                    + gathered + layer_experts + max(layer_work, gathered))
        # ZB-H1's halves: the input-gradient half as a backward slot without the weights' gradients,
        # making the cut (of the chunk for its microbatch); the weight-gradient half, which needs no
        # weights, the cut widened to fp32 and the chunk's gradients (XLA:CPU, 8B: 53.1 GB of temp
        # against 17.9 GB for 1F1B on the same layout).
        input_grad = (chunk_fp32 + chunk_tokens * (saved + cut_per_token[0]) + gathered + layer_experts
                      + max(layer_work, gathered))
        weight_grad = chunk_tokens * cut_per_token[1] + compute_bytes * terms.layer_loop_grads / table.chunks
        slot = {Work.FORWARD: forward, Work.BACKWARD: backward, Work.INPUT_GRAD: input_grad,
                Work.WEIGHT_GRAD: weight_grad}
        # A loop that both writes and reads the stash (a forward and a backward half) or the cut (the
        # two halves) holds that buffer twice: XLA:CPU copies the carried buffer there instead of
        # updating it in place (1F1B's, interleaved's and ZB-H1's steady loops; GPipe's forwards and
        # backwards are separate loops, and ZB-H1's cut is single until its W slots start).
        backward_kinds = (Work.BACKWARD, Work.INPUT_GRAD, Work.WEIGHT_GRAD)
        phases = [weights + max([slot[w] for w in works] + ([head_work] if has_head else []))
                  + (stash if Work.FORWARD in works and any(w in works for w in backward_kinds) else 0.0)
                  + (cut_copy if Work.INPUT_GRAD in works and Work.WEIGHT_GRAD in works else 0.0)
                  for (works, has_head), weights in zip(loops, head_weights)]
        est.temporaries = round(held + max(phases) + residual)

    # Roofline step time.
    global_tokens = batch_size * model.seq_len
    flops = family.flops_per_token(model) + family.recompute_flops_per_token(model, candidate.remat)
    if head_chunk < head_length:  # the chunked head's backward recomputes its logits (meshtrain.loss)
        flops += 2 * model.embed_dim * model.vocab_size
    if table is not None:
        est.bubble, est.in_flight = table.bubble(), table.peak_in_flight
    est.compute_s = global_tokens * flops / (candidate.devices * hw.peak_flops) / (1 - est.bubble)
    ring = lambda n: (n - 1) / n
    comm: dict[str, float] = {}
    local_tokens_step = tokens * grad_accum
    if mesh["tensor"] > 1:
        # Two all-reduces of [tokens, embed] per layer forward, two backward, two more to recompute.
        count = 4 + (2 if candidate.remat is RematPolicy.FULL else 0)
        comm["tensor"] = (model.num_layers / stages * count * 2 * ring(mesh["tensor"]) * local_tokens_step
                          * model.embed_dim * compute_bytes)
    if mesh["fsdp"] > 1:
        # ZeRO's parameters are gathered and their gradients reduced over fsdp; parameters held in
        # their compute layout (expert parallelism's experts) are neither gathered nor reduced.
        f = mesh["fsdp"]
        nbytes = 0.0
        if zero >= 3:
            # Gathers, forward and backward: fp32 (see above), FP8 weights as E4M3 (1 B).
            nbytes += 2 * grad_accum * ring(f) * ((zero_sharded_total - terms.fp8_gathered) * FP32 + terms.fp8_gathered)
        nbytes += grad_accum * (1 if zero >= 2 else 2) * ring(f) * fsdp_reduced * FP32  # RS or AR
        if 1 <= zero <= 2:
            nbytes += ring(f) * zero_sharded_total * FP32  # all-gather of the updated parameters
        comm["fsdp"] = nbytes
    if cp > 1:
        # Context parallelism: keys and values gathered (all-gather scheme) or passed round the ring
        # (ring scheme: the same (CP-1)/CP of them per device) per layer forward and again to
        # recompute, their gradients reduced backward (``kv_width`` wide, together).
        count = 1 + 1 + (1 if candidate.remat is RematPolicy.FULL else 0)
        for axis in mesh_axes_of(layout.rules.activation_spec(("length",))[0]):
            comm[axis] = comm.get(axis, 0.0) + (model.num_layers / stages * count * ring(cp) * rows * grad_accum
                                                * model.seq_len * kv_width * compute_bytes)
    if mesh["data"] > 1:
        comm["data"] = grad_accum * 2 * ring(mesh["data"]) * data_reduced * FP32
    if experts > 1 and family.exchange_bytes is not None:
        # Expert parallelism: the rows to the experts and the results back per layer forward, their
        # transposes backward, the forward's again to recompute; on the outermost axis it spans.
        count = 4 + (2 if candidate.remat is RematPolicy.FULL else 0)
        axis = next(a for a in LAYOUT_ORDER if a in expert_mesh_axes)
        comm[axis] = comm.get(axis, 0.0) + (model.num_layers * count * ring(experts) * local_tokens_step
                                            * family.exchange_bytes(model, experts, compute_bytes))
    if table is not None:
        # Per tick one activation forward, one gradient back; per head the reduce-scatter of the
        # last stage's output and the all-gather of its gradient.
        signatures = [table.signature(t) for t in range(len(table.ticks))]
        sends = sum((Work.FORWARD in works) + any(w in SENDS_GRADIENT for w in works) for works, _ in signatures)
        heads = sum(head for _, head in signatures)
        comm["stage"] = (grad_accum * (sends + 2 * ring(stages) * heads) * working_tokens * model.embed_dim * FP32)
    est.comm_s = {axis: nbytes / _axis_bandwidth(axis, mesh, hw) for axis, nbytes in comm.items()}
    return est


def lora_terms(layout: Layout) -> tuple[float, float, float]:
    """Elements per device of ``train.lora``'s adapters as the ZeRO stage stores them: (stored,
    gradients, optimizer moments)."""
    abstract = LoraTraining(layout.train.lora, layout.abstract_params, layout.family).abstract_adapters()
    specs = layout.state_specs(params=abstract)
    sizes = [math.prod(variable.shape) for _, variable in nnx.to_flat_state(abstract)]
    return tuple(sum(size / math.prod(layout.ways(spec.get_value())) for size, (_, spec) in
                     zip(sizes, nnx.to_flat_state(part)))
                 for part in (specs.params, specs.grads, specs.optimizer))


def layout_estimate(layout: Layout, compute_bytes: int) -> Estimate:
    """``estimate`` of the layout a run was configured with (its mesh, ZeRO stage, remat, pipeline
    microbatches, offload and accumulation as they are)."""
    mesh = layout.mesh_shape
    candidate = Candidate(mesh["data"], mesh["fsdp"], mesh["tensor"], mesh["stage"], int(layout.zero.stage),
                          layout.model.remat, layout.pipeline.microbatches, layout.offload.optimizer,
                          layout.train.grad_accum, layout.pipeline.schedule, layout.pipeline.virtual_stages)
    return estimate(layout, candidate, compute_bytes=compute_bytes, hw=Hardware())

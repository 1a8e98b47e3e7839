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
* **Temporaries** (XLA's temp bytes): fp32 gradients in their ZeRO layout, the compute-dtype
  copy of the local parameters (bf16/fp16 only), the ZeRO-sharded weights of two layers gathered
  (experts are computed where they rest, never gathered), the activations the backward pass keeps
  (by ``model.remat``), one layer's working set, and the working set of one chunk of the logits
  (``train.loss_chunk`` positions per row, ``meshtrain.loss``). The update follows, after the
  activations are dead; it writes the new parameters and moments in place, so it adds
  nothing unless the optimizer state is offloaded: then the step brings the moments to the device,
  8 B per local optimizer element (``Estimate.update``), and the temp bytes are the larger of the
  two phases.

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
from meshtrain.parallel.layout import Layout
from meshtrain.parallel.pipeline import Schedule
from meshtrain.errors import ConfigError
from meshtrain.loss import chunk_length
from meshtrain.parallel.ring_attention import sub_block_length
from meshtrain.parallel.rules import Preset, mesh_axes_of
from meshtrain.parallel.schedules import SENDS_GRADIENT, ScheduleTable, Work
from meshtrain.parallel.sharding import ring_axis
from meshtrain.parallel.zero import ZERO_AXIS, ZeroStage
from models.attention import AttentionKernel
from models.common import RematPolicy
FP32 = 4
BATCH_BYTES_PER_TOKEN = 3 * 4  # inputs, targets (int32) and mask (f32)
STATE_SCALAR_BYTES = 64  # step, skipped_steps, loss scale, Adam/schedule counts (rounded up)

# Why a pipeline layout's verdict is marked (docs/memory.md tables the measured errors).
UNRELIABLE = ("pipeline temp memory is estimated within -29%..+9% of XLA:CPU's memory analysis on small "
              "layouts and 38-62% below it on 10B layouts (interleaved, ZB-H1, 8 stages); ranked after the "
              "layouts that fit for certain; confirm with --verify, whose verdict overrules this one")
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
        """The backward phase's temp bytes: gradients, kept activations and temporaries."""
        return self.grads + self.activations + self.temporaries

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


SpecTables = tuple[dict, ...]


def spec_tables(layout: Layout) -> SpecTables:
    """Per parameter path, the specs ``estimate`` reads: at rest under the rules, the ZeRO stage's
    params, grads and optimizer moments, and the compute layout. They depend on the rules, the ZeRO
    stage and whether there is a pipeline only, so a planner computes them once for all candidates
    that share those (``make_plan``)."""
    state, compute = layout.state_specs(), layout.state_specs(ZeroStage.NONE).params
    return tuple({path: spec.get_value() for path, spec in nnx.to_flat_state(tree)}
                 for tree in (layout.param_specs(), state.params, state.grads, state.optimizer, compute))


def _param_terms(layout: Layout, flat: SpecTables) -> tuple[float, ...]:
    """Per-device parameter element counts of ``layout`` from its spec tables: (params, grads,
    optimizer moments as stored; one layer's ZeRO-sharded weights as gathered for compute; of all
    parameters, those the ZeRO axis shards, gathered and as stored; gradient elements reduced over
    fsdp, and over data). They depend on the mesh, the rules and the ZeRO stage only."""
    stages = layout.stages
    p_local = g_local = o_local = 0.0
    layer_full = 0.0  # one layer's ZeRO-sharded weights as gathered for compute
    zero_sharded_total = 0.0  # of which the parameters the ZeRO axis shards (gathered, reduce-scattered)
    zero_sharded_local = 0.0  # the same parameters' elements as stored on the device (their shards)
    fsdp_reduced = data_reduced = 0.0  # gradient elements per device reduced over fsdp / over data
    # The state's specs (the ZeRO stage applied; experts keep their expert-parallel split) and the
    # compute layout of every parameter: the rules' split less the ZeRO axis (what ZeRO-0 stores).
    for path, variable in nnx.to_flat_state(layout.abstract_params):
        size = math.prod(variable.shape)
        sharded, p, g, o, c = (size / math.prod(layout.ways(table[path])) for table in flat)
        compute_axes = {axis for entry in flat[-1][path] for axis in mesh_axes_of(entry)}
        p_local, g_local, o_local = p_local + p, g_local + g, o_local + o
        fsdp_reduced += c if ZERO_AXIS not in compute_axes else 0.0
        data_reduced += g if "data" not in compute_axes else 0.0
        if sharded < c:
            zero_sharded_total += c
            zero_sharded_local += p
            if path[0] == "layers":
                layer_full += c / (variable.shape[0] / (stages if stages > 1 else 1))
    return (p_local, g_local, o_local, layer_full, zero_sharded_total, zero_sharded_local, fsdp_reduced,
            data_reduced)


def estimate(layout: Layout, candidate: Candidate, *, compute_bytes: int, hw: Hardware,
             specs: SpecTables | None = None, memo: dict | None = None) -> Estimate:
    """The analytic estimate of ``candidate``, laid out by ``layout`` (see the module docstring and
    docs/memory.md); ``specs``: ``spec_tables(layout)``, when the caller has them; ``memo``: a dict
    the caller keeps across the candidates of one config and rules, where what depends on the mesh
    and the ZeRO stage alone is computed once (the parameters' terms, ``_param_terms``, and their
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
        terms = _param_terms(layout, flat)
        if memo is not None:
            memo[key] = terms
    (p_local, g_local, o_local, layer_full, zero_sharded_total, zero_sharded_local, fsdp_reduced,
     data_reduced) = terms
    est.params = round(FP32 * p_local)
    est.grads = round(FP32 * g_local)
    if candidate.offload:
        est.optimizer_host = round(2 * FP32 * o_local)
    else:
        est.optimizer = round(2 * FP32 * o_local)
    # The update writes params and moments in place (``Trainer.step``); an offloaded optimizer
    # state is brought to the device for it, both moments of every leaf at once (XLA:CPU: the
    # offloaded 7B's temp is 8 B per parameter to within 2 kB).
    est.update = round(2 * FP32 * o_local) if candidate.offload else 0

    # Activations. Tokens per device per accumulation microbatch: context parallelism splits the
    # positions ``cp`` ways; sequence parallelism splits the residual stream ``sp`` ways more.
    cp = layout.length_ways
    sp = max(1, layout.ways(layout.rules.activation_spec(("sequence",)))[0] // cp)
    tokens = rows * model.seq_len / cp
    layers_here = model.num_layers // stages if model.num_layers % stages == 0 else model.num_layers
    vocab_local = model.vocab_size / mesh["tensor"]
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
    saved, working = family.activation_bytes(model, mesh["tensor"], candidate.remat, compute_bytes, sp, keys, experts)
    est.activations = round(layers_here * tokens * saved)
    table = None if est.reasons else _schedule_table(layout)  # a layout that cannot be built has none
    if table is not None:
        # The stash holds the table's peak in-flight chunk activations (1/V of a stage's each), and
        # the executor's fp32 buffers of received activations and gradients one microbatch each.
        _, buffers = table.buffers()
        est.activations = round(est.activations * table.peak_in_flight / table.chunks / micro)
        est.activations += round((buffers.inputs + buffers.gradients + 2) * tokens / micro * model.embed_dim * FP32)
    est.batch = BATCH_BYTES_PER_TOKEN * rows * grad_accum * model.seq_len  # token arrays: whole rows
    working_tokens = tokens / micro
    # Below fp32 compute, parameters used where they are stored get a compute-dtype copy; parameters
    # ZeRO-3 gathers are gathered in fp32 and cast after the gather (XLA:CPU runs bf16 all-gathers in
    # f32), so two layers' gathered weights are held in fp32 and in the compute dtype.
    low_precision = compute_bytes != FP32
    gathering = zero >= 3 and mesh["fsdp"] > 1
    copy = compute_bytes * (p_local - (zero_sharded_local if gathering else 0.0)) if low_precision else 0.0
    gathered = 2 * layer_full * (FP32 + (compute_bytes if low_precision else 0)) if gathering else 0.0
    layer_phase = a_working * working_tokens * working
    # The head runs on a stage's share of the positions (all of them without a pipeline), one chunk
    # of them at a time.
    head_length = model.seq_len // stages
    head_chunk = chunk_length(head_length, layout.train.loss_chunk, cp)
    loss_tokens = rows / micro * head_chunk / cp
    loss_phase = loss_tokens * vocab_local * (compute_bytes + LOGITS_FP32_COPIES * FP32)
    est.temporaries = round(copy + gathered + max(layer_phase, loss_phase)
                            + working_tokens * model.embed_dim * FP32)
    if grad_accum > 1:
        # The scan carries the fp32 accumulator, in the gradients' candidate.
        est.temporaries += round(FP32 * g_local)

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
            nbytes += 2 * grad_accum * ring(f) * zero_sharded_total * FP32  # gathers (fp32, see above), fwd and bwd
        nbytes += grad_accum * (1 if zero >= 2 else 2) * ring(f) * fsdp_reduced * FP32  # RS or AR
        if 1 <= zero <= 2:
            nbytes += ring(f) * zero_sharded_total * FP32  # all-gather of the updated parameters
        comm["fsdp"] = nbytes
    if cp > 1:
        # Context parallelism: keys and values gathered (all-gather scheme) or passed round the ring
        # (ring scheme: the same (CP-1)/CP of them per device) per layer forward and again to
        # recompute, their gradients reduced backward; counted at embed wide each, the bound GQA
        # stays under.
        count = 2 + 2 + (2 if candidate.remat is RematPolicy.FULL else 0)
        for axis in mesh_axes_of(layout.rules.activation_spec(("length",))[0]):
            comm[axis] = comm.get(axis, 0.0) + (model.num_layers / stages * count * ring(cp) * rows * grad_accum
                                                * model.seq_len * model.embed_dim * compute_bytes)
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


def layout_estimate(layout: Layout, compute_bytes: int) -> Estimate:
    """``estimate`` of the layout a run was configured with (its mesh, ZeRO stage, remat, pipeline
    microbatches, offload and accumulation as they are)."""
    mesh = layout.mesh_shape
    candidate = Candidate(mesh["data"], mesh["fsdp"], mesh["tensor"], mesh["stage"], int(layout.zero.stage),
                          layout.model.remat, layout.pipeline.microbatches, layout.offload.optimizer,
                          layout.train.grad_accum, layout.pipeline.schedule, layout.pipeline.virtual_stages)
    return estimate(layout, candidate, compute_bytes=compute_bytes, hw=Hardware())

"""The analytic per-device memory and step-time model of one meshtrain layout (no compilation).

It mirrors what ``meshtrain.trainer.Trainer`` builds (see docs/memory.md for the derivation):

* **State** (the step's arguments and outputs; the state is donated, so outputs alias it):
  fp32 parameters (4 B), fp32 Adam ``mu`` + ``nu`` (8 B) and a few scalars, split per parameter by
  the rules table (``embed -> fsdp``, ``heads/kv_heads/mlp/vocab -> tensor``, ``layers -> stage``
  when pipelining) and by the ZeRO stage (``zero.py``: stage < 3 drops ``fsdp`` from parameters,
  < 2 from gradients, < 1 from the optimizer state). ``offload.optimizer`` moves the optimizer
  bytes to host memory. The batch ``{inputs, targets, mask}`` adds 12 B per local token.
* **Temporaries** (XLA's temp bytes): fp32 gradients in their ZeRO layout, the compute-dtype
  copy of the local parameters (bf16/fp16 only), the activations the backward pass keeps (by
  ``model.remat``), one layer's working set, and the logits' working set.

Activation sizes are counted in *elements per token*; the counts per remat policy come from the
Llama layer's structure with coefficients fitted to XLA:CPU's ``memory_analysis`` (fp32) of the real
train step (``ACTIVATION_COEFFICIENTS``, docs/memory.md).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

from meshtrain.metrics import train_flops_per_token
from meshtrain.parallel.pipeline import Schedule, pipeline_rules
from meshtrain.parallel.rules import ShardingRules
from meshtrain.parallel.zero import ZERO_AXIS
from models.common import RematPolicy
from models.llama import LlamaConfig

MESH_AXES = ("data", "fsdp", "tensor", "stage")
# Device order, slowest to fastest varying (meshtrain.mesh): an axis is inside one node when it and
# every faster axis together fit in a node.
LAYOUT_ORDER = ("data", "stage", "fsdp", "tensor")
FP32 = 4
BATCH_BYTES_PER_TOKEN = 3 * 4  # inputs, targets (int32) and mask (f32)
STATE_SCALAR_BYTES = 64  # step, skipped_steps, loss scale, Adam/schedule counts (rounded up)

# Multiplier of one layer's structural working set (``per_layer_bytes``), fitted (minimax)
# to XLA:CPU's temp bytes of the real fp32 train step on mesh (1, 8, 1, 1), ZeRO-3, over 13 model
# shapes per policy (docs/memory.md): XLA reuses some buffers within the layer's backward.
ACTIVATION_COEFFICIENTS: dict[RematPolicy, float] = {
    RematPolicy.NONE: 0.82,
    RematPolicy.FULL: 0.92,
    RematPolicy.DOTS: 0.75,
}
# The loss phase holds the logits in the compute dtype and three fp32 [tokens, vocab] buffers
# (fp32 logits, softmax, their gradient); it is live before the layers' backward, so the peak
# takes the larger of the two phases.
LOGITS_FP32_COPIES = 3


@dataclasses.dataclass(frozen=True)
class Param:
    """One (possibly stacked) parameter: its shape and logical axes."""

    name: str
    shape: tuple[int, ...]
    axes: tuple[str, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class Layout:
    """One candidate: mesh sizes, ZeRO stage, remat policy, pipeline microbatches, offload."""

    data: int
    fsdp: int
    tensor: int
    stage: int
    zero: int
    remat: RematPolicy
    microbatches: int = 1
    offload: bool = False

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
                f"offload.optimizer={str(self.offload).lower()}"]
        if self.stage > 1:
            out.append(f"pipeline.microbatches={self.microbatches}")
        return out

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

    layout: Layout
    params: int = 0
    grads: int = 0
    optimizer: int = 0  # resting on the device (0 when offloaded)
    optimizer_host: int = 0
    offload_transient: int = 0  # offloaded: one stacked leaf's moments on the device during the update
    activations: int = 0  # kept for the backward pass
    temporaries: int = 0  # compute copy, gathered weights, one layer's working set, logits
    batch: int = 0
    compute_s: float = 0.0
    comm_s: dict[str, float] = dataclasses.field(default_factory=dict)
    reasons: list[str] = dataclasses.field(default_factory=list)  # structural: cannot run at all

    @property
    def total(self) -> int:
        """Peak device bytes. The compute copy, activations and temporaries are dead by the time
        the update brings an offloaded leaf's moments in, so the two phases share memory."""
        return (self.params + self.grads + self.optimizer + self.batch
                + max(self.activations + self.temporaries, self.offload_transient))

    @property
    def argument_bytes(self) -> int:
        """XLA's argument bytes: the state and the batch."""
        return self.params + self.optimizer + self.optimizer_host + STATE_SCALAR_BYTES + self.batch

    @property
    def output_bytes(self) -> int:
        """XLA's output bytes: the new state (aliasing the donated one) and the metrics."""
        return self.params + self.optimizer + self.optimizer_host + STATE_SCALAR_BYTES

    @property
    def temp_bytes(self) -> int:
        """XLA's temp bytes: everything the step allocates besides arguments and outputs."""
        return self.grads + max(self.activations + self.temporaries, self.offload_transient)

    @property
    def step_s(self) -> float:
        return self.compute_s + sum(self.comm_s.values())


def _axes_of(entry) -> tuple[str, ...]:
    return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def _splits(param: Param, rules: ShardingRules, mesh: Mapping[str, int]) -> tuple[list[tuple[str, ...]], list[str]]:
    """Mesh axes splitting each dimension, and divisibility problems (messages)."""
    spec = rules.param_spec(param.axes)
    entries = [_axes_of(e) for e in spec] + [()] * (len(param.shape) - len(spec))
    problems = []
    for size, logical, axes in zip(param.shape, param.axes, entries):
        ways = math.prod(mesh[a] for a in axes)
        if ways > 1 and size % ways:
            where = "x".join(f"{a}={mesh[a]}" for a in axes if mesh[a] > 1)
            if ways > size:
                problems.append(f"{where} > {logical}={size}")
            else:
                problems.append(f"{logical} {size} not divisible by {where}")
    return entries, problems


def _local(param: Param, entries: list[tuple[str, ...]], mesh: Mapping[str, int], drop_fsdp: bool) -> float:
    ways = 1
    for axes in entries:
        ways *= math.prod(mesh[a] for a in axes if not (drop_fsdp and a == ZERO_AXIS))
    return param.size / ways


def _axis_bandwidth(axis: str, mesh: Mapping[str, int], hw: Hardware) -> float:
    inner = math.prod(mesh[a] for a in LAYOUT_ORDER[LAYOUT_ORDER.index(axis):])
    return hw.intra_node_bandwidth if inner <= hw.node_size else hw.inter_node_bandwidth


def per_layer_bytes(model: LlamaConfig, tensor: int, remat: RematPolicy, compute_bytes: int) -> tuple[float, float]:
    """(saved, working) activation bytes per token and layer on one device.

    ``saved``: what the backward pass keeps per layer under ``remat``; ``working``: the live set of
    one layer while its backward runs (its recomputed activations and their gradients). Counts in
    vectors per token: d = embed, q = heads*head_dim/tensor, k = kv_heads*head_dim/tensor,
    f = mlp/tensor in the compute dtype, s = heads/tensor * seq_len attention scores in fp32.
    """
    d = model.embed_dim
    q = model.num_heads * model.head_dim / tensor
    k = model.num_kv_heads * model.head_dim / tensor
    f = model.mlp_dim / tensor
    s = model.num_heads / tensor * model.seq_len * FP32
    c = compute_bytes
    everything = (8 * d + 3 * q + 3 * k + 4 * f) * c + 2 * s
    # The backward of the MLP holds the gradients of gate, up, silu and hidden besides them.
    working = (8 * d + 3 * q + 3 * k + 8 * f) * c + 2 * s
    saved = {RematPolicy.NONE: everything,
             RematPolicy.DOTS: (d + (q + 2 * k) + 2 * d + 2 * f) * c,  # input, q/k/v, out/down, gate/up
             RematPolicy.FULL: d * c}[remat]
    return saved, working


def estimate(model: LlamaConfig, params: list[Param], rules: ShardingRules, layout: Layout, *,
             batch_size: int, grad_accum: int, compute_bytes: int, schedule: Schedule,
             virtual_stages: int, hw: Hardware) -> Estimate:
    """The analytic estimate of ``layout`` (see the module docstring and docs/memory.md)."""
    est = Estimate(layout)
    mesh = layout.mesh
    stages = layout.stage
    if stages > 1:
        rules = pipeline_rules(rules)
    # Structural feasibility: the same checks the trainer makes, as short reasons.
    if layout.remat not in ACTIVATION_COEFFICIENTS:
        est.reasons.append(f"remat {layout.remat.value} is not modelled")
    chunks = stages * (virtual_stages if schedule is Schedule.INTERLEAVED else 1)
    if model.num_layers % chunks:
        est.reasons.append(f"layers {model.num_layers} not divisible by stage={stages}"
                           + (f"x{chunks // stages} virtual" if chunks != stages else ""))
    batch_axes = _axes_of(rules.activation_spec(("batch",))[0])
    dp = math.prod(mesh[a] for a in batch_axes)
    if batch_size % (dp * grad_accum):
        est.reasons.append(f"batch {batch_size} not divisible by {'x'.join(batch_axes)}={dp}"
                           + (f" x grad_accum {grad_accum}" if grad_accum > 1 else ""))
    rows = batch_size // (dp * grad_accum) if batch_size % (dp * grad_accum) == 0 else 0
    micro = layout.microbatches if stages > 1 else 1
    if stages > 1 and rows:
        if rows % micro:
            est.reasons.append(f"pipeline microbatches {micro} do not divide {rows} rows")
        if schedule is not Schedule.GPIPE and micro < stages:
            est.reasons.append(f"{schedule.value} needs microbatches >= stage={stages}")

    zero = layout.zero
    p_local = g_local = o_local = 0.0
    layer_full = 0.0  # one layer's weights gathered over fsdp (split by tensor only)
    outside = 0.0  # embedding/head/final norm elements per device (compute copy)
    largest = 0.0
    replicated_total = 0.0  # parameter elements per device without the fsdp split
    for param in params:
        entries, problems = _splits(param, rules, mesh)
        for problem in problems:
            if problem not in est.reasons:
                est.reasons.append(problem)
        sharded = _local(param, entries, mesh, drop_fsdp=False)
        replicated = _local(param, entries, mesh, drop_fsdp=True)
        replicated_total += replicated
        p_local += sharded if zero >= 3 else replicated
        g_local += sharded if zero >= 2 else replicated
        o = sharded if zero >= 1 else replicated
        o_local += o
        largest = max(largest, o)
        if param.axes and param.axes[0] == "layers":
            layer_full += replicated / (param.shape[0] / (stages if stages > 1 else 1))
        else:
            outside += replicated
    est.params = round(FP32 * p_local)
    est.grads = round(FP32 * g_local)
    if layout.offload:
        est.optimizer_host = round(2 * FP32 * o_local)
        est.offload_transient = round(2 * 2 * FP32 * largest)  # one leaf's mu+nu in, and the new ones
    else:
        est.optimizer = round(2 * FP32 * o_local)

    # Activations. Tokens per device per accumulation microbatch.
    tokens = rows * model.seq_len
    layers_here = model.num_layers // stages if model.num_layers % stages == 0 else model.num_layers
    vocab_local = model.vocab_size / mesh["tensor"]
    a_working = ACTIVATION_COEFFICIENTS.get(layout.remat, 1.0)
    saved, working = per_layer_bytes(model, mesh["tensor"], layout.remat, compute_bytes)
    est.activations = round(layers_here * tokens * saved)
    if stages > 1:
        if schedule is Schedule.ONE_F_ONE_B:  # only min(M, 2S-1) stage inputs are stashed
            est.activations = round(est.activations * min(micro, 2 * stages - 1) / micro)
        else:  # autodiff of the tick loop keeps about six fp32 microbatch-sized values per tick
            v = virtual_stages if schedule is Schedule.INTERLEAVED else 1
            ticks = v * micro + stages - 1
            est.activations += round(6 * ticks * tokens / micro * model.embed_dim * FP32)
        # Embedding outputs, stage outputs and the ring buffer / input gradients: fp32, all microbatches.
        est.activations += round(3 * tokens * model.embed_dim * FP32)
    est.batch = BATCH_BYTES_PER_TOKEN * rows * grad_accum * model.seq_len
    working_tokens = tokens / micro
    copy = compute_bytes * p_local if compute_bytes != FP32 else 0.0
    gathered = 2 * layer_full * compute_bytes if (zero >= 3 and mesh["fsdp"] > 1) else 0.0
    layer_phase = a_working * working_tokens * working
    loss_phase = working_tokens * vocab_local * (compute_bytes + LOGITS_FP32_COPIES * FP32)
    est.temporaries = round(copy + gathered + max(layer_phase, loss_phase)
                            + working_tokens * model.embed_dim * FP32)
    if grad_accum > 1:
        # The scan carries the accumulator (in the gradients' layout) besides the one microbatch's
        # gradients, which are materialised before the ZeRO reduce-scatter (not split over fsdp).
        est.temporaries += round(FP32 * replicated_total)

    # Roofline step time.
    global_tokens = batch_size * model.seq_len
    flops = train_flops_per_token(matmul_params=model.matmul_params, num_layers=model.num_layers,
                                  seq_len=model.seq_len, attention_dim=model.attention_dim)
    attention_forward = 4 * model.num_layers * model.seq_len * model.attention_dim
    layer_matmul = model.num_layers * (model.layer_params - 2 * model.embed_dim)
    flops += {RematPolicy.NONE: 0, RematPolicy.DOTS: attention_forward,
              RematPolicy.FULL: 2 * layer_matmul + attention_forward}.get(layout.remat, 0)
    bubble = 0.0
    if stages > 1:
        v = virtual_stages if schedule is Schedule.INTERLEAVED else 1
        bubble = (stages - 1) / (v * micro + stages - 1)
    est.compute_s = global_tokens * flops / (layout.devices * hw.peak_flops) / (1 - bubble)
    ring = lambda n: (n - 1) / n
    comm: dict[str, float] = {}
    local_tokens_step = tokens * grad_accum
    if mesh["tensor"] > 1:
        # Two all-reduces of [tokens, embed] per layer forward, two backward, two more to recompute.
        count = 4 + (2 if layout.remat is RematPolicy.FULL else 0)
        comm["tensor"] = (model.num_layers / stages * count * 2 * ring(mesh["tensor"]) * local_tokens_step
                          * model.embed_dim * compute_bytes)
    if mesh["fsdp"] > 1:
        f = mesh["fsdp"]
        full_params = p_local * (f if zero >= 3 else 1)
        nbytes = 0.0
        if zero >= 3:
            nbytes += 2 * grad_accum * ring(f) * full_params * compute_bytes  # gathers, fwd and bwd
        grads_full = g_local * (f if zero >= 2 else 1)
        nbytes += grad_accum * (1 if zero >= 2 else 2) * ring(f) * grads_full * FP32  # RS or AR
        if 1 <= zero <= 2:
            nbytes += ring(f) * full_params * FP32  # all-gather of the updated parameters
        comm["fsdp"] = nbytes
    if mesh["data"] > 1:
        comm["data"] = grad_accum * 2 * ring(mesh["data"]) * g_local * FP32
    if stages > 1:
        v = virtual_stages if schedule is Schedule.INTERLEAVED else 1
        ticks = v * micro + stages - 1
        comm["stage"] = grad_accum * 2 * ticks * working_tokens * model.embed_dim * FP32
    est.comm_s = {axis: nbytes / _axis_bandwidth(axis, mesh, hw) for axis, nbytes in comm.items()}
    return est


def model_params(model: LlamaConfig) -> list[Param]:
    """The model's parameters (shapes and logical axes) from an abstract init: nothing allocated."""
    from flax import nnx

    from models.common import logical_axes_of
    from models.llama import Llama

    _, state = nnx.split(nnx.eval_shape(lambda: Llama(model, rngs=nnx.Rngs(0))))
    return [Param(".".join(map(str, path)), tuple(variable.shape), logical_axes_of(variable))
            for path, variable in nnx.to_flat_state(state)]

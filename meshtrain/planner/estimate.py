"""The analytic per-device memory and step-time estimate of one meshtrain layout (no compilation).

It reads the layout from the same ``Layout`` that ``meshtrain.trainer.Trainer`` builds from (the
rules, the ZeRO stage, the pipeline, every feasibility check), so the planner and the trainer cannot
disagree on what runs or how it is split; docs/memory.md derives every term. ``estimate`` runs the
phases in order, each in its own module:

1. ``state``: the held state (parameters, gradients, optimizer moments as the ZeRO stage stores
   them, the batch) and the parameters' terms by role;
2. ``layer``: what the backward keeps of each layer under the remat policy and one layer's working set
   (the family's ``FamilyCosts.layer_bytes``);
3. ``head``: the loss phase (the vocabulary weights, one chunk of logits), in the chunk the config
   sets, or where it leaves that to the devices (``train.loss_chunk: null``) the one
   ``choose_loss_chunk`` picks for the devices' memory;
4. ``pipeline``: with a pipeline, the executor's carry and its loops of ticks instead;
5. ``roofline``: communication and the step time.

XLA's temp bytes are the largest of the phases on top of what the step holds from the forward
through the backward; the fitted constants and where they were measured are in ``constants``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np

from meshtrain.mesh import MESH_AXES
from meshtrain.parallel.layout import Layout
from meshtrain.parallel.pipeline import Schedule
from meshtrain.parallel.rules import Preset
from meshtrain.planner.cache import Cache
from meshtrain.planner.constants import MODELLED_REMATS, STATE_SCALAR_BYTES, TABLES, TEMP_MARGIN
from meshtrain.planner.head import head_phase, loss_chunks
from meshtrain.planner.layer import layer_phase, layer_shape
from meshtrain.planner.pipeline import pipeline_stash, pipeline_temporaries, schedule_table
from meshtrain.planner.roofline import Hardware, step_time
from meshtrain.planner.state import (accumulation_bytes, held_state, held_through_backward, lora_terms,
                                     param_terms, spec_tables)
from models.common import RematPolicy

# Why a pipeline layout's verdict is marked (docs/memory.md tables the measured errors).
UNRELIABLE = ("pipeline temp memory is estimated within 10% of XLA:GPU's peak with every schedule (18 layouts of "
              "scripts/plan_accuracy.py's matrix), but not where the stages split the sequence or hold experts, nor "
              "with XLA:CPU's constants: such pipelines rank after the layouts that fit for certain; confirm with "
              "--verify, whose verdict overrules this one")


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
    loss_chunk: int = 0  # the train.loss_chunk the head runs in (0: one pass), the config's or chosen
    reasons: list[str] = dataclasses.field(default_factory=list)  # structural: cannot run at all
    # The compiler's matrix holds pipelines like this one to the bound (``Constants.checked_pipelines``):
    # no sequence or context parallelism and no experts inside the stages, which none of its pipelines has.
    pipelines_checked: bool = False

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
        """False where the model is not checked at scale: a pipeline layout's temp bytes, unless the
        compiler's constants were fitted with its pipelines within the bound (XLA:GPU's)."""
        return self.candidate.stage == 1 or self.pipelines_checked

    @property
    def step_s(self) -> float:
        return self.compute_s + sum(self.comm_s.values())

    @property
    def needed(self) -> float:
        """The device memory the layout fits in for certain: its peak and ``TEMP_MARGIN`` on its temp bytes
        (``meshtrain.planner.search.Plan``'s verdict ``fits``)."""
        return self.total + TEMP_MARGIN * self.temp_bytes


def choose_loss_chunk(needed: Mapping[int, float], device_memory: float | None) -> int:
    """The ``train.loss_chunk`` a config that leaves it to the devices (null) runs with, from the memory
    ``needed`` (``Estimate.needed``) per candidate value, largest chunk first (0: one pass): one pass,
    whose backward recomputes nothing, where it fits ``device_memory`` for certain (the plan's verdict
    ``fits``); else the largest chunk whose step needs no more than the smallest chunk's (its logits
    within the memory the rest of the step's temporaries already take: chunking further would save
    nothing of the peak, and a larger chunk saves no FLOPs). ``device_memory`` None: unknown."""
    one_pass, first = next(iter(needed.items()))
    if device_memory is not None and first <= device_memory:
        return one_pass
    floor = min(needed.values())
    return next(chunk for chunk, need in needed.items() if need <= floor)


def _parameter_reasons(layout: Layout) -> list[str]:
    return [problem.reason for problem in layout.parameter_problems()]


def estimate(layout: Layout, candidate: Candidate, *, compute_bytes: int, hw: Hardware,
             cache: Cache | None = None, device_memory: float | None = None) -> Estimate:
    """The analytic estimate of ``candidate``, laid out by ``layout`` (the module docstring);
    ``cache``: the search's, where what depends on the preset, the mesh and the ZeRO stage alone is
    computed once (the spec tables, the parameters' terms and their divisibility); a fresh one
    without. ``device_memory``: bytes per device that a ``train.loss_chunk`` left to the devices is
    chosen for (``choose_loss_chunk``; None: unknown)."""
    cache = Cache() if cache is None else cache
    constants = TABLES[hw.compiler]
    est = Estimate(candidate)
    mesh, zero = tuple(layout.mesh_shape.values()), candidate.zero
    where = (candidate.preset, mesh, zero)
    # Structural feasibility: the trainer's own checks (``Layout.problems``), as short reasons.
    if candidate.remat not in MODELLED_REMATS:
        est.reasons.append(f"remat {candidate.remat.value} is not modelled")
    est.reasons += [problem.reason for problem in layout.problems(parameters=False)]
    est.reasons += [reason for reason in cache.get(_parameter_reasons, where[:2], layout) if reason not in est.reasons]

    specs = cache.get(spec_tables, (candidate.preset, candidate.stage > 1, zero), layout)
    terms = cache.get(param_terms, where, layout, specs)
    adapters = cache.get(lora_terms, where, layout) if layout.train.lora.enabled else None
    state = held_state(layout, terms, adapters, compute_bytes, candidate.offload, constants)
    est.params, est.grads, est.optimizer = state.params, state.grads, state.optimizer
    est.optimizer_host, est.update, est.batch = state.optimizer_host, state.update, state.batch

    costs = layout.family.costs(layout.model)
    shape = layer_shape(layout)
    est.pipelines_checked = (constants.checked_pipelines and shape.cp == shape.sp == 1
                             and not terms.layer_experts)
    layer = layer_phase(layout, shape, costs, terms, candidate.remat, compute_bytes, constants)
    table = None if est.reasons else schedule_table(layout)  # a layout that cannot be built has none
    if table is None:
        est.activations = round(shape.layers_here * shape.tokens * layer.saved)
        held = (held_through_backward(terms, compute_bytes, constants)
                + accumulation_bytes(layout, state, est.activations, constants))
        temporaries = lambda head: round(held + max(layer.gathered + layer.layer_experts + layer.layer_work,
                                                    head.loss_phase) + layer.residual)
    else:
        stash = pipeline_stash(layout, table, shape, costs, layer, compute_bytes, constants, cache)
        est.activations = stash.activations
        accumulation = accumulation_bytes(layout, state, stash.activations, constants)
        temporaries = lambda head: pipeline_temporaries(table, stash, terms, layer, head, compute_bytes, accumulation,
                                                        constants)
    chunks = loss_chunks(layout) if layout.train.loss_chunk is None else [layout.train.loss_chunk]
    heads = {chunk: head_phase(layout, shape, terms, compute_bytes, constants, chunk) for chunk in chunks}
    needed = {chunk: dataclasses.replace(est, temporaries=temporaries(head)).needed for chunk, head in heads.items()}
    est.loss_chunk = choose_loss_chunk(needed, device_memory)
    head = heads[est.loss_chunk]
    est.temporaries = temporaries(head)

    time = step_time(layout, candidate.remat, zero, candidate.devices, costs, terms, shape, head, table,
                     compute_bytes, hw, cache)
    est.compute_s, est.comm_s, est.bubble, est.in_flight = time.compute_s, time.comm_s, time.bubble, time.in_flight
    return est


def layout_estimate(layout: Layout, compute_bytes: int, hardware: Hardware | None = None,
                    device_memory: float | None = None) -> Estimate:
    """``estimate`` of the layout a run was configured with (its mesh, ZeRO stage, remat, pipeline
    microbatches, offload and accumulation as they are) on ``hardware`` (default: ``Hardware()``, an
    H100's, compiled by XLA:GPU) with ``device_memory`` bytes per device (a chunk left to the devices:
    ``choose_loss_chunk``)."""
    mesh = layout.mesh_shape
    candidate = Candidate(mesh["data"], mesh["fsdp"], mesh["tensor"], mesh["stage"], int(layout.zero.stage),
                          layout.model.remat, layout.pipeline.microbatches, layout.offload.optimizer,
                          layout.train.grad_accum, layout.pipeline.schedule, layout.pipeline.virtual_stages)
    return estimate(layout, candidate, compute_bytes=compute_bytes, hw=Hardware() if hardware is None else hardware,
                    device_memory=device_memory)


def with_chosen_loss_chunk(layout: Layout, hardware: Hardware, device_memory: float | None) -> Layout:
    """``layout`` with the ``train.loss_chunk`` its estimate chooses for ``hardware``'s devices of
    ``device_memory`` bytes each (``choose_loss_chunk``) where its config leaves it to them (null);
    else ``layout``. The trainer builds its step from the result, so the trainer, its evaluation,
    ``meshtrain.compile`` and the planner run the head in the same chunks on the same devices."""
    if layout.train.loss_chunk is not None:
        return layout
    compute_bytes = np.dtype(layout.train.compute_dtype).itemsize
    return layout.with_loss_chunk(layout_estimate(layout, compute_bytes, hardware, device_memory).loss_chunk)

"""The one SPMD executor of a pipeline ``ScheduleTable`` (``meshtrain.parallel.schedules``).

``run_table`` runs any table in one ``jax.shard_map`` manual over ``stage`` only (inside a stage the
``data``/``fsdp``/``tensor`` axes stay automatic, so FSDP and tensor parallelism keep working). In
it a ``TableExecutor`` holds one stage's trace (its cast parameters, microbatches, the chunk's
traced forward and backward) and runs a ``lax.scan`` per run of ticks with the same slot kinds: in
each tick every device reads its own row of the table's typed ``Columns`` and runs its task of each
slot (``forward_slot``, ``head_step``, ``backward_slot``, ``input_grad_slot``, ``weight_slot``, each
under ``lax.cond``: an idle stage computes nothing, unless in lock step, below), then activations
move one stage forward and gradients one stage back (``lax.ppermute``). What the ticks carry is a
``Carry``.

Lock step (``MeshActivationSharding.lockstep_stages``: ring attention inside the stages): XLA:CPU's
collective-permute, which moves the ring's blocks, waits for the devices of every stage, so a
stage that skips its slot deadlocks the others (seen with the slots under ``lax.cond``). There
every stage runs every slot of each tick and an idle stage's result is dropped by a select
(``_if``): nothing it computed reaches a buffer, the loss or a gradient, and it needs the same
memory as a real task. A tick then takes the time of all its slots on every stage, which is what
the table's lock-step time already counts (``ScheduleTable.time``, of which the bubble is the idle
share): the bubble computes discarded results instead of waiting. Under ``lax.cond`` a tick whose
stages run different slots can take less.

Values that cross stages stay fp32 (``CROSSING_DTYPE``) and are cast to the compute dtype inside
the stage (XLA:CPU aborts on a bf16 psum inside a partially manual shard_map).
"""

from __future__ import annotations

import dataclasses
from typing import Any
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.sharding import Mesh, PartitionSpec

from meshtrain.loss import Objective, ahead_loss, head_loss
from meshtrain.loss import Batch, ModelOf, documents_of
from meshtrain.parallel.accumulate import add_gradients, split_microbatches
from meshtrain.parallel.backward_split import split_backward
from meshtrain.parallel.layer_order import with_layers
from meshtrain.parallel.schedules import (BackwardTasks, Buffers, Columns, ForwardTasks, InputGradTasks,
                                          ScheduleTable, WeightGradTasks, Work)
from meshtrain.precision import cast_floating
from models.api import LAYERS_KEY, MTP_LOSS, RESIDUAL_AXES, Documents, LayerAux, PredictsAhead
from models.kernels.attention import varying_axes


STAGE = "stage"

# Values crossing stages are fp32; each stage computes in the compute dtype.
CROSSING_DTYPE = jnp.float32


def _stage_specs(params: nnx.State) -> nnx.State:
    """shard_map specs: the layers' leading axis over ``stage``; everything else replicated."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: PartitionSpec(STAGE) if path[0].key == LAYERS_KEY else PartitionSpec(), params)


def _stage_varying(x: jax.Array) -> jax.Array:
    """``x`` marked as differing per stage (so autodiff inserts no psum over ``stage``)."""
    if STAGE in jax.typeof(x).manual_axis_type.varying:
        return x
    return jax.lax.pcast(x, STAGE, to="varying")


def _shift(x: jax.Array, stages: int, step: int) -> jax.Array:
    """Sends each stage's ``x`` to stage + ``step`` (mod stages)."""
    return jax.lax.ppermute(x, STAGE, [(i, (i + step) % stages) for i in range(stages)])


def _without_layers(params: nnx.State) -> tuple[Any, nnx.State]:
    """(the stacked layers, the rest of ``params`` with ``layers`` None)."""
    return params[LAYERS_KEY], with_layers(params, None)


def _select(which: jax.Array, if_true: Callable[[], Any], if_false: Callable[[], Any], lockstep: bool) -> Any:
    """``if_true()`` where ``which``, else ``if_false()``: a ``lax.cond``, so a stage computes one of
    them; in ``lockstep`` both, then a select (every device enters the collectives of both)."""
    varying = lambda tree: jax.tree.map(_stage_varying, tree)
    if lockstep:
        return jax.tree.map(lambda a, b: jnp.where(which, a, b), varying(if_true()), varying(if_false()))
    return jax.lax.cond(which, lambda: varying(if_true()), lambda: varying(if_false()))


def _if(active: jax.Array, compute: Callable[[], Any], lockstep: bool) -> Any:
    """``compute()`` where ``active`` (this stage has the task), zeros elsewhere: a ``lax.cond``, so
    an idle stage does none of the work; in ``lockstep`` every stage computes and an idle stage's
    result is dropped (a select, so nothing it computed reaches a buffer or a gradient)."""
    shapes = jax.eval_shape(compute)
    return _select(active, compute, lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), lockstep)


def _add_aux(total: LayerAux, aux: LayerAux) -> LayerAux:
    """``total`` with each of ``aux``'s terms added (``total`` may hold more: the head's)."""
    return {name: value + aux[name] if name in aux else value for name, value in total.items()}


# The tick's reads and writes index with lax's dynamic slices, not jnp's indexing: jnp adds a compare,
# an add and a select per index (negative indices count from the end), and inside the stage shard_map
# JAX gives every op a sharding constraint; the tick bodies are most of a pipeline's program (its HLO
# and compile times: docs/pipeline.md).
def _index(values: jax.Array, index: jax.Array | int) -> jax.Array:
    """``values[index]`` for a non-negative ``index``."""
    return jax.lax.dynamic_index_in_dim(values, index, keepdims=False)


def _read(buffer: jax.Array, slot: jax.Array) -> jax.Array:
    return _index(buffer, jnp.maximum(slot, 0))


def _write(buffer: jax.Array, slot: jax.Array, value: jax.Array) -> jax.Array:
    """``buffer`` with ``value`` at ``slot`` (unchanged where ``slot`` < 0)."""
    index = jnp.maximum(slot, 0)
    kept = jnp.where(slot >= 0, value.astype(buffer.dtype), _index(buffer, index))
    return jax.lax.dynamic_update_index_in_dim(buffer, kept, index, 0)


Signature = tuple[tuple[Work, ...], bool]


def tick_runs(table: ScheduleTable) -> list[tuple[int, tuple[tuple[Signature, int], ...]]]:
    """The ticks as loops: runs of consecutive ticks with the same signature, and runs of runs
    that repeat (interleaved 1F1B alternates S ticks with a head and S without), as
    ``(repeats, ((signature, ticks), ...))`` in tick order. Each distinct loop body compiles once."""
    runs: list[list] = []
    for tick in range(len(table.ticks)):
        signature = table.signature(tick)
        if runs and runs[-1][0] == signature:
            runs[-1][1] += 1
        else:
            runs.append([signature, 1])
    runs = [tuple(run) for run in runs]
    groups, i = [], 0
    while i < len(runs):
        best = (1, 1)  # (repeats, period in runs)
        for period in range(1, 5):
            block = runs[i:i + period]
            repeats = 1
            while runs[i + repeats * period:i + (repeats + 1) * period] == block:
                repeats += 1
            if repeats > 1 and repeats * period > best[0] * best[1]:
                best = (repeats, period)
        repeats, period = best
        groups.append((repeats, tuple(runs[i:i + period])))
        i += repeats * period
    return groups


@dataclasses.dataclass(frozen=True)
class _ChunkProgram:
    """One chunk's forward with its ``jax.vjp`` residuals and its backward, each traced once into a
    jaxpr that every task evaluates, so the residuals have one structure. Residuals that are the
    parameters themselves (forwarded inputs of the forward) are taken from the parameters again;
    residuals the same on every stage (computed from constants only, e.g. an unpacked batch's
    rotary table: every input of the trace is stage-varying) are computed once, here, and keep
    that type (a remat'd backward marks them varying again, which jax refuses of a varying value);
    only the others are stashed."""

    forward: Any  # ClosedJaxpr: (layers, rest, x, documents) -> ((y, aux loss), aux, residuals)
    backward: Any  # ClosedJaxpr: (stash, constants, layers, rest, cotangent) -> (d layers, d x)
    out_tree: Any
    stash_positions: tuple[int, ...]  # which residual outputs are stashed
    stash_shapes: tuple[jax.ShapeDtypeStruct, ...]
    constants: tuple[jax.Array, ...]  # the stage-invariant residuals

    @classmethod
    def trace(cls, stage_forward: Callable, layers: Any, rest: nnx.State, x: jax.Array, documents: Any,
              train: bool) -> _ChunkProgram:
        """``stage_forward(layers, rest, x, documents) -> ((y, aux loss), aux)`` traced on example
        values (of this trace: they keep its stage-varying types)."""
        closure_tree = []

        def forward(layers, rest, x, documents):
            if not train:
                outputs, aux = stage_forward(layers, rest, x, documents)
                return outputs, aux, []
            outputs, closure, aux = jax.vjp(lambda p, x: stage_forward(p, rest, x, documents), layers, x,
                                            has_aux=True)
            leaves, treedef = jax.tree.flatten(closure)
            closure_tree.append(treedef)
            return outputs, aux, leaves

        args = (layers, rest, x, documents)
        forward_jaxpr, out_shapes = jax.make_jaxpr(forward, return_shape=True)(*args)
        outputs, aux, residuals = out_shapes
        out_tree = jax.tree.structure((outputs, aux, residuals))
        n_params = len(jax.tree.leaves((layers, rest)))
        param_vars = {var: i for i, var in enumerate(forward_jaxpr.jaxpr.invars[:n_params])}
        residual_vars = forward_jaxpr.jaxpr.outvars[len(jax.tree.leaves((outputs, aux))):]
        sources = [param_vars.get(var) for var in residual_vars]
        residual_avals = forward_jaxpr.out_avals[len(forward_jaxpr.out_avals) - len(residual_vars):]
        constant = [source is None and STAGE not in varying_axes(aval)
                    for source, aval in zip(sources, residual_avals, strict=True)]
        stash_positions = tuple(i for i, source in enumerate(sources) if source is None and not constant[i])
        stash_shapes = tuple(jax.ShapeDtypeStruct(residuals[i].shape, residuals[i].dtype) for i in stash_positions)
        constants = ()
        backward_jaxpr = None
        if train and any(constant):
            flat = jax.core.eval_jaxpr(forward_jaxpr.jaxpr, forward_jaxpr.consts, *jax.tree.leaves(args))
            constants = tuple(r for r, keep in zip(flat[len(flat) - len(residual_vars):], constant) if keep)
        if train:
            def backward(stash, constants, layers, rest, cotangent):
                params, stash, constants = jax.tree.leaves((layers, rest)), list(stash), list(constants)
                leaves = [params[source] if source is not None else (constants if is_constant else stash).pop(0)
                          for source, is_constant in zip(sources, constant)]
                return jax.tree.unflatten(closure_tree[0], leaves)(cotangent)

            backward_jaxpr = jax.make_jaxpr(backward)(
                [_stage_varying(jnp.zeros(s.shape, s.dtype)) for s in stash_shapes], list(constants), layers, rest,
                jax.tree.map(lambda o: _stage_varying(jnp.zeros(o.shape, o.dtype)), outputs))
        return cls(forward_jaxpr, backward_jaxpr, out_tree, stash_positions, stash_shapes, constants)

    def run_forward(self, layers, rest, x, documents):
        """((y, aux loss), aux, the residuals to stash)."""
        flat = jax.core.eval_jaxpr(self.forward.jaxpr, self.forward.consts,
                                   *jax.tree.leaves((layers, rest, x, documents)))
        outputs, aux, residuals = jax.tree.unflatten(self.out_tree, flat)
        return outputs, aux, [residuals[i] for i in self.stash_positions]

    def run_backward(self, stash, layers, rest, cotangent):
        """(d layers, d x) of the stashed forward under ``cotangent`` (d y, d aux loss)."""
        flat = jax.core.eval_jaxpr(self.backward.jaxpr, self.backward.consts,
                                   *jax.tree.leaves((list(stash), list(self.constants), layers, rest, cotangent)))
        return jax.tree.unflatten(jax.tree.structure((layers, cotangent[0])), flat)


@struct.dataclass
class Carry:
    """What the ticks carry, per stage: the buffers (``inputs`` received and awaiting their forward,
    ``gradients`` received or made by the head and awaiting their backward, each forward's ``stash``
    for its backward, each input-gradient half's ``cut`` for its weight-gradient half), the loss and
    the layers' aux terms summed so far and, when training, the fp32 gradients of the stage's
    layers and of the rest of the parameters."""

    inputs: jax.Array
    gradients: jax.Array
    stash: list[jax.Array]
    cut: list[jax.Array]
    loss: jax.Array
    aux: LayerAux
    layer_grads: Any = None
    rest_grads: Any = None


class TableExecutor:
    """One stage's run of ``table``, traced inside the shard_map: the stage's parameters cast to the
    compute dtype, the microbatches, the chunk's forward and backward traced once (and for tables
    with I and W slots, that backward split), and one method per slot kind."""

    def __init__(self, table: ScheduleTable, sizes: Buffers, model_of: ModelOf, objective: Objective, shard,
                 compute_dtype, train: bool, params: nnx.State, microbatches: Batch):
        self.table, self.sizes, self.model_of, self.objective = table, sizes, model_of, objective
        self.shard, self.compute_dtype, self.train, self.microbatches = shard, compute_dtype, train, microbatches
        self.lockstep = shard.lockstep_stages
        self.stage = jax.lax.axis_index(STAGE)
        params = jax.tree.map(_stage_varying, params)
        self.layers, self.rest = _without_layers(cast_floating(params, compute_dtype))
        self.per_chunk = jax.tree.leaves(self.layers)[0].shape[0] // table.chunks
        self.part = microbatches["inputs"].shape[-1] // table.stages
        model = self.model_of(with_layers(self.rest, self.layers))
        # Multi-token prediction runs with the head, on the last stage (``ahead_step``).
        self.predicts_ahead = bool(objective.predicts_ahead and isinstance(model, PredictsAhead) and model.ahead_depths)
        # Example values of the types the tasks pass (a task's microbatch index differs per stage).
        self.x_example = _stage_varying(self.embed(self.rest, 0))
        documents_example = jax.tree.map(_stage_varying, documents_of(self.microbatch(0)))
        self.program = _ChunkProgram.trace(self.stage_forward, self.chunk_layers(0), self.rest, self.x_example,
                                           documents_example, train)
        self.split = None
        if train and table.splits_backward:
            example_stash = [_stage_varying(jnp.zeros(s.shape, s.dtype)) for s in self.program.stash_shapes]
            cotangent = (self.x_example, _stage_varying(jnp.zeros((), jnp.float32)))
            self.split = split_backward(self.backward, (example_stash, self.chunk_layers(0), self.rest), cotangent)

    # ----- the model on this stage -----
    def microbatch(self, m: jax.Array | int) -> Batch:
        return jax.tree.map(lambda a: _index(a, m), self.microbatches)

    def chunk_layers(self, v: jax.Array | int) -> Any:
        """The layers of the stage's local chunk ``v``."""
        return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, v * self.per_chunk, self.per_chunk),
                            self.layers)

    def embed(self, rest: nnx.State, m: jax.Array | int) -> jax.Array:
        mb = self.microbatch(m)
        x = self.model_of(with_layers(rest, self.layers)).embed(mb["inputs"], self.shard, documents_of(mb))
        return x.astype(CROSSING_DTYPE)

    def stage_forward(self, layers: Any, rest: nnx.State, x: jax.Array, documents: Documents | None
                      ) -> tuple[tuple[jax.Array, jax.Array], LayerAux]:
        """One chunk: ((output, its share of the loss from the layers' aux losses), aux terms)."""
        y, aux = self.model_of(with_layers(rest, layers)).run_layers(x.astype(self.compute_dtype), self.shard,
                                                                      documents)
        varying = lambda tree: jax.tree.map(_stage_varying, tree)  # what a cotangent must match
        return varying((y.astype(CROSSING_DTYPE), self.objective.of_layers(aux))), varying(aux)

    def head_loss(self, rest: nnx.State, y: jax.Array, m: jax.Array) -> jax.Array:
        """The token loss of this stage's share (positions [stage * part, +part)) of microbatch m,
        ``y`` [rows, part, embed], in the objective's chunks of the vocabulary (``meshtrain.loss``)."""
        mb = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, self.stage * self.part, self.part, axis=1),
                          self.microbatch(m))
        model = self.model_of(with_layers(rest, self.layers))
        return head_loss(model.head_input(y.astype(self.compute_dtype), self.shard), model.head_weight(), mb,
                         self.shard, self.objective)

    def backward(self, stash_and_params: tuple, cotangent: tuple) -> tuple[Any, jax.Array]:
        return self.program.run_backward(*stash_and_params, cotangent)

    # ----- the carry -----
    def initial_carry(self) -> Carry:
        zeros = lambda shapes, lead=(): jax.tree.map(
            lambda s: _stage_varying(jnp.zeros(lead + s.shape, s.dtype)), shapes)
        aux_shapes = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype),
                                  jax.tree.unflatten(self.program.out_tree, self.program.forward.out_avals)[1])
        if self.predicts_ahead:
            aux_shapes = {**aux_shapes, MTP_LOSS: jax.ShapeDtypeStruct((), jnp.float32)}
        x_shape = jax.ShapeDtypeStruct(self.x_example.shape, self.x_example.dtype)
        sizes, split = self.sizes, self.split
        carry = Carry(inputs=zeros(x_shape, (sizes.inputs,)), gradients=zeros(x_shape, (sizes.gradients,)),
                      stash=zeros(list(self.program.stash_shapes), (sizes.stash,)),
                      cut=zeros(list(split.cut_shapes) if split else [], (sizes.cut,)),
                      loss=_stage_varying(jnp.zeros((), jnp.float32)), aux=zeros(aux_shapes))
        if not self.train:
            return carry
        fp32 = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), tree)
        return carry.replace(layer_grads=zeros(fp32(self.layers)), rest_grads=zeros(fp32(self.rest)))

    def add_layer_grads(self, carry: Carry, v: jax.Array, d_layers: Any) -> Carry:
        start = v * self.per_chunk
        chunk = jax.tree.map(lambda g: jax.lax.dynamic_slice_in_dim(g, start, self.per_chunk), carry.layer_grads)
        grads = jax.tree.map(lambda g, total: jax.lax.dynamic_update_slice_in_dim(g, total, start, 0),
                             carry.layer_grads, add_gradients(chunk, d_layers))
        return carry.replace(layer_grads=grads)

    def add_embed_grads(self, carry: Carry, first: jax.Array, m: jax.Array, dx: jax.Array) -> Carry:
        """Stage 0's gradient of the embedding from d(first chunk's input)."""
        def add(rest_grads):
            _, embed_vjp = jax.vjp(lambda rest: self.embed(rest, m), self.rest)
            return add_gradients(rest_grads, embed_vjp(dx)[0])
        return carry.replace(rest_grads=_select(first, lambda: add(carry.rest_grads), lambda: carry.rest_grads,
                                                self.lockstep))

    # ----- the slots -----
    def forward_slot(self, carry: Carry, task: ForwardTasks) -> tuple[Carry, jax.Array]:
        """The stage's forward of this slot: (the carry with its stash, loss and aux added, its output)."""
        m, v = task.microbatch, task.chunk
        first = (self.stage == 0) & (v == 0)

        def compute():
            # Both branches in the residual stream's sharding (a conditional needs one).
            x = _select(first, lambda: self.shard(self.embed(self.rest, m), RESIDUAL_AXES),
                        lambda: self.shard(_read(carry.inputs, task.input), RESIDUAL_AXES), self.lockstep)
            return self.program.run_forward(self.chunk_layers(v), self.rest, x, documents_of(self.microbatch(m)))

        (y, aux_loss), aux, stash = _if(task.stash >= 0, compute, self.lockstep)
        carry = carry.replace(stash=[_write(b, task.stash, s) for b, s in zip(carry.stash, stash)],
                              loss=carry.loss + aux_loss, aux=_add_aux(carry.aux, aux))
        return carry, y

    def ahead_loss(self, rest: nnx.State, y: jax.Array, m: jax.Array) -> tuple[jax.Array, LayerAux]:
        """Multi-token prediction's share of the loss on microbatch m's whole output ``y``."""
        mb = self.microbatch(m)
        return ahead_loss(self.model_of(with_layers(rest, self.layers)), y.astype(self.compute_dtype), mb,
                          self.shard, self.objective, documents_of(mb))

    def ahead_step(self, carry: Carry, y: jax.Array, m: jax.Array) -> tuple[Carry, jax.Array]:
        """Microbatch m's multi-token prediction on the last stage, which holds its whole output ``y``
        (the depths attend over every position, so they are not split by position as the head is):
        (the carry with its loss, statistic and parameter gradients added, d loss / d y: zero on
        the other stages)."""
        last = self.stage == self.table.stages - 1
        if not self.train:
            loss, aux = _if(last, lambda: self.ahead_loss(self.rest, y, m), self.lockstep)
            return carry.replace(loss=carry.loss + loss, aux=_add_aux(carry.aux, aux)), jnp.zeros_like(y)
        (loss, aux), (d_rest, d_y) = _if(last, lambda: jax.value_and_grad(self.ahead_loss, argnums=(0, 1),
                                                                          has_aux=True)(self.rest, y, m), self.lockstep)
        return carry.replace(loss=carry.loss + loss, aux=_add_aux(carry.aux, aux),
                             rest_grads=add_gradients(carry.rest_grads, d_rest)), d_y

    def head_step(self, carry: Carry, y: jax.Array, m: jax.Array, gradient_slot: jax.Array) -> Carry:
        """Microbatch m's head and loss, split over the stages by position."""
        mine = jax.lax.psum_scatter(jnp.where(self.stage == self.table.stages - 1, y, 0.0), STAGE,
                                    scatter_dimension=1, tiled=True)
        d_ahead = None
        if self.predicts_ahead:
            carry, d_ahead = self.ahead_step(carry, y, m)
        if not self.train:
            return carry.replace(loss=carry.loss + self.head_loss(self.rest, mine, m))
        loss, (d_rest, d_mine) = jax.value_and_grad(self.head_loss, argnums=(0, 1))(self.rest, mine, m)
        d_y = jax.lax.all_gather(d_mine.astype(CROSSING_DTYPE), STAGE, axis=1, tiled=True)
        if d_ahead is not None:
            d_y = d_y + d_ahead.astype(CROSSING_DTYPE)
        return carry.replace(loss=carry.loss + loss, gradients=_write(carry.gradients, gradient_slot, d_y),
                             rest_grads=add_gradients(carry.rest_grads, d_rest))

    def backward_slot(self, carry: Carry, task: BackwardTasks) -> tuple[Carry, jax.Array]:
        """The stage's whole backward of this slot: (the carry with its layers' gradients added, the
        gradient it sends back)."""
        def compute():
            stash, cotangent = self._stashed(carry, task)
            return self.backward((stash, self.chunk_layers(task.chunk), self.rest), cotangent)

        d_layers, dx = _if(task.stash >= 0, compute, self.lockstep)
        return self._send_gradient(self.add_layer_grads(carry, task.chunk, d_layers), task, dx)

    def input_grad_slot(self, carry: Carry, task: InputGradTasks) -> tuple[Carry, jax.Array]:
        """The input-gradient half of the stage's backward of this slot: (the carry with its cut
        kept, the gradient it sends back)."""
        def compute():
            stash, cotangent = self._stashed(carry, task)
            dx, cut = self.split.input_grad((stash, self.chunk_layers(task.chunk), self.rest), cotangent)
            return dx, list(cut)

        dx, cut = _if(task.stash >= 0, compute, self.lockstep)
        carry = carry.replace(cut=[_write(b, task.cut, c) for b, c in zip(carry.cut, cut)])
        return self._send_gradient(carry, task, dx)

    def weight_slot(self, carry: Carry, task: WeightGradTasks) -> Carry:
        """The weight-gradient half of the stage's backward of this slot."""
        def compute():
            stash = [_read(b, task.stash) for b in carry.stash]
            cut = [_read(b, task.cut) for b in carry.cut]
            return self.split.weight_grad((stash, self.chunk_layers(task.chunk), self.rest), cut)

        return self.add_layer_grads(carry, task.chunk, _if(task.stash >= 0, compute, self.lockstep))

    def _stashed(self, carry: Carry, task: BackwardTasks) -> tuple[list[jax.Array], tuple[jax.Array, jax.Array]]:
        """A backward's stash and its cotangent (d output, d aux loss)."""
        stash = [_read(b, task.stash) for b in carry.stash]
        return stash, (_read(carry.gradients, task.gradient), _stage_varying(jnp.ones((), jnp.float32)))

    def _send_gradient(self, carry: Carry, task: BackwardTasks, dx: jax.Array) -> tuple[Carry, jax.Array]:
        """The first chunk's input gradient goes into the embedding's (on stage 0); every other is sent."""
        first = (self.stage == 0) & (task.chunk == 0)
        carry = self.add_embed_grads(carry, first & (task.stash >= 0), task.microbatch, dx)
        return carry, jnp.where(first, 0.0, dx)

    # ----- the ticks -----
    def tick(self, carry: Carry, row: tuple[Columns, jax.Array], signature: Signature) -> Carry:
        """One tick: this stage's task of each slot, then the sends. ``row`` is the tick's columns
        and the microbatch whose head runs in it."""
        works, has_head = signature
        columns, head = row
        task = jax.tree.map(lambda values: _index(values, self.stage), columns)
        sent_forward = sent_backward = None
        for work in works:
            if work is Work.FORWARD:
                carry, sent_forward = self.forward_slot(carry, task.forward)
                if has_head:
                    carry = self.head_step(carry, sent_forward, head, task.head_gradient)
            elif work is Work.BACKWARD:
                carry, sent_backward = self.backward_slot(carry, task.backward)
            elif work is Work.INPUT_GRAD:
                carry, sent_backward = self.input_grad_slot(carry, task.input_grad)
            else:
                carry = self.weight_slot(carry, task.weight_grad)
        stages = self.table.stages
        if sent_forward is not None:
            carry = carry.replace(inputs=_write(carry.inputs, task.receive_input, _shift(sent_forward, stages, 1)))
        if sent_backward is not None:
            carry = carry.replace(gradients=_write(carry.gradients, task.receive_gradient,
                                                   _shift(sent_backward, stages, -1)))
        return carry

    def run_ticks(self, carry: Carry, signature: Signature, rows: tuple[Columns, jax.Array]) -> Carry:
        """A run of ticks with one ``signature``: one ``lax.scan``."""
        return jax.lax.scan(lambda c, row: (self.tick(c, row, signature), None), carry, rows)[0]

    def run_block(self, carry: Carry, block: tuple[tuple[Signature, int], ...], rows: tuple[Columns, jax.Array]
                  ) -> Carry:
        """The runs of ``block`` one after the other; ``rows`` [block ticks, ...]."""
        offset = 0
        for signature, ticks in block:
            carry = self.run_ticks(carry, signature, _ticks(rows, offset, offset + ticks))
            offset += ticks
        return carry

    def run(self, rows: tuple[Columns, np.ndarray], phases: list[tuple[int, tuple[tuple[Signature, int], ...]]]
            ) -> tuple:
        """The table's ticks (``rows``: its columns and head microbatches, grouped by ``tick_runs``):
        ``(loss, aux)``, or ``(loss, aux, grads)`` when training, summed over the stages."""
        carry = self.initial_carry()
        begin = 0
        for repeats, block in phases:
            length = sum(ticks for _, ticks in block)
            block_rows = jax.tree.map(jnp.asarray, _ticks(rows, begin, begin + repeats * length))
            begin += repeats * length
            if repeats == 1:
                carry = self.run_block(carry, block, block_rows)
            else:
                carry = jax.lax.scan(lambda c, r, block=block: (self.run_block(c, block, r), None), carry,
                                     _fold(block_rows, repeats))[0]
        loss, aux = jax.lax.psum(carry.loss, STAGE), jax.lax.psum(carry.aux, STAGE)
        if not self.train:
            return loss, aux
        rest_grads = jax.lax.psum(carry.rest_grads, STAGE)
        return loss, aux, with_layers(rest_grads, carry.layer_grads)


def _ticks(rows: Any, start: int, stop: int) -> Any:
    """Ticks [start, stop) of every column of ``rows``."""
    return jax.tree.map(lambda values: values[start:stop], rows)


def _fold(rows: Any, repeats: int) -> Any:
    """``rows`` [repeats * length, ...] -> [repeats, length, ...]."""
    return jax.tree.map(lambda values: values.reshape(repeats, -1, *values.shape[1:]), rows)


def run_table(table: ScheduleTable, mesh: Mesh, model_of: ModelOf, objective: Objective, shard, compute_dtype,
              train: bool) -> Callable[[nnx.State, Batch], tuple]:
    """The executor: ``(params, batch) -> (loss, aux)`` (forward only) or ``-> (loss, aux, grads)``
    (``train``) of ``batch`` split into ``table.microbatches`` microbatches, run as ``table`` says."""
    columns, sizes = table.buffers()
    phases = tick_runs(table)
    heads = [table.head_microbatch(t) for t in range(len(table.ticks))]
    rows = (columns, np.array([-1 if m is None else m for m in heads], np.int32))

    def on_stage(params: nnx.State, microbatches: Batch) -> tuple:
        executor = TableExecutor(table, sizes, model_of, objective, shard, compute_dtype, train, params, microbatches)
        return executor.run(rows, phases)

    def run(params: nnx.State, batch: Batch):
        specs = _stage_specs(params)
        out_specs = (PartitionSpec(), PartitionSpec()) + ((specs,) if train else ())
        pipelined = jax.shard_map(on_stage, mesh=mesh, in_specs=(specs, PartitionSpec()), out_specs=out_specs,
                                  axis_names={STAGE})
        return pipelined(params, split_microbatches(batch, table.microbatches))

    return run

"""Pipeline parallelism over the ``stage`` mesh axis: schedules as tables, run by one executor.

The stacked ``layers`` axis of every per-layer parameter is split over ``stage`` (rule
``layers -> stage`` at rest), so each stage holds only its own layers. A schedule is a
``ScheduleTable`` (``meshtrain.parallel.schedules``: GPipe, 1F1B, interleaved 1F1B, ZB-H1, or a
user's file): which forward / backward / input-gradient / weight-gradient task each stage runs at
each tick. ``run_table`` executes any table in one ``jax.shard_map`` manual over ``stage`` only
(inside a stage the ``data``/``fsdp``/``tensor`` axes stay automatic, so FSDP and tensor parallelism
keep working): a ``lax.scan`` per run of ticks with the same slot kinds, in which each device runs
only its own task of each slot (``lax.cond``; an idle stage computes nothing), then activations
move one stage forward and gradients one stage back (``lax.ppermute``).

No work is repeated: the embedding runs in the first chunk's forward on stage 0 (its gradient in
that chunk's backward); the head and the loss of a microbatch run once, split over the stages by
sequence position (a reduce-scatter of the last stage's output, an all-gather of its gradient),
right after the forward slot in which the last stage finishes it; a forward keeps the residuals of
``jax.vjp`` (the activations its backward needs, never the weights, which the backward takes from
the parameters again), so the backward recomputes nothing unless ``model.remat`` asks for it. ZB-H1
splits that backward into its input-gradient and weight-gradient parts
(``meshtrain.parallel.backward_split``), each equation running once, in one of them.

Values that cross stages stay fp32 and are cast to the compute dtype inside the stage (XLA:CPU
aborts on a bf16 psum inside a partially manual shard_map). Because interleaved chunks are round
robin, the stacked layers are *stored* in stage order; ``LayerOrder`` converts.
"""

from __future__ import annotations

import dataclasses
import enum
import pathlib
from typing import Any
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from meshtrain.errors import ConfigError, Infeasible
from meshtrain.parallel.accumulate import Batch, split_microbatches
from meshtrain.parallel.backward_split import split_backward
from meshtrain.parallel.rules import AxisRule, ShardingRules
from meshtrain.parallel.schedules import (SENDS_GRADIENT, ScheduleTable, Work, gpipe, interleaved_1f1b, one_f_one_b,
                                          zb_h1)
from meshtrain.precision import cast_floating
from models.api import AUX_LOSS, RESIDUAL_AXES, Documents, LayerAux

STAGE = "stage"

# (params, microbatch) -> ((scaled loss, the layers' aux terms summed over its rows), grads); grads
# have the structure of params.
ValueAndGrad = Callable[[nnx.State, Batch], tuple[tuple[jax.Array, LayerAux], nnx.State]]
# params (in the compute dtype, possibly one stage's slice of the layers) -> the model on them.
ModelOf = Callable[[nnx.State], Any]
# (params, microbatch) -> (its scaled loss, the layers' aux terms), forward only.
Loss = Callable[[nnx.State, Batch], tuple[jax.Array, LayerAux]]
# Values crossing stages are fp32; each stage computes in the compute dtype.
CROSSING_DTYPE = jnp.float32


def documents_of(batch: Batch) -> Documents | None:
    """The batch's document layout (``positions`` and ``segments`` [rows, length]) when its rows are
    packed from several documents, else None."""
    return Documents(batch["positions"], batch["segments"]) if "segments" in batch else None


@dataclasses.dataclass(frozen=True)
class Objective:
    """The two (linear) terms of one microbatch's scaled, normalised loss.

    of_logits: (logits [batch, length, vocab], microbatch) -> the token loss (a sum over tokens, so
    any split of the tokens adds up to it).
    of_aux: the layers' auxiliary-loss sum over the microbatch's rows (``aux[AUX_LOSS]`` of
    ``DecoderModel.run_layers``) -> its share of the loss.
    """

    of_logits: Callable[[jax.Array, Batch], jax.Array]
    of_aux: Callable[[jax.Array], jax.Array]

    def of_layers(self, aux: LayerAux) -> jax.Array:
        """The share of the loss of the layers' aux terms ``aux``."""
        return self.of_aux(aux[AUX_LOSS])


class Schedule(str, enum.Enum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"  # interleaved 1F1B
    ZB_H1 = "zb_h1"
    CUSTOM = "custom"  # a table from pipeline.table


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """``microbatches`` per (accumulation) batch, the ``schedule``, for interleaved (or a custom
    table with several chunks) the number of ``virtual_stages`` (chunks of layers) per stage, and
    for ``custom`` the JSON ``table`` file (``ScheduleTable.to_json``). Used when ``mesh.stage`` > 1."""

    microbatches: int = 1
    schedule: Schedule = Schedule.GPIPE
    virtual_stages: int = 1
    table: str = ""

    def __post_init__(self):
        if self.microbatches < 1:
            raise ConfigError("microbatches", f"must be a positive integer, got {self.microbatches}")
        if self.virtual_stages < 1:
            raise ConfigError("virtual_stages", f"must be a positive integer, got {self.virtual_stages}")
        if self.virtual_stages > 1 and self.schedule not in (Schedule.INTERLEAVED, Schedule.CUSTOM):
            raise ConfigError("virtual_stages", f"{self.virtual_stages} needs schedule 'interleaved' or "
                              f"'custom', got {self.schedule.value!r}")
        if bool(self.table) != (self.schedule is Schedule.CUSTOM):
            raise ConfigError("table", "a table file goes with schedule 'custom' (and only with it), got "
                              f"schedule {self.schedule.value!r} and table {self.table!r}")

    @property
    def chunks_per_stage(self) -> int:
        return self.virtual_stages

    def schedule_table(self, stages: int) -> ScheduleTable:
        """The table this config runs on ``stages`` stages (not checked: see ``problems``)."""
        builders = {Schedule.GPIPE: lambda: gpipe(stages, self.microbatches),
                    Schedule.ONE_F_ONE_B: lambda: one_f_one_b(stages, self.microbatches),
                    Schedule.INTERLEAVED: lambda: interleaved_1f1b(stages, self.microbatches, self.virtual_stages),
                    Schedule.ZB_H1: lambda: zb_h1(stages, self.microbatches),
                    Schedule.CUSTOM: self._read_table}
        return builders[self.schedule]()

    def _read_table(self) -> ScheduleTable:
        try:
            text = pathlib.Path(self.table).read_text()
        except OSError as error:
            raise ConfigError("pipeline.table", f"cannot read {self.table!r}: {error.strerror}") from None
        return ScheduleTable.from_json(text)

    def bubble_fraction(self, stages: int) -> float:
        """The idle share of the lock-step time of this schedule's table (F = 1, B = 2, I = W = 1)."""
        return 0.0 if stages == 1 else self.schedule_table(stages).bubble()

    def problems(self, stages: int, num_layers: int, rows: int, seq_len: int) -> list[Infeasible]:
        """Why this schedule cannot run ``num_layers`` layers of ``seq_len`` tokens on ``stages``
        stages with ``rows`` rows per data-parallel shard and accumulation step (empty when it can)."""
        found = []
        chunks = stages * self.chunks_per_stage
        if num_layers % chunks:
            virtual = f"x{self.chunks_per_stage} virtual" if chunks != stages else ""
            found.append(Infeasible("model.num_layers", f"{num_layers} layers cannot be split into mesh.stage="
                                    f"{stages} x pipeline.virtual_stages={self.chunks_per_stage} = {chunks} "
                                    "equal chunks", f"layers {num_layers} not divisible by stage={stages}{virtual}"))
        if rows and rows % self.microbatches:
            found.append(Infeasible("pipeline.microbatches", f"{self.microbatches} does not divide the {rows} "
                                    "rows each data-parallel shard holds per accumulation step; choose a divisor",
                                    f"pipeline microbatches {self.microbatches} do not divide {rows} rows"))
        if seq_len % stages:
            found.append(Infeasible("model.seq_len", f"{seq_len} is not divisible by mesh.stage={stages} (the "
                                    "head runs split over the stages by sequence position)",
                                    f"seq {seq_len} not divisible by stage={stages}"))
        try:
            table = self.schedule_table(stages)
        except ConfigError as error:
            return found + [Infeasible(error.field, error.message, f"{self.schedule.value}: {error.message}")]
        shape = (table.stages, table.chunks, table.microbatches)
        if shape != (stages, self.chunks_per_stage, self.microbatches):
            found.append(Infeasible("pipeline.table", f"the table is for {shape[0]} stages x {shape[1]} chunks x "
                                    f"{shape[2]} microbatches, the run has mesh.stage={stages} x pipeline."
                                    f"virtual_stages={self.chunks_per_stage} x pipeline.microbatches="
                                    f"{self.microbatches}", "table shape differs from the run"))
        elif (table_problems := table.problems()):
            found.append(Infeasible("pipeline.table", f"{self.schedule.value} table cannot run: "
                                    f"{table_problems[0]}", f"invalid table: {table_problems[0]}"))
        return found


def pipeline_rules(rules: ShardingRules) -> ShardingRules:
    """``rules`` with the stacked ``layers`` axis of parameters split over ``stage``."""
    return rules.overridden({"layers": AxisRule(params=STAGE)})


@dataclasses.dataclass(frozen=True)
class LayerOrder:
    """Where each logical layer is stored in the stacked arrays.

    Interleaving puts logical chunk c on stage c mod S, as stage-local chunk c // S; the arrays are
    split over ``stage`` in contiguous blocks, so storage chunk ``(c mod S) * V + c // S`` holds
    logical chunk c. With one chunk per stage the layers are stored in their logical order.
    """

    stages: int = 1
    virtual_stages: int = 1
    num_layers: int = 1

    @classmethod
    def of_run(cls, stages: int, cfg: PipelineConfig, num_layers: int) -> LayerOrder:
        """The storage order a run with ``stages`` pipeline stages and ``cfg`` uses."""
        return cls(stages, cfg.chunks_per_stage if stages > 1 else 1, num_layers)

    @classmethod
    def of_config(cls, config: dict, stages: int) -> LayerOrder:
        """The storage order of a run on ``stages`` stages from its saved config (a plain
        ``{section: {field: value}}`` mapping, as checkpoints record it)."""
        virtual = int(config.get("pipeline", {}).get("virtual_stages", 1)) if stages > 1 else 1
        return cls(stages, virtual, int(config["model"]["num_layers"]))

    def same_permutation(self, other: LayerOrder) -> bool:
        """Whether both store every layer at the same index (e.g. GPipe and no pipeline)."""
        return np.array_equal(self.storage_of_logical, other.storage_of_logical)

    def convert(self, tree: Any, target: LayerOrder) -> Any:
        """``tree`` (params, or any tree holding parameter-like States such as Adam's moments)
        stored in this order -> stored in ``target``'s order."""
        if self.same_permutation(target):
            return tree
        has_layers = lambda node: isinstance(node, nnx.State) and "layers" in node
        return jax.tree.map(lambda node: target.to_storage(self.to_logical(node)) if has_layers(node) else node,
                            tree, is_leaf=has_layers)

    @property
    def storage_of_logical(self) -> np.ndarray:
        """[num_layers] storage index of each logical layer."""
        per_chunk = self.num_layers // (self.stages * self.virtual_stages)
        chunks = np.arange(self.stages * self.virtual_stages)
        storage_chunk = (chunks % self.stages) * self.virtual_stages + chunks // self.stages
        return (storage_chunk[:, None] * per_chunk + np.arange(per_chunk)[None, :]).reshape(-1)

    def to_storage(self, params: nnx.State) -> nnx.State:
        """Params with layers in logical order -> in storage order."""
        return self._permute(params, np.argsort(self.storage_of_logical))

    def to_logical(self, params: nnx.State) -> nnx.State:
        """Params with layers in storage order -> in logical (model) order."""
        return self._permute(params, self.storage_of_logical)

    def _permute(self, params: nnx.State, take: np.ndarray) -> nnx.State:
        if self.virtual_stages == 1:
            return params
        return _with_layers(params, jax.tree.map(lambda x: x[take], params["layers"]))




def _stage_specs(params: nnx.State) -> nnx.State:
    """shard_map specs: the layers' leading axis over ``stage``; everything else replicated."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: PartitionSpec(STAGE) if path[0].key == "layers" else PartitionSpec(), params)


def _stage_varying(x: jax.Array) -> jax.Array:
    """``x`` marked as differing per stage (so autodiff inserts no psum over ``stage``)."""
    if STAGE in jax.typeof(x).manual_axis_type.varying:
        return x
    return jax.lax.pcast(x, STAGE, to="varying")


def _shift(x: jax.Array, stages: int, step: int) -> jax.Array:
    """Sends each stage's ``x`` to stage + ``step`` (mod stages)."""
    return jax.lax.ppermute(x, STAGE, [(i, (i + step) % stages) for i in range(stages)])


def _with_layers(rest: nnx.State, layers: Any) -> nnx.State:
    """``rest`` (params with ``layers`` None) with ``layers`` put back."""
    params = jax.tree.map(lambda x: x, rest)  # a shallow copy of the tree
    params["layers"] = layers
    return params


def _without_layers(params: nnx.State) -> tuple[Any, nnx.State]:
    """(the stacked layers, the rest of ``params`` with ``layers`` None)."""
    return params["layers"], _with_layers(params, None)


def _if(active: jax.Array, compute: Callable[[], Any]) -> Any:
    """``compute()`` where ``active`` (this stage has the task), zeros elsewhere: a ``lax.cond``, so
    an idle stage does none of the work."""
    shapes = jax.eval_shape(compute)
    varying = lambda tree: jax.tree.map(_stage_varying, tree)
    return jax.lax.cond(active, lambda: varying(compute()),
                        lambda: varying(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)))


def _read(buffer: jax.Array, slot: jax.Array) -> jax.Array:
    return buffer[jnp.maximum(slot, 0)]


def _write(buffer: jax.Array, slot: jax.Array, value: jax.Array) -> jax.Array:
    """``buffer`` with ``value`` at ``slot`` (unchanged where ``slot`` < 0)."""
    index = jnp.maximum(slot, 0)
    return buffer.at[index].set(jnp.where(slot >= 0, value.astype(buffer.dtype), buffer[index]))


Signature = tuple[tuple[Work, ...], bool]


def _phases(table: ScheduleTable) -> list[tuple[int, tuple[tuple[Signature, int], ...]]]:
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
    only the others are stashed."""

    forward: Any  # ClosedJaxpr: (layers, rest, x, documents) -> ((y, aux loss), aux, residuals)
    backward: Any  # ClosedJaxpr: (stash, layers, rest, cotangent) -> (d layers, d x)
    out_tree: Any
    stash_positions: tuple[int, ...]  # which residual outputs are stashed
    stash_shapes: tuple[jax.ShapeDtypeStruct, ...]

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
        stash_positions = tuple(i for i, source in enumerate(sources) if source is None)
        stash_shapes = tuple(jax.ShapeDtypeStruct(residuals[i].shape, residuals[i].dtype) for i in stash_positions)
        backward_jaxpr = None
        if train:
            def backward(stash, layers, rest, cotangent):
                params, stash = jax.tree.leaves((layers, rest)), list(stash)
                leaves = [params[source] if source is not None else stash.pop(0) for source in sources]
                return jax.tree.unflatten(closure_tree[0], leaves)(cotangent)

            backward_jaxpr = jax.make_jaxpr(backward)(
                [_stage_varying(jnp.zeros(s.shape, s.dtype)) for s in stash_shapes], layers, rest,
                jax.tree.map(lambda o: _stage_varying(jnp.zeros(o.shape, o.dtype)), outputs))
        return cls(forward_jaxpr, backward_jaxpr, out_tree, stash_positions, stash_shapes)

    def run_forward(self, layers, rest, x, documents):
        """((y, aux loss), aux, the residuals to stash)."""
        flat = jax.core.eval_jaxpr(self.forward.jaxpr, self.forward.consts,
                                   *jax.tree.leaves((layers, rest, x, documents)))
        outputs, aux, residuals = jax.tree.unflatten(self.out_tree, flat)
        return outputs, aux, [residuals[i] for i in self.stash_positions]

    def run_backward(self, stash, layers, rest, cotangent):
        """(d layers, d x) of the stashed forward under ``cotangent`` (d y, d aux loss)."""
        flat = jax.core.eval_jaxpr(self.backward.jaxpr, self.backward.consts,
                                   *jax.tree.leaves((list(stash), layers, rest, cotangent)))
        return jax.tree.unflatten(jax.tree.structure((layers, cotangent[0])), flat)


def run_table(table: ScheduleTable, mesh: Mesh, model_of: ModelOf, objective: Objective, shard, compute_dtype,
              train: bool) -> Callable[[nnx.State, Batch], tuple]:
    """The executor: ``(params, batch) -> (loss, aux)`` (forward only) or ``-> (loss, aux, grads)``
    (``train``) of ``batch`` split into ``table.microbatches`` microbatches, run as ``table`` says."""
    stages, chunks, micro = table.stages, table.chunks, table.microbatches
    fields, sizes = table.buffers()
    phases = _phases(table)
    heads = [table.head_microbatch(t) for t in range(len(table.ticks))]
    head_microbatch = np.array([-1 if m is None else m for m in heads], np.int32)

    def schedule(params: nnx.State, microbatches: Batch):
        stage = jax.lax.axis_index(STAGE)
        last = stages - 1
        params = jax.tree.map(_stage_varying, params)
        layers_c, rest_c = _without_layers(cast_floating(params, compute_dtype))
        per_chunk = jax.tree.leaves(layers_c)[0].shape[0] // chunks
        chunk_layers = lambda v: jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, v * per_chunk, per_chunk),
                                              layers_c)
        microbatch = lambda m: jax.tree.map(lambda a: a[m], microbatches)
        length = microbatches["inputs"].shape[-1]
        part = length // stages

        def embed(rest: nnx.State, m: jax.Array) -> jax.Array:
            mb = microbatch(m)
            x = model_of(_with_layers(rest, layers_c)).embed(mb["inputs"], shard, documents_of(mb))
            return x.astype(CROSSING_DTYPE)

        def stage_forward(layers: Any, rest: nnx.State, x: jax.Array, documents: Documents | None
                          ) -> tuple[tuple[jax.Array, jax.Array], LayerAux]:
            """One chunk: ((output, its share of the loss from the layers' aux losses), aux terms)."""
            y, aux = model_of(_with_layers(rest, layers)).run_layers(x.astype(compute_dtype), shard, documents)
            varying = lambda tree: jax.tree.map(_stage_varying, tree)  # what a cotangent must match
            return varying((y.astype(CROSSING_DTYPE), objective.of_layers(aux))), varying(aux)

        def head_loss(rest: nnx.State, y: jax.Array, m: jax.Array) -> jax.Array:
            """The token loss of this stage's share (positions [stage * part, +part)) of microbatch m."""
            mb = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, stage * part, part, axis=1), microbatch(m))
            logits = model_of(_with_layers(rest, layers_c)).logits(y.astype(compute_dtype), shard)
            return objective.of_logits(logits, mb)

        x_example = _stage_varying(embed(rest_c, 0))
        # Example values of the types the tasks pass (a task's microbatch index differs per stage).
        documents_example = jax.tree.map(_stage_varying, documents_of(microbatch(0)))
        program = _ChunkProgram.trace(stage_forward, chunk_layers(0), rest_c, x_example, documents_example, train)
        stash_shapes = program.stash_shapes
        aux_shapes = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype),
                                  jax.tree.unflatten(program.out_tree, program.forward.out_avals)[1])
        x_shape = jax.ShapeDtypeStruct(x_example.shape, x_example.dtype)

        def backward(stash_and_params, cotangent):
            return program.run_backward(*stash_and_params, cotangent)

        split = None
        if train and table.splits_backward:
            example_stash = [_stage_varying(jnp.zeros(s.shape, s.dtype)) for s in stash_shapes]
            cotangent = (x_example, _stage_varying(jnp.zeros((), jnp.float32)))
            split = split_backward(backward, (example_stash, chunk_layers(0), rest_c), cotangent)

        zeros = lambda shapes, lead=(): jax.tree.map(
            lambda s: _stage_varying(jnp.zeros(lead + s.shape, s.dtype)), shapes)
        carry = dict(inputs=zeros(x_shape, (sizes.inputs,)), gradients=zeros(x_shape, (sizes.gradients,)),
                     stash=zeros(list(stash_shapes), (sizes.stash,)),
                     cut=zeros(list(split.cut_shapes) if split else [], (sizes.cut,)),
                     loss=_stage_varying(jnp.zeros((), jnp.float32)), aux=zeros(aux_shapes))
        if train:
            fp32 = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), tree)
            carry.update(layer_grads=zeros(fp32(layers_c)), rest_grads=zeros(fp32(rest_c)))

        def add_layer_grads(grads, v, d_layers):
            return jax.tree.map(lambda g, d: jax.lax.dynamic_update_slice_in_dim(
                g, jax.lax.dynamic_slice_in_dim(g, v * per_chunk, per_chunk) + d.astype(jnp.float32),
                v * per_chunk, 0), grads, d_layers)

        def add_embed_grads(carry, first, m, dx):
            """Stage 0's gradient of the embedding from d(first chunk's input)."""
            def add(rest_grads):
                _, embed_vjp = jax.vjp(lambda rest: embed(rest, m), rest_c)
                return jax.tree.map(lambda g, d: g + d.astype(jnp.float32), rest_grads, embed_vjp(dx)[0])
            carry["rest_grads"] = jax.lax.cond(first, add, lambda g: jax.tree.map(_stage_varying, g),
                                               carry["rest_grads"])
            return carry

        def forward_slot(carry, task):
            m, v, stash_slot = task["F_microbatch"], task["F_chunk"], task["F_stash"]
            first = (stage == 0) & (v == 0)

            def compute():
                # Both branches in the residual stream's sharding (a conditional needs one).
                x = jax.lax.cond(first, lambda: _stage_varying(shard(embed(rest_c, m), RESIDUAL_AXES)),
                                 lambda: _stage_varying(shard(_read(carry["inputs"], task["F_input"]), RESIDUAL_AXES)))
                return program.run_forward(chunk_layers(v), rest_c, x, documents_of(microbatch(m)))

            (y, aux_loss), aux, stash = _if(stash_slot >= 0, compute)
            carry["stash"] = [_write(b, stash_slot, s) for b, s in zip(carry["stash"], stash)]
            carry["loss"] += aux_loss
            carry["aux"] = jax.tree.map(jnp.add, carry["aux"], aux)
            return carry, y

        def head_step(carry, y, m, gradient_slot):
            """Microbatch m's head and loss, split over the stages by position."""
            mine = jax.lax.psum_scatter(jnp.where(stage == last, y, 0.0), STAGE, scatter_dimension=1, tiled=True)
            if not train:
                carry["loss"] += head_loss(rest_c, mine, m)
                return carry
            loss, (d_rest, d_mine) = jax.value_and_grad(head_loss, argnums=(0, 1))(rest_c, mine, m)
            carry["loss"] += loss
            carry["rest_grads"] = jax.tree.map(lambda g, d: g + d.astype(jnp.float32), carry["rest_grads"], d_rest)
            d_y = jax.lax.all_gather(d_mine.astype(CROSSING_DTYPE), STAGE, axis=1, tiled=True)
            carry["gradients"] = _write(carry["gradients"], gradient_slot, d_y)
            return carry

        def backward_slot(carry, task, work):
            w = work.value
            m, v, stash_slot = task[f"{w}_microbatch"], task[f"{w}_chunk"], task[f"{w}_stash"]
            first = (stage == 0) & (v == 0)

            def compute():
                stash = [_read(b, stash_slot) for b in carry["stash"]]
                cotangent = (_read(carry["gradients"], task[f"{w}_gradient"]),
                             _stage_varying(jnp.ones((), jnp.float32)))
                if work is Work.BACKWARD:
                    d_layers, dx = backward((stash, chunk_layers(v), rest_c), cotangent)
                    return d_layers, dx, []
                dx, cut = split.input_grad((stash, chunk_layers(v), rest_c), cotangent)
                return None, dx, list(cut)

            d_layers, dx, cut = _if(stash_slot >= 0, compute)
            if work is Work.BACKWARD:
                carry["layer_grads"] = add_layer_grads(carry["layer_grads"], v, d_layers)
            else:
                carry["cut"] = [_write(b, task["I_cut"], c) for b, c in zip(carry["cut"], cut)]
            carry = add_embed_grads(carry, first & (stash_slot >= 0), m, dx)
            return carry, jnp.where(first, 0.0, dx)

        def weight_slot(carry, task):
            v, stash_slot = task["W_chunk"], task["W_stash"]

            def compute():
                stash = [_read(b, stash_slot) for b in carry["stash"]]
                cut = [_read(b, task["W_cut"]) for b in carry["cut"]]
                return split.weight_grad((stash, chunk_layers(v), rest_c), cut)

            carry["layer_grads"] = add_layer_grads(carry["layer_grads"], v, _if(stash_slot >= 0, compute))
            return carry

        def run_ticks(carry, signature, rows):
            works, has_head = signature

            def tick(carry, row):
                task = {name: values[stage] for name, values in row.items() if name != "head"}
                carry = dict(carry)
                sent_forward = sent_backward = None
                for work in works:
                    if work is Work.FORWARD:
                        carry, y = forward_slot(carry, task)
                        if has_head:
                            carry = head_step(carry, y, row["head"], task["head_gradient"])
                        sent_forward = y
                    elif work in SENDS_GRADIENT:
                        carry, sent_backward = backward_slot(carry, task, work)
                    else:
                        carry = weight_slot(carry, task)
                if sent_forward is not None:
                    carry["inputs"] = _write(carry["inputs"], task["receive_input"], _shift(sent_forward, stages, 1))
                if sent_backward is not None:
                    carry["gradients"] = _write(carry["gradients"], task["receive_gradient"],
                                                _shift(sent_backward, stages, -1))
                return carry, None

            return jax.lax.scan(tick, carry, rows)[0]

        def run_block(carry, block, rows):
            """The runs of ``block`` one after the other; ``rows`` [block ticks, ...]."""
            offset = 0
            for signature, ticks in block:
                carry = run_ticks(carry, signature, {k: v[offset:offset + ticks] for k, v in rows.items()})
                offset += ticks
            return carry

        all_rows = dict(fields, head=head_microbatch)
        begin = 0
        for repeats, block in phases:
            length = sum(ticks for _, ticks in block)
            rows = {name: jnp.asarray(values[begin:begin + repeats * length]) for name, values in all_rows.items()}
            begin += repeats * length
            if repeats == 1:
                carry = run_block(carry, block, rows)
            else:
                rows = {name: values.reshape(repeats, length, *values.shape[1:]) for name, values in rows.items()}
                carry = jax.lax.scan(lambda c, r, block=block: (run_block(c, block, r), None), carry, rows)[0]
        loss, aux = jax.lax.psum(carry["loss"], STAGE), jax.lax.psum(carry["aux"], STAGE)
        if not train:
            return loss, aux
        rest_grads = jax.lax.psum(carry["rest_grads"], STAGE)
        return loss, aux, _with_layers(rest_grads, carry["layer_grads"])

    def run(params: nnx.State, batch: Batch):
        specs = _stage_specs(params)
        out_specs = (PartitionSpec(), PartitionSpec()) + ((specs,) if train else ())
        pipelined = jax.shard_map(schedule, mesh=mesh, in_specs=(specs, PartitionSpec()), out_specs=out_specs,
                                  axis_names={STAGE})
        return pipelined(params, split_microbatches(batch, micro))

    return run


def sequential_loss(model_of: ModelOf, objective: Objective, shard, compute_dtype) -> Loss:
    """No pipeline: the whole model's loss."""

    def loss(params: nnx.State, batch: Batch) -> tuple[jax.Array, LayerAux]:
        model, documents = model_of(cast_floating(params, compute_dtype)), documents_of(batch)
        x, aux = model.run_layers(model.embed(batch["inputs"], shard, documents), shard, documents)
        return objective.of_logits(model.logits(x, shard), batch) + objective.of_layers(aux), aux

    return loss


def make_value_and_grad(cfg: PipelineConfig, mesh: Mesh, model_of: ModelOf, objective: Objective,
                        shard, compute_dtype) -> ValueAndGrad:
    """The loss-and-gradient function of one (accumulation) microbatch for ``mesh`` and ``cfg``."""
    if mesh.shape[STAGE] == 1:
        return jax.value_and_grad(sequential_loss(model_of, objective, shard, compute_dtype), has_aux=True)
    run = run_table(cfg.schedule_table(mesh.shape[STAGE]), mesh, model_of, objective, shard, compute_dtype, True)

    def value_and_grad(params: nnx.State, batch: Batch) -> tuple[tuple[jax.Array, LayerAux], nnx.State]:
        loss, aux, grads = run(params, batch)
        return (loss, aux), grads

    return value_and_grad


def make_loss(cfg: PipelineConfig, mesh: Mesh, model_of: ModelOf, objective: Objective,
              shard, compute_dtype) -> Loss:
    """The forward-only loss of a batch for ``mesh`` and ``cfg`` (evaluation): the forwards of the
    schedule's table."""
    if mesh.shape[STAGE] == 1:
        return sequential_loss(model_of, objective, shard, compute_dtype)
    return run_table(cfg.schedule_table(mesh.shape[STAGE]).forward_only(), mesh, model_of, objective, shard,
                     compute_dtype, False)

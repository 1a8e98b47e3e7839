"""Pipeline parallelism over the ``stage`` mesh axis: GPipe, 1F1B and interleaved schedules.

The stacked ``layers`` axis of every per-layer parameter is split over ``stage`` (rule
``layers -> stage`` at rest), so each stage holds only its own layers. The embedding and the head
stay outside the stage loop. Each schedule is one ``jax.shard_map`` that is manual over ``stage``
only: inside a stage the ``data``/``fsdp``/``tensor`` axes stay automatic, so FSDP and tensor
parallelism keep working. Activations (and, for 1F1B, their gradients) move between neighbouring
stages with ``lax.ppermute``. Values that cross stages stay fp32 and are cast to the compute dtype
inside the stage (XLA:CPU aborts on a bf16 psum inside a partially manual shard_map).

Schedules, with S stages, M microbatches and V virtual stages (chunks of layers per stage):

* GPipe: all forwards, then all backwards (autodiff of the scanned tick loop); activations of all M
  microbatches are held; bubble (S-1)/(M+S-1).
* 1F1B: an explicit lock-step schedule. Stage s runs the forward of microbatch m at tick m+s and
  its backward at tick m+2S-2-s (the last stage runs the head, the loss and its own backward in the
  tick it finishes the forward). A stage holds at most 2S-1 stage inputs, bounded by S, not M; the
  backward recomputes the stage's forward from its stashed input. Bubble (S-1)/(M+S-1).
* Interleaved: stage s holds V chunks, logical chunks s, s+S, ..., s+(V-1)S (round robin); a
  microbatch passes the ring of stages V times. Bubble (S-1)/(V*M+S-1). Needs M >= S. Because the
  chunks are round robin, the stacked layers are *stored* in stage order; ``LayerOrder`` converts.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from meshtrain.errors import ConfigError, Infeasible
from meshtrain.parallel.accumulate import Batch, split_microbatches, sum_leading
from meshtrain.parallel.rules import AxisRule, ShardingRules
from models.api import AUX_LOSS, Documents, LayerAux

STAGE = "stage"

# (params, microbatch) -> ((scaled loss, the layers' aux terms summed over its rows), grads); grads
# have the structure of params.
ValueAndGrad = Callable[[nnx.State, Batch], tuple[tuple[jax.Array, LayerAux], nnx.State]]
# params (fp32, possibly one stage's slice of the layers) -> a model in the compute dtype.
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

    of_logits: (logits [batch, length, vocab], microbatch) -> the token loss.
    of_aux: the layers' auxiliary-loss sum over the microbatch's rows (``aux[AUX_LOSS]`` of
    ``DecoderModel.run_layers``) -> its share of the loss.
    """

    of_logits: Callable[[jax.Array, Batch], jax.Array]
    of_aux: Callable[[jax.Array], jax.Array]

    def of_layers(self, aux: LayerAux) -> jax.Array:
        """The share of the loss of the layers' aux terms ``aux``."""
        return self.of_aux(aux[AUX_LOSS])


def _masked(aux: LayerAux, ok: jax.Array) -> LayerAux:
    return jax.tree.map(lambda x: jnp.where(ok, x, jnp.zeros_like(x)), aux)


class Schedule(str, enum.Enum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """``microbatches`` per (accumulation) batch, the ``schedule`` and, for interleaved, the number
    of ``virtual_stages`` (chunks of layers) per stage. Used when ``mesh.stage`` > 1."""

    microbatches: int = 1
    schedule: Schedule = Schedule.GPIPE
    virtual_stages: int = 1

    def __post_init__(self):
        if self.microbatches < 1:
            raise ConfigError("microbatches", f"must be a positive integer, got {self.microbatches}")
        if self.virtual_stages < 1:
            raise ConfigError("virtual_stages", f"must be a positive integer, got {self.virtual_stages}")
        if self.virtual_stages > 1 and self.schedule is not Schedule.INTERLEAVED:
            raise ConfigError("virtual_stages", f"{self.virtual_stages} needs schedule 'interleaved', "
                              f"got {self.schedule.value!r}")

    @property
    def chunks_per_stage(self) -> int:
        return self.virtual_stages if self.schedule is Schedule.INTERLEAVED else 1

    def bubble_fraction(self, stages: int) -> float:
        """Theoretical idle fraction: (S-1)/(V*M+S-1)."""
        if stages == 1:
            return 0.0
        return (stages - 1) / (self.chunks_per_stage * self.microbatches + stages - 1)

    def problems(self, stages: int, num_layers: int, rows: int) -> list[Infeasible]:
        """Why this schedule cannot run ``num_layers`` layers on ``stages`` stages with ``rows`` rows
        per data-parallel shard and accumulation step (empty when it can)."""
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
        if self.schedule is not Schedule.GPIPE and self.microbatches < stages:
            found.append(Infeasible("pipeline.microbatches", f"schedule {self.schedule.value!r} needs at least "
                                    f"as many microbatches as stages ({stages}), got {self.microbatches}",
                                    f"{self.schedule.value} needs microbatches >= stage={stages}"))
        return found


def pipeline_rules(rules: ShardingRules) -> ShardingRules:
    """``rules`` with the stacked ``layers`` axis of parameters split over ``stage``."""
    return rules.overridden({"layers": AxisRule(params=STAGE)})


@dataclasses.dataclass(frozen=True)
class LayerOrder:
    """Where each logical layer is stored in the stacked arrays.

    Interleaving puts logical chunk c on stage c mod S, as stage-local chunk c // S; the arrays are
    split over ``stage`` in contiguous blocks, so storage chunk ``(c mod S) * V + c // S`` holds
    logical chunk c. GPipe and 1F1B store layers in their logical order.
    """

    stages: int = 1
    virtual_stages: int = 1
    num_layers: int = 1

    @classmethod
    def of_run(cls, stages: int, cfg: PipelineConfig, num_layers: int) -> "LayerOrder":
        """The storage order a run with ``stages`` pipeline stages and ``cfg`` uses."""
        return cls(stages, cfg.chunks_per_stage if stages > 1 else 1, num_layers)

    @classmethod
    def of_config(cls, config: dict, stages: int) -> "LayerOrder":
        """The storage order of a run on ``stages`` stages from its saved config (a plain
        ``{section: {field: value}}`` mapping, as checkpoints record it)."""
        pipeline = config.get("pipeline", {})
        interleaved = pipeline.get("schedule") == Schedule.INTERLEAVED.value
        virtual = int(pipeline.get("virtual_stages", 1)) if interleaved and stages > 1 else 1
        return cls(stages, virtual, int(config["model"]["num_layers"]))

    def same_permutation(self, other: "LayerOrder") -> bool:
        """Whether both store every layer at the same index (e.g. GPipe and no pipeline)."""
        return np.array_equal(self.storage_of_logical, other.storage_of_logical)

    def convert(self, tree: Any, target: "LayerOrder") -> Any:
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
        return _map_layers(params, lambda x: x[take])


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


def _merge(x: jax.Array) -> jax.Array:
    """Inverse of the strided split: [M, rows, ...] -> [rows * M, ...]."""
    return x.swapaxes(0, 1).reshape(-1, *x.shape[2:])


def _map_layers(params: nnx.State, fn: Callable[[jax.Array], jax.Array]) -> nnx.State:
    """``params`` with ``fn`` applied to every stacked layer array (the rest untouched)."""
    params = jax.tree.map(lambda x: x, params)  # a shallow copy of the tree
    params["layers"] = jax.tree.map(fn, params["layers"])
    return params


def _slice_layers(params: nnx.State, start: jax.Array, count: int) -> nnx.State:
    """The stage-local chunk of ``count`` layers beginning at ``start``."""
    return _map_layers(params, lambda x: jax.lax.dynamic_slice_in_dim(x, start, count))


def sequential_loss(cfg: PipelineConfig, mesh: Mesh, model_of: ModelOf, objective: Objective,
                    shard, compute_dtype) -> Loss:
    """No pipeline: the whole model's loss."""
    del cfg, mesh, compute_dtype

    def loss(params: nnx.State, batch: Batch) -> tuple[jax.Array, LayerAux]:
        model, documents = model_of(params), documents_of(batch)
        x, aux = model.run_layers(model.embed(batch["inputs"], shard, documents), shard, documents)
        return objective.of_logits(model.logits(x, shard), batch) + objective.of_layers(aux), aux

    return loss


def circular_loss(cfg: PipelineConfig, mesh: Mesh, model_of: ModelOf, objective: Objective,
                  shard, compute_dtype) -> Loss:
    """The loss through the GPipe (V = 1) and interleaved (V > 1) schedules' forward.

    Stage s at tick t works on the item that entered stage 0 at tick t - s: microbatch
    (t - s) mod M on its local chunk (t - s) // M. Stage 0 injects microbatch t while t < M and
    afterwards takes what the last stage sent round the ring (buffered by microbatch).
    """
    stages, chunks, micro = mesh.shape[STAGE], cfg.chunks_per_stage, cfg.microbatches
    ticks = chunks * micro + stages - 1

    def run_stack(params: nnx.State, x: jax.Array, documents: Documents | None) -> tuple[jax.Array, LayerAux]:
        """x: [rows, length, embed] (fp32) through every layer, pipelined; and the aux terms' sums."""
        layers_per_chunk = jax.tree.leaves(params["layers"])[0].shape[0] // (stages * chunks)

        def stage_loop(params: nnx.State, inputs: jax.Array,
                       documents: Documents | None) -> tuple[jax.Array, LayerAux]:
            stage = jax.lax.axis_index(STAGE)
            current = _stage_varying(jnp.zeros_like(inputs[0]))
            ring_buffer = _stage_varying(jnp.zeros_like(inputs))  # stage 0: items coming round again
            outputs = _stage_varying(jnp.zeros_like(inputs))

            def tick(carry, t):
                current, ring_buffer, outputs = carry
                item = t - stage
                microbatch, chunk = jnp.mod(item, micro), jnp.clip(item // micro, 0, chunks - 1)
                fresh = jnp.where(t < micro, inputs[jnp.minimum(t, micro - 1)], ring_buffer[microbatch])
                current = jnp.where(stage == 0, fresh, current)
                model = model_of(_slice_layers(params, chunk * layers_per_chunk, layers_per_chunk))
                own_documents = jax.tree.map(lambda a: a[microbatch], documents)
                current, aux = model.run_layers(current.astype(compute_dtype), shard, own_documents)
                current = current.astype(CROSSING_DTYPE)
                aux = _masked(aux, (item >= 0) & (item < chunks * micro))
                done = (stage == stages - 1) & (item >= 0) & (item // micro == chunks - 1)
                outputs = jnp.where(done, outputs.at[microbatch].set(current), outputs)
                current = _shift(current, stages, 1)
                arrived = t - (stages - 1)  # the item the last stage just sent round the ring
                ring_buffer = jnp.where((stage == 0) & (arrived >= 0),
                                        ring_buffer.at[jnp.mod(arrived, micro)].set(current), ring_buffer)
                return (current, ring_buffer, outputs), aux

            (_, _, outputs), aux = jax.lax.scan(tick, (current, ring_buffer, outputs), jnp.arange(ticks))
            return (jax.lax.psum(jnp.where(stage == stages - 1, outputs, 0.0), STAGE),
                    jax.lax.psum(sum_leading(aux), STAGE))

        pipelined = jax.shard_map(stage_loop, mesh=mesh,
                                  in_specs=(_stage_specs(params), PartitionSpec(), PartitionSpec()),
                                  out_specs=(PartitionSpec(), PartitionSpec()), axis_names={STAGE})
        outputs, aux_sum = pipelined(params, split_microbatches(x, micro),
                                     split_microbatches(documents, micro))
        return _merge(outputs), aux_sum

    def loss(params: nnx.State, batch: Batch) -> tuple[jax.Array, LayerAux]:
        model, documents = model_of(params), documents_of(batch)
        x = model.embed(batch["inputs"], shard, documents).astype(CROSSING_DTYPE)
        x, aux = run_stack(params, x, documents)
        return objective.of_logits(model.logits(x.astype(compute_dtype), shard), batch) + objective.of_layers(aux), aux

    return loss


def one_f_one_b(cfg: PipelineConfig, mesh: Mesh, model_of: ModelOf, objective: Objective,
                shard, compute_dtype) -> ValueAndGrad:
    """The 1F1B schedule (see the module docstring), with an explicit backward per stage."""
    stages, micro = mesh.shape[STAGE], cfg.microbatches
    ticks = micro + 2 * stages - 2
    stash_size = min(micro, 2 * stages - 1)

    def stage_forward(params: nnx.State, x: jax.Array, documents: Documents | None
                      ) -> tuple[tuple[jax.Array, jax.Array], LayerAux]:
        """This stage's layers: ((output, its share of the loss from the layers' aux losses), the
        layers' aux terms)."""
        y, aux = model_of(params).run_layers(x.astype(compute_dtype), shard, documents)
        return (y.astype(CROSSING_DTYPE), objective.of_layers(aux)), aux

    def head_loss(params: nnx.State, y: jax.Array, microbatch: Batch) -> jax.Array:
        return objective.of_logits(model_of(params).logits(y.astype(compute_dtype), shard), microbatch)

    def schedule(params: nnx.State, inputs: jax.Array, microbatches: Batch):
        """inputs: [M, rows, length, embed] embedding outputs. Returns the summed loss, the
        gradients (layers: this stage's; the rest: this stage's contribution) and d(inputs)."""
        stage = jax.lax.axis_index(STAGE)
        last = stages - 1
        # Per-stage copies of the replicated parameters: each stage's gradient stays its own until
        # the explicit psum at the end (only the last stage's head gradient is non-zero).
        params = jax.tree.map(_stage_varying, params)
        zeros_like_varying = lambda tree: jax.tree.map(lambda x: _stage_varying(jnp.zeros_like(x)), tree)
        carry = dict(
            forward_in=zeros_like_varying(inputs[0]), backward_in=zeros_like_varying(inputs[0]),
            stash=_stage_varying(jnp.zeros((stash_size, *inputs.shape[1:]), inputs.dtype)),
            grads=zeros_like_varying(params), d_inputs=zeros_like_varying(inputs),
            loss=_stage_varying(jnp.zeros((), jnp.float32)))

        def tick(carry, t):
            # Forward of microbatch t - stage.
            forward_mb = t - stage
            forward_ok = (forward_mb >= 0) & (forward_mb < micro)
            f_index = jnp.clip(forward_mb, 0, micro - 1)
            x = jnp.where(stage == 0, inputs[f_index], carry["forward_in"])
            stash = jnp.where(forward_ok, carry["stash"].at[f_index % stash_size].set(x), carry["stash"])
            # The last stage turns its output into the loss and the loss's gradient at once.
            microbatch = jax.tree.map(lambda a: a[f_index], microbatches)
            (y, aux_loss), aux = stage_forward(params, x, documents_of(microbatch))
            loss, (head_grads, d_y) = jax.value_and_grad(head_loss, argnums=(0, 1))(params, y, microbatch)
            head_ok = forward_ok & (stage == last)
            # Backward of microbatch t - (2S - 2 - stage): the last stage's is the one just run.
            backward_mb = t - (2 * stages - 2 - stage)
            backward_ok = (backward_mb >= 0) & (backward_mb < micro)
            b_index = jnp.clip(backward_mb, 0, micro - 1)
            cotangent = jnp.where(stage == last, d_y, carry["backward_in"])
            backward_documents = documents_of(jax.tree.map(lambda a: a[b_index], microbatches))
            _, stage_vjp = jax.vjp(lambda p, x: stage_forward(p, x, backward_documents)[0],
                                   params, stash[b_index % stash_size])
            layer_grads, d_x = stage_vjp((cotangent, jnp.ones_like(aux_loss)))
            add = lambda acc, g, ok: jax.tree.map(lambda a, b: a + jnp.where(ok, b, 0.0), acc, g)
            grads = add(add(carry["grads"], layer_grads, backward_ok), head_grads, head_ok)
            d_inputs = jnp.where(backward_ok & (stage == 0),
                                 carry["d_inputs"].at[b_index].set(d_x), carry["d_inputs"])
            return dict(forward_in=_shift(y, stages, 1), backward_in=_shift(d_x, stages, -1),
                        stash=stash, grads=grads, d_inputs=d_inputs,
                        loss=carry["loss"] + jnp.where(head_ok, loss, 0.0)
                        + jnp.where(forward_ok, aux_loss, 0.0)), _masked(aux, forward_ok)

        carry, aux = jax.lax.scan(tick, carry, jnp.arange(ticks))
        grads = jax.tree_util.tree_map_with_path(
            lambda path, g: g if path[0].key == "layers" else jax.lax.psum(g, STAGE), carry["grads"])
        return (jax.lax.psum(carry["loss"], STAGE), grads, jax.lax.psum(carry["d_inputs"], STAGE),
                jax.lax.psum(sum_leading(aux), STAGE))

    def value_and_grad(params: nnx.State, batch: Batch) -> tuple[tuple[jax.Array, LayerAux], nnx.State]:
        embed = lambda p: model_of(p).embed(batch["inputs"], shard, documents_of(batch)).astype(CROSSING_DTYPE)
        x, embed_vjp = jax.vjp(embed, params)
        specs = _stage_specs(params)
        run = jax.shard_map(schedule, mesh=mesh, in_specs=(specs, PartitionSpec(), PartitionSpec()),
                            out_specs=(PartitionSpec(), specs, PartitionSpec(), PartitionSpec()),
                            axis_names={STAGE})
        microbatches = split_microbatches({k: v for k, v in batch.items() if k != "inputs"}, micro)
        loss, grads, d_inputs, aux = run(params, split_microbatches(x, micro), microbatches)
        (embed_grads,) = embed_vjp(_merge(d_inputs))
        return (loss, aux), jax.tree.map(jnp.add, grads, embed_grads)

    return value_and_grad


def _by_autodiff(loss_of: Callable[..., Loss]) -> Callable[..., ValueAndGrad]:
    """A schedule whose backward is autodiff of its forward loss (no pipeline, GPipe, interleaved)."""
    return lambda *args: jax.value_and_grad(loss_of(*args), has_aux=True)


_SCHEDULES: dict[Schedule, Callable[..., ValueAndGrad]] = {
    Schedule.GPIPE: _by_autodiff(circular_loss),
    Schedule.INTERLEAVED: _by_autodiff(circular_loss),
    Schedule.ONE_F_ONE_B: one_f_one_b,
}


def make_value_and_grad(cfg: PipelineConfig, mesh: Mesh, model_of: ModelOf, objective: Objective,
                        shard, compute_dtype) -> ValueAndGrad:
    """The loss-and-gradient function of one (accumulation) microbatch for ``mesh`` and ``cfg``."""
    schedule = _by_autodiff(sequential_loss) if mesh.shape[STAGE] == 1 else _SCHEDULES[cfg.schedule]
    return schedule(cfg, mesh, model_of, objective, shard, compute_dtype)


def make_loss(cfg: PipelineConfig, mesh: Mesh, model_of: ModelOf, objective: Objective,
              shard, compute_dtype) -> Loss:
    """The forward-only loss of a batch for ``mesh`` and ``cfg`` (evaluation): every schedule's
    forward is GPipe's (1F1B differs only in when backwards run; interleaved keeps its chunks)."""
    loss = sequential_loss if mesh.shape[STAGE] == 1 else circular_loss
    return loss(cfg, mesh, model_of, objective, shard, compute_dtype)

"""``Layout``: the one object that decides everything about a layout.

mesh sizes x rules x ZeRO stage x pipeline x offload, for one model and one global batch ->
the final rules table (the family's axes completed, ``layers -> stage`` when pipelining), the at-rest
specs of parameters, gradients and optimizer state, the pipeline's layer order, and every
cross-section check (batch divisibility, layers per stage, microbatches, divisibility of each
parameter dimension). It needs only the mesh's axis sizes, so ``meshtrain.plan`` builds the same
object for a cluster it does not have; the trainer turns its specs into ``NamedSharding``s on the
real mesh. Neither re-derives what the other decides.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import nnx
from jax.sharding import PartitionSpec

from meshtrain.errors import ConfigError, Infeasible
from meshtrain.loss import MAX_LOSS_CHUNKS, chunk_size, smallest_allowed_chunk
from meshtrain.mesh import MESH_AXES
from meshtrain.parallel.offload import OffloadConfig
from meshtrain.parallel.layer_order import LayerOrder
from meshtrain.parallel.pipeline import STAGE, PipelineConfig, pipeline_rules
from meshtrain.parallel.rules import ShardingRules, mesh_axes_of
from meshtrain.parallel.zero import StateShardings, ZeroConfig, ZeroStage, zero_shardings
from meshtrain.train_config import TrainConfig
from models.api import AxisRole, ModelFamily, family_of
from models.common import logical_axes_of


def abstract_model(model_cfg: Any) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, abstract parameters with logical axes) of a model config; allocates nothing."""
    return nnx.split(nnx.eval_shape(lambda: family_of(model_cfg).build(model_cfg)))


@dataclasses.dataclass(frozen=True)
class Layout:
    """One layout of one model (see the module docstring). Build with ``Layout.of`` or directly;
    ``problems()`` says why it cannot run, ``check()`` raises the first as a ``ConfigError``."""

    model: Any  # the family's config
    abstract_params: nnx.State
    mesh_shape: Mapping[str, int]  # {data, fsdp, tensor, stage}
    base_rules: ShardingRules
    train: TrainConfig
    pipeline: PipelineConfig = PipelineConfig()
    zero: ZeroConfig = ZeroConfig()
    offload: OffloadConfig = OffloadConfig()

    @classmethod
    def of(cls, model: Any, mesh_shape: Mapping[str, int], rules: ShardingRules, train: TrainConfig,
           pipeline: PipelineConfig = PipelineConfig(), zero: ZeroConfig = ZeroConfig(),
           offload: OffloadConfig = OffloadConfig(), abstract_params: nnx.State | None = None) -> Layout:
        graphdef = None
        if abstract_params is None:
            graphdef, abstract_params = abstract_model(model)
        layout = cls(model, abstract_params, {axis: int(mesh_shape[axis]) for axis in MESH_AXES}, rules, train,
                     pipeline, zero, offload)
        if graphdef is not None:  # the same trace gave it: fill the cached property (no second eval_shape)
            layout.__dict__["graphdef"] = graphdef
        return layout

    def with_loss_chunk(self, loss_chunk: int) -> Layout:
        """This layout with ``train.loss_chunk`` set to ``loss_chunk`` (the chunk chosen for the devices:
        ``meshtrain.planner.estimate.with_chosen_loss_chunk``), the model's traced structure kept."""
        layout = dataclasses.replace(self, train=dataclasses.replace(self.train, loss_chunk=loss_chunk))
        if "graphdef" in self.__dict__:
            layout.__dict__["graphdef"] = self.graphdef
        return layout

    @property
    def family(self) -> ModelFamily:
        return family_of(self.model)

    @functools.cached_property
    def graphdef(self) -> nnx.GraphDef:
        """The model's structure, to merge with parameters (``nnx.merge``)."""
        return abstract_model(self.model)[0]

    @property
    def stages(self) -> int:
        return self.mesh_shape[STAGE]

    @functools.cached_property
    def rules(self) -> ShardingRules:
        """The rules table of this layout: the family's axes completed, ``layers -> stage`` when pipelining."""
        rules = self.base_rules.completed(self.family.axis_roles)
        return pipeline_rules(rules) if self.stages > 1 else rules

    @property
    def layer_order(self) -> LayerOrder:
        """How the stacked layers are stored (interleaved pipelines: in stage order)."""
        return LayerOrder.of_run(self.stages, self.pipeline.chunks_per_stage, self.model.num_layers)

    def ways(self, spec: PartitionSpec) -> list[int]:
        """How many ways each dimension of ``spec`` is split."""
        return [math.prod(self.mesh_shape[a] for a in mesh_axes_of(entry)) for entry in spec]

    @property
    def vocab_ways(self) -> int:
        """How many ways the rules split ``vocab`` (tensor parallelism): each of the head's chunks keeps it."""
        return self.ways(self.rules.activation_spec(("vocab",)))[0]

    @property
    def batch_axes(self) -> tuple[str, ...]:
        return mesh_axes_of(self.rules.activation_spec(("batch",))[0])

    @property
    def length_ways(self) -> int:
        """Number of ways the rules split ``length`` (context parallelism's positions)."""
        return self.ways(self.rules.activation_spec(("length",)))[0]

    @property
    def data_parallel_size(self) -> int:
        """Number of ways the batch dimension is split."""
        return self.rules.data_parallel_size(self.mesh_shape)

    @property
    def rows_per_shard(self) -> int:
        """Rows of one data-parallel shard per accumulation step (0 when the batch does not divide)."""
        rows = self.data_parallel_size * self.train.grad_accum
        return self.train.batch_size // rows if self.train.batch_size % rows == 0 else 0

    def param_specs(self, params: nnx.State | None = None) -> nnx.State:
        """The at-rest PartitionSpec of every parameter (of ``params``, variables with logical axes;
        default the model's) under the rules (before the ZeRO stage)."""
        params = self.abstract_params if params is None else params
        return _map_variables(params, lambda v: self.rules.param_spec(logical_axes_of(v)))

    @property
    def expert_axes(self) -> tuple[str, ...]:
        """The family's logical axes of role EXPERT: their split over ``fsdp`` is expert
        parallelism's, not ZeRO's, and stays at every ZeRO stage."""
        return tuple(axis for axis, role in self.family.axis_roles.items() if role is AxisRole.EXPERT)

    def state_specs(self, stage: ZeroStage | None = None, params: nnx.State | None = None) -> StateShardings:
        """PartitionSpecs of parameters, gradients and optimizer moments after the ZeRO stage (this
        layout's, or ``stage``: ``ZeroStage.NONE`` gives every part the layout it has in compute), of
        the model's parameters or of ``params`` (variables with logical axes: LoRA's adapters)."""
        stage = self.zero.stage if stage is None else stage
        return zero_shardings(stage, self.param_specs(params), keep=self.expert_axes)

    def problems(self, parameters: bool = True) -> list[Infeasible]:
        """Every reason this layout cannot be built (empty when it can); without ``parameters``, all
        but the parameters' divisibility (``parameter_problems``, which depends on the mesh and the
        rules only: a planner checks it once per mesh)."""
        try:
            rules = self.rules
        except ConfigError as err:
            return [Infeasible(err.field, err.message, err.message)]
        found = []
        dp, accum, batch = self.data_parallel_size, self.train.grad_accum, self.train.batch_size
        if batch % (dp * accum):
            found.append(Infeasible(
                "train.batch_size", f"{batch} must be divisible by the data-parallel size {dp} x "
                f"train.grad_accum {accum} = {dp * accum}",
                f"batch {batch} not divisible by {'x'.join(self.batch_axes)}={dp}"
                + (f" x grad_accum {accum}" if accum > 1 else "")))
        for logical in ("sequence", "length", "kv_length"):
            mesh_axes = mesh_axes_of(rules.activation_spec((logical,))[0])
            ways = math.prod(self.mesh_shape[a] for a in mesh_axes)
            if self.model.seq_len % ways:
                where = "x".join(f"{a}={self.mesh_shape[a]}" for a in mesh_axes)
                found.append(Infeasible(
                    "model.seq_len", f"{self.model.seq_len} positions cannot be split {ways} ways ({logical!r} "
                    f"over {where} in rules {rules.name}); use a multiple of {ways}",
                    f"seq {self.model.seq_len} not divisible by {where}"))
                break
        ring = rules.ring_axis
        ring_size = self.mesh_shape[ring] if ring is not None else 1
        if ring_size > 1 and rules.balance_ring and self.model.seq_len % (2 * ring_size):
            found.append(Infeasible("model.seq_len", f"{self.model.seq_len} is not divisible by 2 x the ring size "
                                    f"{ring_size} (the balanced order cuts it into {2 * ring_size} chunks); use a "
                                    "multiple, or sharding.balance_ring=false",
                                    f"seq {self.model.seq_len} not divisible by 2x{ring}={2 * ring_size}"))
        found += self._expert_problems(rules) + self._loss_chunk_problems()
        if self.stages > 1:
            found += self.pipeline.problems(self.stages, self.model.num_layers, self.rows_per_shard,
                                            self.model.seq_len)
        if parameters:
            found += [problem for problem in self.parameter_problems()
                      if problem.reason not in [p.reason for p in found]]
        return found

    def _loss_chunk_problems(self) -> list[Infeasible]:
        """A ``train.loss_chunk`` that cuts the vocabulary into more than ``MAX_LOSS_CHUNKS`` chunks."""
        request, vocab = self.train.loss_chunk, self.model.vocab_size
        if not request:  # null (chosen by the planner) or 0 (one pass)
            return []
        chunk = chunk_size(vocab, request, self.vocab_ways)
        if vocab // chunk <= MAX_LOSS_CHUNKS:
            return []
        fewest = smallest_allowed_chunk(vocab, self.vocab_ways)
        return [Infeasible(
            "train.loss_chunk", f"{request} runs the vocabulary of {vocab:,} entries in {vocab // chunk:,} chunks of "
            f"{chunk:,} (at most {MAX_LOSS_CHUNKS}; the value counts vocabulary entries per chunk, run as the largest "
            f"divisor of the vocabulary not above it); use null (chosen for the devices), 0 (one pass) or at least "
            f"{fewest}", f"loss_chunk {request}: {vocab // chunk} chunks of {chunk}")]

    def parameter_problems(self) -> list[Infeasible]:
        """The parameters whose dimensions the mesh axes of their rules do not divide (one per
        distinct reason)."""
        found = []
        try:
            rules = self.rules
        except ConfigError:
            return found
        for path, variable in nnx.to_flat_state(self.abstract_params):
            problem = self._divisibility(".".join(map(str, path)), variable, rules)
            if problem is not None and problem.reason not in [p.reason for p in found]:
                found.append(problem)
        return found

    def _expert_problems(self, rules: ShardingRules) -> list[Infeasible]:
        """Expert parallelism (axes of role EXPERT) must split the experts the same way at rest and
        in compute (a device computes only the experts it holds, never gathering another's), and
        only over mesh axes that split the batch: tokens are dispatched between the ranks holding
        different rows, and an axis holding the same rows has no tokens to send."""
        found = []
        for logical in self.expert_axes:
            rule, field = rules.table[logical], f"sharding.rules.{logical}"
            held, computed = mesh_axes_of(rule.params), mesh_axes_of(rule.activations)
            if held != computed:
                found.append(Infeasible(field, f"params {list(held)} and activations {list(computed)} must split "
                                        f"the {logical} over the same mesh axes (each device computes the "
                                        "experts it holds)", f"{logical} held over {held}, computed over {computed}"))
            elsewhere = [axis for axis in computed if axis not in self.batch_axes]
            if elsewhere:
                found.append(Infeasible(field, f"splits the {logical} over {elsewhere}, which do not split the batch "
                                        f"(over {list(self.batch_axes)}), so there are no tokens to dispatch "
                                        f"there; use a subset of {list(self.batch_axes)} or null",
                                        f"{logical} over {elsewhere} outside the batch axes"))
        return found

    def _divisibility(self, name: str, variable: Any, rules: ShardingRules) -> Infeasible | None:
        axes = logical_axes_of(variable)
        spec = rules.param_spec(axes)
        for size, logical, entry, ways in zip(variable.shape, axes, spec, self.ways(spec)):
            if size % ways:
                mesh_axes = mesh_axes_of(entry)
                where = "x".join(f"{a}={self.mesh_shape[a]}" for a in mesh_axes if self.mesh_shape[a] > 1)
                divisors = [d for d in range(1, size + 1) if size % d == 0]
                return Infeasible(
                    f"mesh.{mesh_axes[-1]}", f"{logical!r} (size {size}) of parameter {name} is split "
                    f"{ways} ways over {list(mesh_axes)}, which does not divide it; use a split among "
                    f"{divisors} or change the rules",
                    f"{where} > {logical}={size}" if ways > size else f"{logical} {size} not divisible by {where}")
        return None

    def check(self) -> None:
        """Raises the first problem as a ``ConfigError``."""
        problems = self.problems()
        if problems:
            raise problems[0].error()


def _map_variables(tree: nnx.State, fn: Callable[[nnx.Variable], Any]) -> nnx.State:
    """A State like ``tree`` whose variables hold ``fn(variable)``."""
    return jax.tree.map(lambda v: v.replace(fn(v)), tree, is_leaf=lambda x: isinstance(x, nnx.Variable))

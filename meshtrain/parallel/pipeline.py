"""Pipeline parallelism over the ``stage`` mesh axis: schedules as tables, run by one executor.

The stacked ``layers`` axis of every per-layer parameter is split over ``stage`` (rule
``layers -> stage`` at rest), so each stage holds only its own layers. A schedule is a
``ScheduleTable`` (``meshtrain.parallel.schedules``: GPipe, 1F1B, interleaved 1F1B, ZB-H1, or a
user's file): which forward / backward / input-gradient / weight-gradient task each stage runs at
each tick. ``run_table`` (``meshtrain.parallel.executor``) executes any table in one
``jax.shard_map`` manual over ``stage`` only (inside a stage the ``data``/``fsdp``/``tensor`` axes
stay automatic, so FSDP and tensor parallelism keep working): a ``lax.scan`` per run of ticks with
the same slot kinds, in which each device runs only its own task of each slot (``lax.cond``; an
idle stage computes nothing; one ``TableExecutor`` method per slot kind), then activations move
one stage forward and gradients one stage back (``lax.ppermute``). This module holds the
configuration, the rules and the loss functions that call it.

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
robin, the stacked layers are *stored* in stage order; ``LayerOrder``
(``meshtrain.parallel.layer_order``) converts.
"""

from __future__ import annotations

import dataclasses
import enum
import pathlib
from collections.abc import Callable

import jax
from flax import nnx
from jax.sharding import Mesh

from meshtrain.errors import ConfigError, Infeasible
from meshtrain.loss import Batch, Loss, ModelOf, Objective, sequential_loss
from meshtrain.parallel.executor import STAGE, run_table
from meshtrain.parallel.rules import AxisRule, ShardingRules
from meshtrain.parallel.schedules import ScheduleTable, gpipe, interleaved_1f1b, one_f_one_b, zb_h1
from models.api import LayerAux
from models.common import coerce_enums

# (params, microbatch) -> ((scaled loss, the layers' aux terms summed over its rows), grads); grads
# have the structure of params.
ValueAndGrad = Callable[[nnx.State, Batch], tuple[tuple[jax.Array, LayerAux], nnx.State]]
# (params, microbatch) -> (its scaled loss, the layers' aux terms), forward only.


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
        coerce_enums(self, ConfigError)
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
            text = pathlib.Path(self.table).read_text(encoding="utf-8")
        except OSError as error:
            raise ConfigError("pipeline.table", f"cannot read {self.table!r}: {error.strerror}") from None
        except UnicodeDecodeError as error:
            raise ConfigError("pipeline.table", f"{self.table!r} is not UTF-8 text (byte {error.start}); give the "
                              "JSON a table's to_json writes") from None
        return ScheduleTable.from_json(text)

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
        if found:  # the table's own checks would only repeat these (and cost the planner its time)
            return found
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

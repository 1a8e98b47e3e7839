"""Logical-axis rules: where each logical axis lives on the ``(data, fsdp, tensor, stage)`` mesh.

A rule has two columns, because parameters and activations want different shardings: FSDP keeps a
parameter's ``embed`` dimension split over ``fsdp`` *at rest* and gathers it for compute, while
activations are split over the batch instead. Each parallelism contributes a few rules; a preset
is the composition of contributions, later ones overriding earlier ones::

    name           dp                 fsdp                     tp                  fsdp_tp
    batch          act: data+fsdp     act: data+fsdp           act: data+fsdp      act: data+fsdp
    embed          -                  param: fsdp              -                   param: fsdp
    vocab          -                  -                        param+act: tensor   param+act: tensor
    (role TENSOR)  -                  -                        param+act: tensor   param+act: tensor

Long sequences (``sequence``: the residual stream; ``length``: queries and block-internal
activations; ``kv_length``: keys and values)::

    name           fsdp_tp_sp (Megatron-SP)      fsdp_cp (context parallel)   fsdp_tp_cp   fsdp_cp_ring
    batch          act: data+fsdp                act: data                    act: data    act: data
    sequence       act: tensor                   act: fsdp                    act: fsdp    act: fsdp
    length         -                             act: fsdp                    act: fsdp    act: fsdp
    kv_length      -                             - (keys, values gathered)    -            act: fsdp (ring)
    (the rest as fsdp_tp; fsdp_cp and fsdp_cp_ring have no tensor split)

Sequence parallelism splits the residual stream's positions over ``tensor`` between the
tensor-parallel matmuls, so norms and residual adds hold 1/T of the activations, and XLA gathers the
positions before the column-parallel matmuls and scatters them after the row-parallel ones (in
place of TP's all-reduce). Context parallelism splits every position axis but the keys' over the
``fsdp`` ranks (which also keep FSDP's parameter split): each rank holds its slice of the queries
and activations and all-gathers the keys and values, so attention's per-rank activations fall by
the CP size; the ranks share rows no longer, so the batch splits over ``data`` only. Where the
rules split ``kv_length`` over the same single mesh axis as ``length`` (``fsdp_cp_ring``, or
``sharding.rules.kv_length={activations: fsdp}`` over ``fsdp_tp_cp``), the keys stay split and
attention runs as ring attention (``meshtrain/parallel/ring_attention.py``).

The table names the framework's logical axes (``models.api.FRAMEWORK_AXES``); a model family's own
axes get the row of their ``AxisRole`` (for Llama: ``heads``, ``kv_heads`` and ``mlp`` are TENSOR,
``head_dim`` REPLICATED) unless the table overrides them by name (``ShardingRules.completed``).

Expert parallelism (role EXPERT, the MoE family's ``experts``) is part of every preset: the experts
are split, at rest and in compute, over the mesh axes that split the batch (``data`` and ``fsdp``;
``data`` under the context-parallel presets), so each of those ranks holds ``experts / EP`` experts
and the tokens travel to them and back by all-to-all. ``sharding.rules.experts=null`` replicates
them instead (plain data parallelism of the experts).

Import ``PRESETS`` or ``ShardingRules`` to reuse them with any model that names these axes.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping

from jax.sharding import PartitionSpec

from meshtrain.errors import ConfigError
from meshtrain.mesh import MESH_AXES
from models.api import FRAMEWORK_AXES, AxisRole
from models.common import coerce_enums

# Mesh axes one logical axis maps to: none (replicated), one, or several (split over their product).
MeshAxes = str | tuple[str, ...] | None


@dataclasses.dataclass(frozen=True)
class AxisRule:
    """Where one logical axis lives: ``params`` at rest, ``activations`` during compute."""

    params: MeshAxes = None
    activations: MeshAxes = None


def mesh_axes_of(axes: MeshAxes) -> tuple[str, ...]:
    """The mesh axes of a rule column or of one PartitionSpec entry (None, one axis or several)."""
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def drop_axes(spec: PartitionSpec, axes: set[str] | frozenset[str]) -> PartitionSpec:
    """``spec`` with the mesh axes ``axes`` removed from every dimension."""
    def entry_without(entry):
        kept = tuple(a for a in mesh_axes_of(entry) if a not in axes)
        return kept[0] if len(kept) == 1 else (kept or None)

    return PartitionSpec(*(entry_without(e) for e in spec))


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """A named, validated table ``logical axis -> AxisRule`` covering every framework axis, and the
    rule of each ``AxisRole`` for a family's own axes (see ``completed``)."""

    name: str
    table: Mapping[str, AxisRule]
    roles: Mapping[AxisRole, AxisRule] = dataclasses.field(default_factory=dict)
    balance_ring: bool = True  # under ring attention, permute the sequence so ranks share the work
    ring_block: int = 512  # under ring attention, queries and keys per score block within a ring step

    def __post_init__(self):
        missing = [axis for axis in FRAMEWORK_AXES if axis not in self.table]
        if missing:
            raise ConfigError("sharding.rules", f"rules {self.name!r} give no rule for {missing}; "
                              "every logical axis needs one (null = replicated)")
        for logical, rule in self.table.items():
            for column in ("params", "activations"):
                axes = mesh_axes_of(getattr(rule, column))
                unknown = [axis for axis in axes if axis not in MESH_AXES]
                if unknown:
                    raise ConfigError(f"sharding.rules.{logical}.{column}",
                                      f"unknown mesh axes {unknown}; valid: {list(MESH_AXES)}")
                repeated = sorted({axis for axis in axes if axes.count(axis) > 1})
                if repeated:
                    raise ConfigError(f"sharding.rules.{logical}.{column}",
                                      f"mesh axes {repeated} appear more than once; a mesh axis "
                                      "may split a dimension only once")

    def completed(self, axis_roles: Mapping[str, AxisRole]) -> ShardingRules:
        """These rules for a family with ``axis_roles``: each family axis the table does not name
        gets the rule of its role (EXPERT_ROWS: the batch's activation axes that the EXPERT axes do
        not use). A table row for an axis the family does not have is an error."""
        known = FRAMEWORK_AXES + tuple(axis_roles)
        unknown = [axis for axis in self.table if axis not in known]
        if unknown:
            raise ConfigError("sharding.rules", f"unknown logical axes {unknown}; valid: {list(known)}")
        rows = {axis: self.roles.get(role, AxisRule()) for axis, role in axis_roles.items()
                if axis not in self.table}
        table = {**self.table, **rows}
        taken = {mesh_axis for axis, role in axis_roles.items() if role is AxisRole.EXPERT
                 for mesh_axis in mesh_axes_of(table[axis].activations)}
        free = tuple(axis for axis in mesh_axes_of(table["batch"].activations) if axis not in taken)
        for axis, role in axis_roles.items():
            if role is AxisRole.EXPERT_ROWS and axis not in self.table:
                table[axis] = AxisRule(activations=free or None)
        return dataclasses.replace(self, table=table)

    def uses(self, mesh_axis: str) -> bool:
        """Whether any rule splits something over ``mesh_axis``."""
        return any(mesh_axis in mesh_axes_of(rule.params) + mesh_axes_of(rule.activations)
                   for rule in self.table.values())

    @property
    def ring_axis(self) -> str | None:
        """The mesh axis of ring attention: where these rules split queries (``length``) and keys
        (``kv_length``) over the same single mesh axis, keys stay split and travel round the ring;
        None when they are not (keys gathered, or nothing split)."""
        queries = mesh_axes_of(self.activation_spec(("length",))[0])
        keys = mesh_axes_of(self.activation_spec(("kv_length",))[0])
        return queries[0] if len(queries) == 1 and keys == queries else None

    def data_parallel_size(self, mesh_shape: Mapping[str, int]) -> int:
        """Number of ways these rules split the batch dimension on a mesh of ``mesh_shape`` (the one
        definition: the trainer's layout, the planner and the tools all ask it)."""
        return math.prod(mesh_shape[axis] for axis in mesh_axes_of(self.activation_spec(("batch",))[0]))

    def param_spec(self, axes: tuple[str | None, ...]) -> PartitionSpec:
        """The at-rest PartitionSpec of a parameter with logical ``axes``."""
        return self._spec(axes, "params")

    def activation_spec(self, axes: tuple[str | None, ...]) -> PartitionSpec:
        """The compute-time PartitionSpec of an activation with logical ``axes``."""
        return self._spec(axes, "activations")

    def _spec(self, axes: tuple[str | None, ...], column: str) -> PartitionSpec:
        entries, used = [], []
        for logical in axes:
            if logical is not None and logical not in self.table:
                raise ConfigError("sharding.rules", f"no rule for logical axis {logical!r} (in {axes}); "
                                  f"known: {sorted(self.table)}")
            mesh_axes = () if logical is None else mesh_axes_of(getattr(self.table[logical], column))
            reused = [axis for axis in mesh_axes if axis in used]
            if reused:
                raise ConfigError(f"sharding.rules.{logical}.{column}",
                                  f"mesh axes {reused} already split another dimension of {axes}; "
                                  "a mesh axis may appear once per spec")
            used.extend(mesh_axes)
            entries.append(mesh_axes[0] if len(mesh_axes) == 1 else (mesh_axes or None))
        return PartitionSpec(*entries)

    def overridden(self, overrides: Mapping[str, AxisRule]) -> ShardingRules:
        """These rules with some logical axes' rules replaced (``name`` gains a ``+``)."""
        if not overrides:
            return self
        return dataclasses.replace(self, name=f"{self.name}+overrides", table={**self.table, **overrides})


# The contributions of each parallelism, in the order they compose.
REPLICATED = {axis: AxisRule() for axis in FRAMEWORK_AXES}
DATA_PARALLEL = {"batch": AxisRule(activations=("data", "fsdp"))}
FULLY_SHARDED = {"embed": AxisRule(params="fsdp")}
FULLY_SHARDED_ROLES = {AxisRole.PARAM_SHARDED: AxisRule(params="fsdp")}
TENSOR_SPLIT = AxisRule(params="tensor", activations="tensor")
TENSOR_PARALLEL = {"vocab": TENSOR_SPLIT}
TENSOR_PARALLEL_ROLES = {AxisRole.TENSOR: TENSOR_SPLIT}
# Expert parallelism: experts live on (and compute on) the ranks that split the batch.
EXPERT_PARALLEL_ROLES = {AxisRole.EXPERT: AxisRule(params=("data", "fsdp"), activations=("data", "fsdp"))}
CONTEXT_EXPERT_ROLES = {AxisRole.EXPERT: AxisRule(params="data", activations="data")}
SEQUENCE_PARALLEL = {"sequence": AxisRule(activations="tensor")}
CONTEXT_PARALLEL = {"batch": AxisRule(activations="data"), "sequence": AxisRule(activations="fsdp"),
                    "length": AxisRule(activations="fsdp")}
RING = {"kv_length": AxisRule(activations="fsdp")}


class Preset(str, enum.Enum):
    """Named rule tables; the mesh sizes decide how much each one actually splits."""

    DP = "dp"
    FSDP = "fsdp"
    TP = "tp"
    FSDP_TP = "fsdp_tp"
    FSDP_TP_SP = "fsdp_tp_sp"
    FSDP_CP = "fsdp_cp"
    FSDP_TP_CP = "fsdp_tp_cp"
    FSDP_CP_RING = "fsdp_cp_ring"

    @property
    def rules(self) -> ShardingRules:
        return PRESETS[self]


PRESETS: dict[Preset, ShardingRules] = {
    Preset.DP: ShardingRules("dp", {**REPLICATED, **DATA_PARALLEL}, EXPERT_PARALLEL_ROLES),
    Preset.FSDP: ShardingRules("fsdp", {**REPLICATED, **DATA_PARALLEL, **FULLY_SHARDED},
                               {**FULLY_SHARDED_ROLES, **EXPERT_PARALLEL_ROLES}),
    Preset.TP: ShardingRules("tp", {**REPLICATED, **DATA_PARALLEL, **TENSOR_PARALLEL},
                             {**TENSOR_PARALLEL_ROLES, **EXPERT_PARALLEL_ROLES}),
    Preset.FSDP_TP: ShardingRules("fsdp_tp", {**REPLICATED, **DATA_PARALLEL, **FULLY_SHARDED, **TENSOR_PARALLEL},
                                  {**FULLY_SHARDED_ROLES, **TENSOR_PARALLEL_ROLES, **EXPERT_PARALLEL_ROLES}),
    Preset.FSDP_TP_SP: ShardingRules("fsdp_tp_sp", {**REPLICATED, **DATA_PARALLEL, **FULLY_SHARDED,
                                                    **TENSOR_PARALLEL, **SEQUENCE_PARALLEL},
                                     {**FULLY_SHARDED_ROLES, **TENSOR_PARALLEL_ROLES, **EXPERT_PARALLEL_ROLES}),
    Preset.FSDP_CP: ShardingRules("fsdp_cp", {**REPLICATED, **FULLY_SHARDED, **CONTEXT_PARALLEL},
                                  {**FULLY_SHARDED_ROLES, **CONTEXT_EXPERT_ROLES}),
    Preset.FSDP_TP_CP: ShardingRules("fsdp_tp_cp",
                                     {**REPLICATED, **FULLY_SHARDED, **TENSOR_PARALLEL, **CONTEXT_PARALLEL},
                                     {**FULLY_SHARDED_ROLES, **TENSOR_PARALLEL_ROLES, **CONTEXT_EXPERT_ROLES}),
    Preset.FSDP_CP_RING: ShardingRules("fsdp_cp_ring", {**REPLICATED, **FULLY_SHARDED, **CONTEXT_PARALLEL, **RING},
                                       {**FULLY_SHARDED_ROLES, **CONTEXT_EXPERT_ROLES}),
}


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    """``preset`` picks a rules table; ``rules`` replaces the rule of individual logical axes (the
    framework's or the model family's; which names exist is checked against the family).

    ``replicated_warning_bytes``: a parameter at least this large that stays fully replicated on a
    mesh with fsdp or tensor > 1 is reported at start-up.

    ``balance_ring``: under ring attention (keys split like queries), the trainer permutes each
    batch's positions once so that rank i holds sequence chunks i and 2N-1-i of 2N (causal load
    balancing; ``meshtrain.parallel.ring_attention.balanced_order``). No effect elsewhere.

    ``ring_block``: under ring attention, the queries and keys of one score block within a ring step
    (the largest divisor of ``seq_len / ring`` not above it; 0: a rank's whole block at once), so a
    step holds ``[ring_block, ring_block]`` scores instead of ``[seq_len / ring, seq_len / ring]``.
    """

    preset: Preset = Preset.FSDP_TP
    rules: dict[str, AxisRule] = dataclasses.field(default_factory=dict)
    replicated_warning_bytes: int = 1 << 20
    balance_ring: bool = True
    ring_block: int = 512

    def __post_init__(self):
        coerce_enums(self, ConfigError)
        if self.replicated_warning_bytes < 0:
            raise ConfigError("replicated_warning_bytes", f"must be >= 0, got {self.replicated_warning_bytes}")
        if self.ring_block < 0:
            raise ConfigError("ring_block", f"must be >= 0 (0: a rank's whole block), got {self.ring_block}")
        try:
            self.resolve()
        except ConfigError as err:
            raise ConfigError(err.field.removeprefix("sharding."), err.message) from None

    def resolve(self) -> ShardingRules:
        return dataclasses.replace(self.preset.rules.overridden(self.rules), balance_ring=self.balance_ring,
                                   ring_block=self.ring_block)

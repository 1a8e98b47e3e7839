"""ZeRO stages: how far the ``fsdp`` split of the rules reaches into the train state.

The rules say where a parameter lives when it is sharded (e.g. ``embed -> fsdp``). The ZeRO stage
decides which parts of the state use that sharded placement; the rest keeps the same placement with
``fsdp`` removed (replicated over ``fsdp``, still split over ``tensor`` and ``stage``)::

    stage   optimizer state   gradients   parameters      (Megatron / DeepSpeed name)
    0       replicated        replicated  replicated      no_shard / DDP
    1       sharded           replicated  replicated      optim / ZeRO-1
    2       sharded           sharded     replicated      optim_grads / ZeRO-2
    3       sharded           sharded     sharded         optim_grads_params / ZeRO-3 = FSDP

``fsdp`` is the ZeRO axis; ``data`` replicates on top of it (hybrid sharding). For DeepSpeed's
ZeRO over all data-parallel devices, put them on ``fsdp`` (``mesh.fsdp=-1``). On GPU, stage >= 2
turns the gradient all-reduce into a reduce-scatter; stages < 3 all-gather the updated parameters.
A dimension whose ``fsdp`` split belongs to another parallelism (expert parallelism's ``experts``:
the ``keep`` axes of ``zero_shardings``) keeps it at every stage, so that each rank holds, updates and
computes only its own experts.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Collection

import jax
from flax import nnx
from jax.sharding import PartitionSpec

from meshtrain.parallel.rules import drop_axes
from meshtrain.errors import ConfigError
from models.common import coerce_enums, logical_axes_of

ZERO_AXIS = "fsdp"


class ZeroStage(enum.IntEnum):
    NONE = 0
    OPTIMIZER = 1
    GRADIENTS = 2
    PARAMETERS = 3


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
    """``stage`` 0-3: which of optimizer state, gradients and parameters are sharded over fsdp."""

    stage: ZeroStage = ZeroStage.PARAMETERS

    def __post_init__(self):
        coerce_enums(self, ConfigError)  # InvalidField unless 0, 1, 2 or 3


@dataclasses.dataclass(frozen=True)
class StateShardings:
    """Trees like the parameters, of PartitionSpecs (or NamedShardings) of parameters, gradients and
    optimizer moments."""

    params: nnx.State
    grads: nnx.State
    optimizer: nnx.State


def zero_shardings(stage: ZeroStage, sharded: nnx.State, keep: Collection[str] = ()) -> StateShardings:
    """The specs of each part of the state under ``stage``, from the rules' sharded specs (a State
    of PartitionSpecs whose variables carry their logical axes). Dimensions of the logical axes in
    ``keep`` keep their ``fsdp`` split in every part."""
    def unsharded(variable: nnx.Variable) -> nnx.Variable:
        spec, axes = variable.get_value(), logical_axes_of(variable)
        entries = [entry if logical in keep else drop_axes(PartitionSpec(entry), {ZERO_AXIS})[0]
                   for entry, logical in zip(spec, axes)]
        return variable.replace(PartitionSpec(*entries))

    replicated = jax.tree.map(unsharded, sharded, is_leaf=lambda x: isinstance(x, nnx.Variable))
    pick = lambda threshold: sharded if stage >= threshold else replicated
    return StateShardings(params=pick(ZeroStage.PARAMETERS), grads=pick(ZeroStage.GRADIENTS),
                          optimizer=pick(ZeroStage.OPTIMIZER))

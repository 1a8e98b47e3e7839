"""Optimizer-state offload: Adam's moments live in host memory between steps.

With ``offload.optimizer=true`` the optimizer state's shardings carry ``memory_kind="pinned_host"``;
the step moves the state to device memory for the update and writes the new state back to the host
(its out_shardings). Activations can be offloaded too, by the model's remat policy
(``model.remat=offload`` with ``model.remat_names``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from meshtrain.errors import ConfigError

HOST = "pinned_host"
DEVICE = "device"


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    """``optimizer``: keep the optimizer state in pinned host memory between steps."""

    optimizer: bool = False


def check_host_memory(mesh: Mesh, field: str) -> None:
    """A ConfigError naming ``field`` when the devices have no pinned host memory."""
    device = mesh.devices.flat[0]
    kinds = [memory.kind for memory in device.addressable_memories()]
    if HOST not in kinds:
        raise ConfigError(field, f"{device.platform} devices have no {HOST!r} memory (they have "
                          f"{kinds}); offloading needs a platform with host memory kinds")


def with_memory_kind(shardings: Any, kind: str) -> Any:
    """``shardings`` (a tree of NamedSharding) placed in memory ``kind``."""
    return jax.tree.map(lambda s: s.with_memory_kind(kind), shardings,
                        is_leaf=lambda x: isinstance(x, NamedSharding))

"""The device mesh: four named axes ``(data, fsdp, tensor, stage)``.

Devices are laid out so that ``tensor`` varies fastest (neighbouring devices, the fastest links),
then ``fsdp``, then ``stage``, then ``data`` (the slowest links): the order in which their
collectives are most to least frequent.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from meshtrain.errors import ConfigError

MESH_AXES = ("data", "fsdp", "tensor", "stage")
# Device-array order (slowest to fastest varying), and its permutation back to MESH_AXES.
_LAYOUT_ORDER = ("data", "stage", "fsdp", "tensor")
_TO_MESH_AXES = tuple(_LAYOUT_ORDER.index(axis) for axis in MESH_AXES)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the mesh axes; at most one may be -1 (= fill with the remaining devices)."""

    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    stage: int = 1

    def __post_init__(self):
        for axis in MESH_AXES:
            size = getattr(self, axis)
            if size == 0 or size < -1:
                raise ConfigError(axis, f"must be a positive integer or -1 (fill), got {size}")
        fills = [axis for axis in MESH_AXES if getattr(self, axis) == -1]
        if len(fills) > 1:
            raise ConfigError(fills[1], f"only one mesh axis may be -1 (fill); got -1 for {fills}")

    def resolve(self, num_devices: int) -> dict[str, int]:
        """Axis sizes with -1 filled in; their product must equal ``num_devices``."""
        sizes = {axis: getattr(self, axis) for axis in MESH_AXES}
        known = math.prod(size for size in sizes.values() if size != -1)
        fills = [axis for axis, size in sizes.items() if size == -1]
        if fills:
            if num_devices % known:
                raise ConfigError(f"mesh.{fills[0]}", f"cannot fill: the other axes multiply to {known}, "
                                  f"which does not divide the {num_devices} devices")
            sizes[fills[0]] = num_devices // known
        if math.prod(sizes.values()) != num_devices:
            shape = "*".join(f"{axis}={size}" for axis, size in sizes.items())
            raise ConfigError("mesh", f"{shape} = {math.prod(sizes.values())} devices, but "
                              f"{num_devices} are available; make the product {num_devices} "
                              "or set one axis to -1")
        return sizes


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh over ``devices`` (default: all) with axes ``MESH_AXES``, tensor varying fastest."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = cfg.resolve(len(devices))
    layout_shape = tuple(sizes[axis] for axis in _LAYOUT_ORDER)
    device_array = mesh_utils.create_device_mesh(layout_shape, devices, allow_split_physical_axes=True)
    return Mesh(np.transpose(device_array, _TO_MESH_AXES), MESH_AXES)


def mesh_shape(mesh: Mesh) -> tuple[int, ...]:
    """(data, fsdp, tensor, stage) sizes of ``mesh``."""
    return tuple(mesh.shape[axis] for axis in MESH_AXES)

"""The device mesh: four named axes ``(data, fsdp, tensor, stage)``.

Devices are laid out so that ``tensor`` varies fastest (neighbouring devices, the fastest links),
then ``fsdp``, then ``stage``, then ``data`` (the slowest links): the order in which their
collectives are most to least frequent.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from meshtrain.errors import ConfigError

MESH_AXES = ("data", "fsdp", "tensor", "stage")
# Device-array order (slowest to fastest varying), and its permutation back to MESH_AXES. The memory
# model reads it too: an axis is inside one node when it and every faster axis together fit in a node.
DEVICE_ORDER = ("data", "stage", "fsdp", "tensor")
_TO_MESH_AXES = tuple(DEVICE_ORDER.index(axis) for axis in MESH_AXES)
DCN_AXES = ("data", "fsdp", "stage")  # axes that may cross hosts (never tensor)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the mesh axes; at most one may be -1 (= fill with the remaining devices)."""

    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    stage: int = 1
    # Multi-host: how many hosts (processes; TPU slices) each axis spans over the slow network.
    # The axis size above is the total; ``dcn_data=2, data=4`` puts 2 data groups on each of 2
    # hosts. Their product must equal the number of hosts. ``tensor`` always stays within a host.
    dcn_data: int = 1
    dcn_fsdp: int = 1
    dcn_stage: int = 1

    @property
    def dcn(self) -> dict[str, int]:
        return {"data": self.dcn_data, "fsdp": self.dcn_fsdp, "tensor": 1, "stage": self.dcn_stage}

    @property
    def hybrid(self) -> bool:
        return math.prod(self.dcn.values()) > 1

    def __post_init__(self):
        for axis in DCN_AXES:
            size = getattr(self, f"dcn_{axis}")
            if size < 1:
                raise ConfigError(f"dcn_{axis}", f"must be a positive integer, got {size}")
            if getattr(self, axis) != -1 and getattr(self, axis) % size:
                raise ConfigError(f"dcn_{axis}", f"is {size}, which does not divide {axis}={getattr(self, axis)} "
                                  f"(the total size of the axis; each host holds {axis}/dcn_{axis} of it)")
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
                              f"{num_devices} {'is' if num_devices == 1 else 'are'} available; make the product "
                              f"{num_devices} "
                              "or set one axis to -1")
        return sizes


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh over ``devices`` (default: all) with axes ``MESH_AXES``, tensor varying fastest.

    Every axis is ``AxisType.Auto``, said explicitly (``jax.make_mesh``'s default is Explicit, and
    ``Mesh``'s could change too): XLA propagates shardings from those of the parameters and inputs
    and from the model's ``with_sharding_constraint`` calls; array types carry no sharding."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = cfg.resolve(len(devices))
    device_shape = tuple(sizes[axis] for axis in DEVICE_ORDER)
    if cfg.hybrid:
        device_array = _hybrid_device_array(cfg, sizes, devices)
    else:
        device_array = mesh_utils.create_device_mesh(device_shape, devices, allow_split_physical_axes=True)
    return Mesh(np.transpose(device_array, _TO_MESH_AXES), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _granule_key(devices: Sequence[jax.Device]) -> str:
    """What a host is for the slow network: the TPU slice when devices have several, else the process."""
    slices = {getattr(d, "slice_index", None) for d in devices}
    return "slice_index" if None not in slices and len(slices) > 1 else "process_index"


def _hybrid_device_array(cfg: MeshConfig, sizes: dict[str, int], devices: list[jax.Device]) -> np.ndarray:
    """The devices in ``DEVICE_ORDER``, each ``dcn_*`` axis laid over hosts and the rest within a host
    (``mesh_utils.create_hybrid_device_mesh``), with its errors turned into ``ConfigError``s."""
    dcn = cfg.dcn
    for axis in DCN_AXES:
        if sizes[axis] % dcn[axis]:
            raise ConfigError(f"mesh.dcn_{axis}", f"is {dcn[axis]}, which does not divide the resolved "
                              f"{axis}={sizes[axis]}")
    key = _granule_key(devices)
    hosts: dict[int, int] = {}
    for device in devices:
        hosts[getattr(device, key)] = hosts.get(getattr(device, key), 0) + 1
    unit = "slices" if key == "slice_index" else "processes"
    dcn_text = ", ".join(f"dcn_{axis}={dcn[axis]}" for axis in DCN_AXES)
    if math.prod(dcn.values()) != len(hosts):
        raise ConfigError("mesh", f"{dcn_text} multiply to {math.prod(dcn.values())} hosts, but the devices "
                          f"belong to {len(hosts)} {unit}; make the product {len(hosts)}")
    if len(set(hosts.values())) > 1:
        raise ConfigError("mesh", f"a hybrid mesh needs the same number of devices on every host; "
                          f"devices per {unit[:-2] if unit == 'processes' else unit[:-1]}: {hosts}")
    ici = tuple(sizes[axis] // dcn[axis] for axis in DEVICE_ORDER)
    per_host = next(iter(hosts.values()))
    if math.prod(ici) != per_host:
        raise ConfigError("mesh", f"within a host the axes are {dict(zip(DEVICE_ORDER, ici))} = "
                          f"{math.prod(ici)} devices, but each host has {per_host}")
    try:
        return mesh_utils.create_hybrid_device_mesh(
            ici, tuple(dcn[axis] for axis in DEVICE_ORDER), devices,
            process_is_granule=key == "process_index", allow_split_physical_axes=True)
    except ValueError as err:
        raise ConfigError("mesh", f"cannot lay the mesh over the hosts: {err}") from None


def mesh_shape(mesh: Mesh) -> tuple[int, ...]:
    """(data, fsdp, tensor, stage) sizes of ``mesh``."""
    return tuple(mesh.shape[axis] for axis in MESH_AXES)


def device_memory_bytes(device: jax.Device) -> int | None:
    """Bytes one device like ``device`` may use: its allocator's limit, or on CPU the host's RAM
    over the local devices; None where neither is known. Another process's device is answered by
    this process's own first device (only addressable devices report memory)."""
    if device.process_index != jax.process_index():
        device = jax.local_devices()[0]
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    if device.platform == "cpu" and hasattr(os, "sysconf"):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(1, jax.local_device_count())
    return None

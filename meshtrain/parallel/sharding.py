"""From logical rules to concrete shardings of parameters, optimizer state and batches, and the
start-up report of where each parameter lives.

Parameter specs are decided by ``layout.Layout`` (the rules, the ZeRO stage, the pipeline) and
become ``NamedSharding``s here; what a model applies to its activations is ``activations.py``.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshtrain.parallel.rules import ShardingRules, mesh_axes_of
from models.common import LogicalAxes, logical_axes_of

BATCH_AXES: LogicalAxes = ("batch", None)  # token arrays: rows split, each row whole on its devices


def _param_name(path: tuple) -> str:
    return ".".join(str(key) for key in path)


def _split_sizes(spec: PartitionSpec, mesh: Mesh) -> list[int]:
    """How many ways each dimension of ``spec`` is split on ``mesh``."""
    sizes = []
    for entry in spec:
        axes = mesh_axes_of(entry)
        sizes.append(math.prod(mesh.shape[axis] for axis in axes))
    return sizes


def named_shardings(specs: Any, mesh: Mesh) -> Any:
    """A tree of PartitionSpecs (e.g. ``Layout.state_specs().params``) as NamedShardings on ``mesh``."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                        is_leaf=lambda x: isinstance(x, PartitionSpec))



def batch_sharding(rules: ShardingRules, mesh: Mesh) -> NamedSharding:
    """Sharding of token arrays [batch, length]."""
    return NamedSharding(mesh, rules.activation_spec(BATCH_AXES))


def optimizer_shardings(abstract_opt_state: Any, abstract_params: nnx.State, params_shardings: nnx.State,
                        mesh: Mesh) -> Any:
    """Optimizer-state shardings: a leaf whose key path ends with a parameter's and whose shape is
    the parameter's (a moment, a momentum) is laid out like that parameter in ``params_shardings``;
    every other leaf (counters, masked-out placeholders, factored statistics) is replicated. Matching
    by path and shape serves any optax transformation, whatever its state's nesting."""
    replicated = NamedSharding(mesh, PartitionSpec())
    shardings = jax.tree_util.tree_leaves(params_shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    by_path = {tuple(path): (leaf.shape, sharding) for (path, leaf), sharding
               in zip(jax.tree_util.tree_flatten_with_path(abstract_params)[0], shardings, strict=True)}

    def choose(path, leaf) -> NamedSharding:
        for start in range(len(path)):
            found = by_path.get(tuple(path[start:]))
            if found is not None:
                return found[1] if found[0] == leaf.shape else replicated
        return replicated

    return jax.tree_util.tree_map_with_path(choose, abstract_opt_state)


def parameter_table(abstract_params: nnx.State, shardings: nnx.State) -> str:
    """One row per parameter: name, shape, logical axes, mesh spec, bytes per device; and totals.

    ``shardings`` are where the parameters live (``Trainer.param_shardings``: the rules, the ZeRO
    stage and the pipeline's ``layers -> stage`` applied).
    """
    rows = [("parameter", "shape", "logical axes", "mesh spec", "bytes/device")]
    total, per_device_total = 0, 0
    flat_shardings = dict(nnx.to_flat_state(shardings))
    for path, variable in nnx.to_flat_state(abstract_params):
        sharding = flat_shardings[path].get_value()
        nbytes = math.prod(variable.shape) * np.dtype(variable.dtype).itemsize
        per_device = nbytes // math.prod(_split_sizes(sharding.spec, sharding.mesh))
        total += nbytes
        per_device_total += per_device
        spec = tuple(sharding.spec) + (None,) * (len(variable.shape) - len(sharding.spec))
        rows.append((_param_name(path), str(tuple(variable.shape)),
                     str(tuple(logical_axes_of(variable))), str(spec), str(per_device)))
    rows.append(("total", "", "", "", f"{per_device_total} of {total}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
                     for row in rows)


def replicated_parameters(abstract_params: nnx.State, rules: ShardingRules, mesh: Mesh,
                          threshold_bytes: int) -> list[str]:
    """Names of parameters >= ``threshold_bytes`` left fully replicated although the mesh could split them."""
    if mesh.shape["fsdp"] == 1 and mesh.shape["tensor"] == 1:
        return []
    found = []
    for path, variable in nnx.to_flat_state(abstract_params):
        nbytes = math.prod(variable.shape) * np.dtype(variable.dtype).itemsize
        spec = rules.param_spec(logical_axes_of(variable))
        if nbytes >= threshold_bytes and math.prod(_split_sizes(spec, mesh)) == 1:
            found.append(f"{_param_name(path)} ({nbytes} bytes)")
    return found

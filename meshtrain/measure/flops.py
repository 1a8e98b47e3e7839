"""Matmul FLOPs of a traced function, counted from its jaxpr with loop trip counts.

XLA's ``cost_analysis`` counts a loop body once, so it cannot see how much work a scanned layer
stack or a pipeline schedule's tick loop does; this walks the jaxpr instead:

* ``dot_general``: ``2 x batch x contracted x lhs-free x rhs-free`` elements of its operands.
* ``ragged_dot_general`` (grouped matmuls): the same at its real rows, the weights' group
  dimension not counted (each row meets one group).
* ``scan``: its body times ``length``. ``while``: its body once per known trip (``fori_loop``
  with static bounds lowers to scan; a data-dependent ``while`` is counted once and flagged).
* ``cond`` (``switch``): the most expensive branch (what a device that takes it executes at most).
* Every other primitive with sub-jaxprs (``jit``, ``remat``, ``custom_vjp_call``, ``shard_map``, ...)
  is entered once.

Inside a ``shard_map`` the shapes are per device along its manual axes, so on a mesh whose only
split axes are the manual ones (e.g. a pipeline on ``(1, 1, 1, S)``: everything outside the
schedule is replicated over ``stage``), the count of a train step is the FLOPs each device
executes: the count MFU would use, and what a schedule's bubble and replicated work cost.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
from jax.extend import core


@dataclasses.dataclass
class FlopCount:
    """``flops``: matmul FLOPs; ``unbounded_loops``: data-dependent while loops counted once."""

    flops: float = 0.0
    unbounded_loops: int = 0


def _dot_flops(eqn: core.JaxprEqn) -> float:
    """``dot_general``: 2 x batch x contracted x both free sizes. ``ragged_dot_general`` (grouped
    matmuls) at its real rows: each row of the ragged dimension meets one group's weights, so a
    group dimension of the weights (the forward and the input gradient: [rows, in] x [groups, in,
    out]) is not a free dimension; the weight gradient ([rows, in] x [rows, out] -> [groups, in,
    out], rows contracted) is the plain count."""
    lhs, rhs = (var.aval.shape for var in eqn.invars[:2])
    if eqn.primitive.name == "ragged_dot_general":
        numbers = eqn.params["ragged_dot_dimension_numbers"]
        dimension_numbers, groups = numbers.dot_dimension_numbers, set(numbers.rhs_group_dimensions)
    else:
        dimension_numbers, groups = eqn.params["dimension_numbers"], set()
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    batch = math.prod(lhs[d] for d in lhs_batch)
    contracted = math.prod(lhs[d] for d in lhs_contract)
    lhs_free = math.prod(size for d, size in enumerate(lhs) if d not in (*lhs_contract, *lhs_batch))
    rhs_free = math.prod(size for d, size in enumerate(rhs) if d not in (*rhs_contract, *rhs_batch, *groups))
    return 2.0 * batch * contracted * lhs_free * rhs_free


def _sub_jaxprs(params: dict) -> list[core.Jaxpr]:
    found = []
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, core.ClosedJaxpr):
                found.append(item.jaxpr)
            elif isinstance(item, core.Jaxpr):
                found.append(item)
    return found


def count_jaxpr(jaxpr: core.Jaxpr, total: FlopCount | None = None, scale: float = 1.0) -> FlopCount:
    """Adds the matmul FLOPs of ``jaxpr`` (times ``scale``) to ``total``."""
    total = FlopCount() if total is None else total
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in ("dot_general", "ragged_dot_general"):
            total.flops += scale * _dot_flops(eqn)
        elif name == "scan":
            count_jaxpr(eqn.params["jaxpr"].jaxpr, total, scale * eqn.params["length"])
        elif name == "cond":
            branches = [count_jaxpr(branch.jaxpr) for branch in eqn.params["branches"]]
            total.flops += scale * max(branch.flops for branch in branches)
            total.unbounded_loops += sum(branch.unbounded_loops for branch in branches)
        elif name == "while":
            total.unbounded_loops += 1
            count_jaxpr(eqn.params["body_jaxpr"].jaxpr, total, scale)
            count_jaxpr(eqn.params["cond_jaxpr"].jaxpr, total, scale)
        else:
            for sub in _sub_jaxprs(eqn.params):
                count_jaxpr(sub, total, scale)
    return total


def count_flops(fn: Callable, *args: Any) -> FlopCount:
    """The matmul FLOPs of ``fn(*args)`` (arrays or ``ShapeDtypeStruct``s; traced, not compiled)."""
    return count_jaxpr(jax.make_jaxpr(fn)(*args).jaxpr)

"""A stage's backward split into its input-gradient and weight-gradient parts (zero-bubble
pipeline schedules such as ZB-H1), without duplicating any work.

``split_backward`` traces ``backward(residuals, cotangent) -> (d_params, d_inputs)`` to a jaxpr and
places each of its equations in one part:

* the input part: every equation the ``d_inputs`` outputs depend on (the critical path: the
  previous stage waits for them);
* the weight part: every equation only ``d_params`` depend on (the weight-gradient matmuls
  ``dW = a^T g`` and whatever feeds only them), run later, in the schedule's bubbles;
* neither: equations no output depends on, dropped (as XLA would drop them).

Each equation of the backward thus runs exactly once, in one of the two parts. What the weight
part needs from the input part (values it computed, or the cotangent itself) is handed over as
``cut``, a flat tuple of arrays; the residuals it reads itself. Composite equations that both parts
depend on are split in turn rather than placed whole in the input part:

* ``scan`` (the transposed layer stack): the input part scans the input-gradient chain and stacks
  each iteration's cut values as extra outputs; the weight part scans its own equations over them.
  A carry belongs to the input part if it or anything computed from it feeds the input part
  (found by fixpoint), else to the weight part.
* ``jit``, ``closed_call``, ``core_call`` and ``checkpoint`` (remat) bodies, evaluated inline (a
  ``jit``'s explicit shardings kept as sharding constraints, a checkpoint's ``prevent_cse`` as an
  optimization barrier on each part's inputs). Under a remat policy the recomputed forward goes
  where it is needed like the rest: what feeds the input gradient stays in the input part (under
  FULL, all of a Llama layer's), what only dW needs moves with the weight-gradient matmuls (under
  DOTS, the recomputed attention output, which only the output projection's dW reads).

Every other primitive (``cond``, ``while``, ``custom_jvp_call``, ``custom_vjp_call``,
``shard_map``, ...) is atomic: placed whole in the part that needs it, in the input part with its
outputs cut if both do. Collectives (a backward traced inside ``shard_map``) go where they are
needed like any equation; equations with side effects cannot be reordered or dropped safely and are
refused (``UnsupportedBackward``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core
from jax.extend.core import primitives

from models.kernels.attention import varying_axes


class UnsupportedBackward(ValueError):
    """The backward holds an equation that cannot be placed in one part (named in the message)."""


@dataclasses.dataclass(frozen=True)
class SplitBackward:
    """``backward`` in two parts that together run each of its equations once.

    input_grad: ``(residuals, cotangent) -> (d_inputs, cut)``, ``cut`` a tuple of arrays.
    weight_grad: ``(residuals, cut) -> d_params`` (the pytree of ``backward``'s first output).
    cut_shapes: shapes and dtypes of ``cut`` (what an executor allocates to hold it in between).
    """

    input_grad: Callable[[Any, Any], tuple[Any, tuple[jax.Array, ...]]]
    weight_grad: Callable[[Any, tuple[jax.Array, ...]], Any]
    cut_shapes: tuple[jax.ShapeDtypeStruct, ...]


def split_backward(backward: Callable, residuals: Any, cotangent: Any) -> SplitBackward:
    """Splits ``backward(residuals, cotangent) -> (d_params, d_inputs)`` (arrays or
    ``ShapeDtypeStruct``s as examples; the parts accept any values of the same structure and
    shapes) into its input-gradient and weight-gradient parts."""
    closed, out_shape = jax.make_jaxpr(backward, return_shape=True)(residuals, cotangent)
    if not (isinstance(out_shape, (tuple, list)) and len(out_shape) == 2):
        raise ValueError(f"backward must return (d_params, d_inputs), got {jax.tree.structure(out_shape)}")
    params_tree, inputs_tree = (jax.tree.structure(part) for part in out_shape)
    residuals_tree, cotangent_tree = jax.tree.structure(residuals), jax.tree.structure(cotangent)
    jaxpr, consts = _open(closed)
    num_residuals, num_params = residuals_tree.num_leaves, params_tree.num_leaves
    is_param = [index < num_params for index in range(len(jaxpr.outvars))]
    split = _JaxprSplit(jaxpr, consts, input_only=[index >= num_residuals for index in range(len(jaxpr.invars))],
                        input_outs=[not param for param in is_param], weight_outs=is_param)

    def leaves(tree, expected, name: str) -> list:
        flat, structure = jax.tree.flatten(tree)
        if structure != expected:
            raise ValueError(f"{name} of structure {structure}, expected {expected}")
        return flat

    def input_grad(residuals, cotangent):
        flat = leaves(residuals, residuals_tree, "residuals") + leaves(cotangent, cotangent_tree, "cotangent")
        outs, cut = split.run_input(flat)
        return jax.tree.unflatten(inputs_tree, outs[num_params:]), tuple(cut)

    def weight_grad(residuals, cut):
        flat = leaves(residuals, residuals_tree, "residuals") + [None] * cotangent_tree.num_leaves
        return jax.tree.unflatten(params_tree, split.run_weight(flat, list(cut))[:num_params])

    cut_shapes = tuple(jax.eval_shape(input_grad, residuals, cotangent)[1])
    return SplitBackward(input_grad, weight_grad, cut_shapes)


def _open(closed: Any) -> tuple[core.Jaxpr, list]:
    """(jaxpr, values of its constvars) of a ``ClosedJaxpr`` (in jax 0.11 an alias of ``Jaxpr``) or
    of a plain ``Jaxpr`` without constvars (``checkpoint`` and ``core_call`` bodies in jax 0.10)."""
    if isinstance(closed, core.ClosedJaxpr):
        return closed.jaxpr, list(closed.consts)
    return closed, []


def _select(values: Sequence, mask: Sequence[bool]) -> list:
    return [value for value, keep in zip(values, mask, strict=True) if keep]


def _scatter(values: Sequence, mask: Sequence[bool]) -> list:
    """The inverse of ``_select``: ``values`` at the True places of ``mask``, None elsewhere."""
    remaining = iter(values)
    return [next(remaining) if keep else None for keep in mask]


def _bind(eqn: core.JaxprEqn, invals: Sequence) -> list:
    """Runs one equation on ``invals`` (as ``jax.core.eval_jaxpr`` does) -> its outputs.

    A ``pvary`` (``jax.lax.pcast(..., to="varying")``) only marks its input as varying over its
    axes, and refuses an input that already is: a remat'd (``checkpoint``) forward recomputed in the
    backward marks values that the split parts may receive already varying over the stage axis
    (their inputs are made stage-varying), so such an equation marks only the axes still missing."""
    if eqn.primitive.name == "pvary":
        axes = tuple(axis for axis in eqn.params["axes"] if axis not in varying_axes(invals[0]))
        if not axes:
            return [invals[0]]
        with eqn.ctx.manager:
            return [eqn.primitive.bind(invals[0], **{**eqn.params, "axes": axes})]
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]


class _JaxprSplit:
    """The equations of one jaxpr placed in the two parts.

    ``input_only[i]``: invar i reaches the input part only (the cotangent; a carry of an input-part
    scan), so the weight part gets it through the cut; each part reads the other invars (residuals,
    loop invariants, scanned slices) itself. ``input_outs`` / ``weight_outs``: per outvar, the part
    that must produce it (at most one). Built: ``input_reads`` / ``weight_reads``, per invar, whether
    that part reads it (``weight_reads`` is False for ``input_only`` invars: they come in the cut);
    ``cut_size``: the length of the cut that ``run_input`` returns and ``run_weight`` takes.
    """

    def __init__(self, jaxpr: core.Jaxpr, consts: list, input_only: Sequence[bool],
                 input_outs: Sequence[bool], weight_outs: Sequence[bool]):
        self.jaxpr, self.consts = jaxpr, consts
        self.input_outs, self.weight_outs = list(input_outs), list(weight_outs)
        needed_by_input = set(_vars(_select(jaxpr.outvars, input_outs)))
        needed_by_weight = set(_vars(_select(jaxpr.outvars, weight_outs)))
        made_by_input = set()
        placements = []
        for eqn in reversed(jaxpr.eqns):  # each equation after all the readers of its outputs
            placement = _place(eqn, [v in needed_by_input for v in eqn.outvars],
                               [v in needed_by_weight for v in eqn.outvars])
            placements.append(placement)
            needed_by_input.update(_vars(_select(eqn.invars, placement.input_reads)))
            needed_by_weight.update(_vars(_select(eqn.invars, placement.weight_reads)))
            made_by_input.update(_select(eqn.outvars, placement.input_makes))
        self.placements = placements[::-1]
        handed_over = [v in needed_by_weight and only for v, only in zip(jaxpr.invars, input_only, strict=True)]
        self.input_reads = [v in needed_by_input or over for v, over in zip(jaxpr.invars, handed_over)]
        self.weight_reads = [v in needed_by_weight and not only for v, only in zip(jaxpr.invars, input_only)]
        # The cut: this level's (input-only invars, then input-part values in program order), then
        # each placement's (a split composite's) in program order.
        self.cut_vars = _select(jaxpr.invars, handed_over) + [
            v for eqn in jaxpr.eqns for v in eqn.outvars if v in made_by_input and v in needed_by_weight]
        self.cut_size = len(self.cut_vars) + sum(placement.cut_size for placement in self.placements)

    def run_input(self, invals: Sequence) -> tuple[list, list]:
        """invals per invar (read where ``input_reads``) -> (per outvar: its value where
        ``input_outs``, else None; the cut)."""
        env = dict(zip(self.jaxpr.constvars, self.consts, strict=True))
        env.update(zip(_select(self.jaxpr.invars, self.input_reads), _select(invals, self.input_reads)))
        placement_cuts = []
        for eqn, placement in zip(self.jaxpr.eqns, self.placements):
            outs, cut = placement.run_input(_gather(env, eqn.invars, placement.input_reads))
            env.update(zip(_select(eqn.outvars, placement.input_makes), _select(outs, placement.input_makes)))
            placement_cuts.extend(cut)
        return _gather(env, self.jaxpr.outvars, self.input_outs), [env[v] for v in self.cut_vars] + placement_cuts

    def run_weight(self, invals: Sequence, cut: Sequence) -> list:
        """invals per invar (read where ``weight_reads``), the cut -> per outvar: its value where
        ``weight_outs``, else None."""
        env = dict(zip(self.jaxpr.constvars, self.consts, strict=True))
        env.update(zip(_select(self.jaxpr.invars, self.weight_reads), _select(invals, self.weight_reads)))
        env.update(zip(self.cut_vars, cut[:len(self.cut_vars)], strict=True))
        offset = len(self.cut_vars)
        for eqn, placement in zip(self.jaxpr.eqns, self.placements):
            outs = placement.run_weight(_gather(env, eqn.invars, placement.weight_reads),
                                        cut[offset:offset + placement.cut_size])
            offset += placement.cut_size
            env.update(zip(_select(eqn.outvars, placement.weight_makes), _select(outs, placement.weight_makes)))
        return _gather(env, self.jaxpr.outvars, self.weight_outs)


def _vars(atoms: Sequence) -> list[core.Var]:
    return [atom for atom in atoms if isinstance(atom, core.Var)]


def _gather(env: dict, atoms: Sequence, mask: Sequence[bool]) -> list:
    """The values of ``atoms`` where ``mask``, None elsewhere."""
    return [(atom.val if isinstance(atom, core.Literal) else env[atom]) if keep else None
            for atom, keep in zip(atoms, mask, strict=True)]


def _is_axis_use(effect: core.Effect) -> bool:
    """Whether ``effect`` only marks a collective's use of a named mesh axis (``psum`` and the like
    inside ``shard_map``): no side effect, and every device runs the same program, so the
    collectives may move between the parts. jax exports no name for its class."""
    return type(effect).__name__ == "NamedAxisEffect"


def _place(eqn: core.JaxprEqn, input_needs: list[bool], weight_needs: list[bool]):
    """The placement of ``eqn``, given which of its outputs each part needs (an output both need
    the input part computes, and the enclosing level cuts)."""
    side_effects = [effect for effect in eqn.effects if not _is_axis_use(effect)]
    if side_effects:
        raise UnsupportedBackward(f"the backward's '{eqn.primitive.name}' equation has side effects "
                                  f"{side_effects}, which splitting would reorder or drop")
    weight_only = [weight and not both for both, weight in zip(input_needs, weight_needs)]
    split = _SPLITTERS.get(eqn.primitive)
    if split is not None and any(input_needs) and any(weight_only):
        return split(eqn, input_needs, weight_only)
    return _Whole(eqn, in_input=any(input_needs), in_weight=not any(input_needs) and any(weight_needs))


class _Whole:
    """An equation placed whole in the input part, the weight part, or neither (dead)."""

    cut_size = 0

    def __init__(self, eqn: core.JaxprEqn, *, in_input: bool, in_weight: bool):
        self.eqn, self.in_input, self.in_weight = eqn, in_input, in_weight
        self.input_reads, self.input_makes = [in_input] * len(eqn.invars), [in_input] * len(eqn.outvars)
        self.weight_reads, self.weight_makes = [in_weight] * len(eqn.invars), [in_weight] * len(eqn.outvars)

    def run_input(self, invals: Sequence) -> tuple[list, list]:
        return (_bind(self.eqn, invals) if self.in_input else [None] * len(self.eqn.outvars)), []

    def run_weight(self, invals: Sequence, cut: Sequence) -> list:
        return _bind(self.eqn, invals) if self.in_weight else [None] * len(self.eqn.outvars)


class _InlineSplit:
    """A call (``jit``, ``closed_call``, ``core_call``, ``checkpoint``) whose body is split like the
    enclosing jaxpr and evaluated inline in each part."""

    def __init__(self, eqn: core.JaxprEqn, input_needs: list[bool], weight_only: list[bool]):
        params = eqn.params
        jaxpr, consts = _open(params["jaxpr"] if "jaxpr" in params else params["call_jaxpr"])
        self.body = _JaxprSplit(jaxpr, consts, [False] * len(eqn.invars), input_needs, weight_only)
        self.input_reads, self.weight_reads = self.body.input_reads, self.body.weight_reads
        self.input_makes, self.weight_makes = input_needs, weight_only
        self.cut_size = self.body.cut_size
        # A differentiated checkpoint lowers with a barrier on its prevent_cse inputs (a bool for all
        # of them, or in jax 0.11 possibly one per input), so that XLA cannot merge its
        # recomputation with the forward's; each part keeps it on the inputs it reads.
        prevent_cse = params["prevent_cse"] if eqn.primitive is primitives.remat_p else False
        per_input = list(prevent_cse) if isinstance(prevent_cse, (tuple, list)) else [prevent_cse] * len(eqn.invars)
        self.barrier = [bool(prevent) and params["differentiated"] for prevent in per_input]
        self.in_shardings = self._shardings(params.get("in_shardings"), len(eqn.invars))
        self.out_shardings = self._shardings(params.get("out_shardings"), len(eqn.outvars))

    @staticmethod
    def _shardings(shardings: Sequence | None, count: int) -> list:
        """A ``jit``'s explicit shardings (None where unspecified, and for the other calls)."""
        return [s if isinstance(s, jax.sharding.Sharding) else None for s in shardings or [None] * count]

    def _enter(self, invals: Sequence, reads: list[bool]) -> list:
        vals = [v if s is None or not read else jax.lax.with_sharding_constraint(v, s)
                for v, s, read in zip(invals, self.in_shardings, reads)]
        barred = [barrier and read for barrier, read in zip(self.barrier, reads)]
        if any(barred):
            behind = iter(jax.lax.optimization_barrier(_select(vals, barred)))
            vals = [next(behind) if bar else v for v, bar in zip(vals, barred)]
        return vals

    def _leave(self, outs: list) -> list:
        return [v if s is None or v is None else jax.lax.with_sharding_constraint(v, s)
                for v, s in zip(outs, self.out_shardings)]

    def run_input(self, invals: Sequence) -> tuple[list, list]:
        outs, cut = self.body.run_input(self._enter(invals, self.input_reads))
        return self._leave(outs), cut

    def run_weight(self, invals: Sequence, cut: Sequence) -> list:
        return self._leave(self.body.run_weight(self._enter(invals, self.weight_reads), cut))


def _scan_group_sizes(params: dict) -> tuple[int, int]:
    """(number of consts, number of carries) of a scan equation: parameters in jax 0.10, the sizes
    of the flat-tree groups (consts, carry, xs) of its ``ft_in`` parameter in jax 0.11."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


class _ScanSplit:
    """A scan split into an input-part scan and a weight-part scan of the same length and
    direction. Operands: consts (loop invariants), carries, xs (scanned); results: carries, ys.

    The input part takes the carries that it, or anything computed from them in the body, feeds
    (``input_carries``, a fixpoint); the weight part the others it needs (``weight_carries``). Per
    iteration the input-part scan emits the body's cut as extra ys, stacked ``[length, ...]``: this
    equation's cut, which the weight-part scan takes as xs. Loop invariants and xs each part reads
    itself (the enclosing level cuts those the input part computes)."""

    def __init__(self, eqn: core.JaxprEqn, input_needs: list[bool], weight_only: list[bool]):
        params = eqn.params
        self.length, self.reverse, self.unroll = params["length"], params["reverse"], params["unroll"]
        jaxpr, consts = _open(params["jaxpr"])
        num_consts, num_carry = _scan_group_sizes(params)
        num_xs = len(eqn.invars) - num_consts - num_carry
        input_carries, weight_carries = input_needs[:num_carry], weight_only[:num_carry]
        while True:
            body = _JaxprSplit(jaxpr, consts, [False] * num_consts + input_carries + [False] * num_xs,
                               input_carries + input_needs[num_carry:], weight_carries + weight_only[num_carry:])
            carry_reads = slice(num_consts, num_consts + num_carry)
            grown_input = [carried or read for carried, read in zip(input_carries, body.input_reads[carry_reads])]
            grown_weight = [(carried or read) and not by_input for carried, read, by_input
                            in zip(weight_carries, body.weight_reads[carry_reads], grown_input)]
            if (grown_input, grown_weight) == (input_carries, weight_carries):
                break
            input_carries, weight_carries = grown_input, grown_weight
        self.body, self.num_consts, self.num_carry = body, num_consts, num_carry
        self.input_carries, self.weight_carries = input_carries, weight_carries
        self.input_ys, self.weight_ys = input_needs[num_carry:], weight_only[num_carry:]
        self.input_xs = body.input_reads[num_consts + num_carry:]
        self.weight_xs = body.weight_reads[num_consts + num_carry:]
        self.input_reads = body.input_reads[:num_consts] + input_carries + self.input_xs
        self.weight_reads = body.weight_reads[:num_consts] + weight_carries + self.weight_xs
        self.input_makes, self.weight_makes = input_carries + self.input_ys, weight_carries + self.weight_ys
        self.cut_size = body.cut_size

    def _groups(self, invals: Sequence) -> tuple[list, list, list]:
        """invals -> (consts, carries, xs)."""
        consts, rest = list(invals[:self.num_consts]), invals[self.num_consts:]
        return consts, list(rest[:self.num_carry]), list(rest[self.num_carry:])

    def _scan(self, step: Callable, init: list, xs: Any) -> tuple[list, Any]:
        return jax.lax.scan(step, init, xs, length=self.length, reverse=self.reverse, unroll=self.unroll)

    def run_input(self, invals: Sequence) -> tuple[list, list]:
        consts, init, xs = self._groups(invals)

        def step(carry: list, xs_slices: list) -> tuple[list, tuple[list, list]]:
            outs, cut = self.body.run_input(
                consts + _scatter(carry, self.input_carries) + _scatter(xs_slices, self.input_xs))
            carry_outs, ys = outs[:self.num_carry], outs[self.num_carry:]
            return _select(carry_outs, self.input_carries), (_select(ys, self.input_ys), cut)

        carry, (ys, cut) = self._scan(step, _select(init, self.input_carries), _select(xs, self.input_xs))
        return _scatter(carry, self.input_carries) + _scatter(ys, self.input_ys), cut

    def run_weight(self, invals: Sequence, cut: Sequence) -> list:
        consts, init, xs = self._groups(invals)

        def step(carry: list, slices: tuple[list, list]) -> tuple[list, list]:
            xs_slices, cut_slices = slices
            outs = self.body.run_weight(
                consts + _scatter(carry, self.weight_carries) + _scatter(xs_slices, self.weight_xs), cut_slices)
            carry_outs, ys = outs[:self.num_carry], outs[self.num_carry:]
            return _select(carry_outs, self.weight_carries), _select(ys, self.weight_ys)

        carry, ys = self._scan(step, _select(init, self.weight_carries), (_select(xs, self.weight_xs), list(cut)))
        return _scatter(carry, self.weight_carries) + _scatter(ys, self.weight_ys)


_SPLITTERS: dict[core.Primitive, Callable] = {
    primitives.scan_p: _ScanSplit,
    primitives.jit_p: _InlineSplit,
    primitives.closed_call_p: _InlineSplit,
    primitives.call_p: _InlineSplit,
    primitives.remat_p: _InlineSplit,
}

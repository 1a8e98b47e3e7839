"""FP8 training (``train.precision: fp8``): which weights' matmuls run in FP8, and the amax
histories delayed scaling keeps in the train state.

Under ``fp8`` the master weights and moments stay fp32 and everything else computes in
``train.fp8.wide`` (bf16, as under ``bf16``; fp32 isolates the FP8 matmuls); the weights a family
tags with one of the recipe's ``MatmulGroup``s (``train.fp8.matmuls``) reach the model as
``models.kernels.fp8.Fp8Weight`` values (``Fp8Training.attach``, after the cast), so their matmuls take
E4M3 operands forward and E5M2 gradients backward (``models.kernels.fp8``). The head, the embedding,
norms and routers stay wide.

In the step: attach -> forward/backward per microbatch (the gradient of each weight's ``observed``
is the amax of its matmul's input, weight and output gradient; microbatches and pipeline chunks
combine them by maximum: ``Fp8Weight.plus``) -> ``split`` into the parameters' gradients and the
step's amaxes -> the update, and with delayed scaling the histories shifted by one step with the
step's amaxes first (``updated``), both only when the loss, the gradient norm and every amax are
finite. A history is fp32 [stacked layer axes..., 3, train.fp8.history] per tagged weight, in a tree
nested as the parameters are (``layers.attention.query``), laid out like the weight's stacked axes and
stored in the same layer order (a pipeline's interleaving reorders it with the parameters).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from meshtrain.errors import ConfigError
from meshtrain.precision import Precision
from models.api import LAYERS_KEY, AxisRole, ModelFamily
from models.common import MATMUL_GROUP, coerce_enums
from models.kernels.fp8 import OPERANDS, Fp8Weight, MatmulGroup


class Scaling(str, enum.Enum):
    """How an FP8 operand's scale is chosen."""

    CURRENT = "current"  # from the operand's own amax in this matmul (no state)
    DELAYED = "delayed"  # from the largest amax of the last train.fp8.history steps (in the train state)


# Delayed scaling's longest amax history: each step shifts every history (fp32 [..., 3, steps] per
# tagged weight), so a history of 10^8 steps would allocate tens of GB at start-up.
MAX_HISTORY = 4096


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """``train.fp8``: the recipe of ``train.precision: fp8``."""

    scaling: Scaling = Scaling.CURRENT
    history: int = 16  # delayed scaling: steps of amax kept per operand (at most MAX_HISTORY)
    margin: int = 0  # scales leave 2**margin of headroom below the format's largest value
    # The groups of layer matmuls in FP8; None: every group the model tags.
    matmuls: tuple[MatmulGroup, ...] | None = None
    # What everything else computes in: bf16, or fp32 to isolate the FP8 matmuls (the layout proofs).
    wide: Precision = Precision.BF16

    def __post_init__(self):
        coerce_enums(self, ConfigError)
        valid = " | ".join(group.value for group in MatmulGroup)
        groups = []
        for value in self.matmuls or ():
            try:
                groups.append(MatmulGroup(value))
            except ValueError:
                raise ConfigError("fp8.matmuls", f"{value!r} is not a matmul group; use any of {valid}") from None
        if self.matmuls is not None and (not groups or len(set(groups)) < len(groups)):
            raise ConfigError("fp8.matmuls", f"must name each group at most once and at least one (or be null: "
                              f"every group the model tags), got {[g.value for g in groups]}; groups: {valid}")
        object.__setattr__(self, "matmuls", None if self.matmuls is None else tuple(groups))
        if self.wide not in (Precision.BF16, Precision.FP32):
            raise ConfigError("fp8.wide", f"must be bf16 or fp32, got {self.wide.value}")
        if not 1 <= self.history <= MAX_HISTORY:
            raise ConfigError("fp8.history", f"must be between 1 and {MAX_HISTORY} steps (Transformer Engine's "
                              f"default is 1024), got {self.history}")
        if not 0 <= self.margin <= 8:
            raise ConfigError("fp8.margin", f"must be between 0 and 8 (powers of two of headroom), got {self.margin}")


def dotted_name(path: tuple) -> str:
    """A parameter's path as ``layers.attention.query`` (the Variable's ``value`` attribute dropped)."""
    keys = [key for key in path if not isinstance(key, jax.tree_util.GetAttrKey)]
    return ".".join(str(getattr(key, "key", getattr(key, "idx", key))) for key in keys)


def _is_fp8(x: Any) -> bool:
    return isinstance(x, Fp8Weight)


def shifted(history: jax.Array, observed: jax.Array) -> jax.Array:
    """``history`` [..., 3, steps] one step older, with ``observed`` [..., 3] as its newest (first) entry."""
    return jnp.concatenate([observed[..., None], history[..., :-1]], axis=-1)


def nested(flat: Mapping[str, Any]) -> nnx.State:
    """``{"layers.mlp.up": x, ...}`` -> ``State({"layers": {"mlp": {"up": x}}})``: the parameters'
    nesting, so that what moves a parameter tree (a pipeline's layer order, checkpoints) moves it."""
    tree: dict = {}
    for name, value in flat.items():
        *parents, leaf = name.split(".")
        node = tree
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return nnx.State(tree)


def flat(tree: Any) -> dict[str, Any]:
    """The inverse of ``nested``: leaves by dotted path."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {dotted_name(path): leaf for path, leaf in leaves}


class Fp8Training:
    """FP8 for one model: its tagged weights (path -> stacked leading shape) under ``recipe``.

    ``abstract_params``: the model's parameters (``nnx.State`` of Variables, shapes suffice), of
    ``family``, whose stacked-layer axes (``layers`` and its ``AxisRole.STACKED`` axes) lead a
    tagged weight's history. Histories and amaxes are
    ``nnx.State`` trees nested as the parameters are (``nested``), holding the tagged weights only.
    """

    def __init__(self, recipe: Fp8Recipe, abstract_params: nnx.State, family: ModelFamily):
        self.recipe = recipe
        stacked_axes = {LAYERS_KEY} | {name for name, role in family.axis_roles.items() if role is AxisRole.STACKED}
        self.leading: dict[str, int] = {}  # path -> number of stacked leading axes
        self.shapes: dict[str, tuple[int, ...]] = {}
        tagged: dict[MatmulGroup, int] = {}  # group -> weights the model tags with it

        def visit(path, variable):
            metadata = variable.get_metadata() if isinstance(variable, nnx.Variable) else {}
            group = metadata.get(MATMUL_GROUP)
            if group is not None:
                tagged[group] = tagged.get(group, 0) + 1
            if group is not None and (recipe.matmuls is None or group in recipe.matmuls):
                axes = tuple(metadata.get("out_sharding") or ())
                stacked = next((i for i, axis in enumerate(axes) if axis not in stacked_axes), len(axes))
                name = dotted_name(path)
                self.leading[name], self.shapes[name] = stacked, tuple(variable.get_value().shape[:stacked])
            return variable

        jax.tree_util.tree_map_with_path(visit, abstract_params, is_leaf=lambda x: isinstance(x, nnx.Variable))
        has = f"the model tags {', '.join(g.value for g in tagged) or 'no group'}"
        missing = [g.value for g in recipe.matmuls or () if g not in tagged]
        if missing:
            raise ConfigError("train.fp8.matmuls", f"{missing}: {has}, so these would not run in FP8; name only "
                              "groups the model has, or null for all of them")
        if not self.leading:
            raise ConfigError("train.precision", f"fp8: {has}, so nothing would run in FP8; its family must tag its "
                              "layers' matmul weights (models.common.logical_param(..., group=...))")
        self.groups = tuple(g for g in MatmulGroup if g in tagged and (recipe.matmuls is None or g in recipe.matmuls))

    def describe(self) -> str:
        """One line: what runs in FP8 and how it is scaled."""
        recipe = self.recipe
        how = (f"delayed scaling over {recipe.history} steps" if self.delayed else "current scaling")
        return (f"fp8: {', '.join(g.value for g in self.groups)} matmuls of {len(self.leading)} weights in "
                f"E4M3 (gradients E5M2), {how}, margin {recipe.margin}; the rest in {recipe.wide.value}")

    @property
    def delayed(self) -> bool:
        return self.recipe.scaling is Scaling.DELAYED

    def initial_histories(self) -> nnx.State:
        """Zero histories (no step seen yet) for delayed scaling; an empty tree for current scaling."""
        if not self.delayed:
            return nnx.State({})
        return nested({name: jnp.zeros((*shape, len(OPERANDS), self.recipe.history), jnp.float32)
                       for name, shape in self.shapes.items()})

    def _leading_shardings(self, param_shardings: nnx.State, trailing: int) -> nnx.State:
        """Per tagged weight: its sharding's stacked leading entries, then ``trailing`` whole axes."""
        found = {}
        for name, sharding in flat(param_shardings).items():
            if name in self.leading:
                spec = (tuple(sharding.spec) + (None,) * self.leading[name])[:self.leading[name]]
                found[name] = NamedSharding(sharding.mesh, PartitionSpec(*spec, *(None,) * trailing))
        return nested(found)

    def history_shardings(self, param_shardings: nnx.State) -> nnx.State:
        """Where each history lives: split like its weight's stacked axes (over ``stage`` in a
        pipeline), whole along the operands and steps."""
        return self._leading_shardings(param_shardings, 2) if self.delayed else nnx.State({})

    def observed_shardings(self, param_shardings: nnx.State) -> nnx.State:
        return self._leading_shardings(param_shardings, 1)

    def attach(self, params: nnx.State, histories: nnx.State, observed: nnx.State | None = None) -> nnx.State:
        """``params`` with each tagged weight as an ``Fp8Weight`` of it, zero ``observed`` amaxes
        (or the given values: shardings, to constrain a tree of attached gradients) and its
        history (delayed scaling)."""
        histories, observed = flat(histories), None if observed is None else flat(observed)

        def wrap(path, leaf):
            name = dotted_name(path)
            if name not in self.leading:
                return leaf
            seen = (jnp.zeros((*self.shapes[name], len(OPERANDS)), jnp.float32) if observed is None
                    else observed[name])
            return Fp8Weight(weight=leaf, observed=seen, history=histories.get(name), margin=self.recipe.margin)

        return jax.tree_util.tree_map_with_path(wrap, params)

    def split(self, grads: nnx.State) -> tuple[nnx.State, nnx.State]:
        """Attached gradients -> (the parameters' gradients, the step's amaxes per tagged weight:
        fp32 [stacked..., 3] in ``OPERANDS`` order)."""
        observed = {}

        def unwrap(path, leaf):
            if isinstance(leaf, Fp8Weight):
                observed[dotted_name(path)] = leaf.observed
                return leaf.weight
            return leaf

        plain = jax.tree_util.tree_map_with_path(unwrap, grads, is_leaf=_is_fp8)
        return plain, nested(observed)

    @staticmethod
    def updated(histories: nnx.State, observed: nnx.State) -> nnx.State:
        """Each history ``shifted`` by the step's amaxes of its weight."""
        return jax.tree.map(shifted, histories, observed)

    @staticmethod
    def metrics(observed: nnx.State) -> dict[str, jax.Array]:
        """The step's largest amax of each operand over every FP8 matmul (``fp8_amax_input``,
        ``fp8_amax_weight``, ``fp8_amax_grad``)."""
        stacked = jnp.concatenate([value.reshape(-1, len(OPERANDS)) for value in jax.tree.leaves(observed)])
        return {f"fp8_amax_{operand}": jnp.max(stacked[:, i]) for i, operand in enumerate(OPERANDS)}

    @staticmethod
    def finite(observed: nnx.State) -> jax.Array:
        """bool []: whether every amax of the step is finite (a saturating cast would hide an
        inf or nan operand from the loss)."""
        return jnp.all(jnp.stack([jnp.all(jnp.isfinite(value)) for value in jax.tree.leaves(observed)]))

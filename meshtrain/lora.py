"""LoRA fine-tuning (``train.lora``): which weights get low-rank adapters, the adapters as the
trainable tree, and the weights merged back for export.

With ``train.lora.rank`` > 0 the model's parameters are frozen: held in the compute dtype, with no
optimizer state and no gradient. Each weight a family tags with one of ``train.lora.matmuls``'
groups gets ``a`` [stacked..., in..., rank] (uniform in +-1/sqrt(in), as PEFT's Kaiming init) and
``b`` [stacked..., rank, out...] (zeros), fp32, nested as the parameters are
(``layers.attention.query.a``): the train state's ``adapters``, which the optimizer trains. Their
logical axes are the base weight's with ``None`` for the rank, so the rules lay each adapter out as
its base (split over fsdp, tensor and stage alike). A weight's input axes are all but its last when
that is ``embed`` (an output projection), else its first (as ``muon_matrices`` reads them).

In the step: ``attach`` hands the model each adapted weight as a ``models.kernels.lora.LoraWeight``
(with this step's dropout seeds) -> forward/backward (the model built on ``frozen`` params: no
gradient of any frozen parameter) -> ``split``
takes the adapters' gradients out. ``merged`` folds ``scale x a @ b`` into the base (export).
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from meshtrain.errors import ConfigError
from meshtrain.fp8_training import dotted_name, flat, nested
from models.api import LAYERS_KEY, AxisRole, ModelFamily
from models.common import MATMUL_GROUP, LogicalAxes, coerce_enums, logical_axes_of
from models.kernels.fp8 import MatmulGroup
from models.kernels.lora import LoraWeight


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """``train.lora``: low-rank adapters on the layers' matmuls, the rest frozen (rank 0: off)."""

    rank: int = 0
    alpha: float = 16.0  # the update is scaled by alpha / rank (PEFT's lora_alpha)
    dropout: float = 0.0  # the probability that an input element is dropped on the adapter's path
    # The groups of layer matmuls that get adapters (models.kernels.fp8.MatmulGroup).
    matmuls: tuple[MatmulGroup, ...] = (MatmulGroup.ATTENTION, MatmulGroup.MLP)
    # A PEFT LoRA adapter directory to start the adapters from (meshtrain.weights.peft); None: fresh ones.
    init_from: str | None = None

    def __post_init__(self):
        coerce_enums(self, ConfigError)
        valid = " | ".join(group.value for group in (MatmulGroup.ATTENTION, MatmulGroup.MLP))
        groups = []
        for value in self.matmuls:
            try:
                groups.append(MatmulGroup(value))
            except ValueError:
                raise ConfigError("lora.matmuls", f"{value!r} is not a matmul group; use any of {valid}") from None
        if MatmulGroup.EXPERTS in groups:
            raise ConfigError("lora.matmuls", "experts: routed experts' matmuls run in grouped kernels that take "
                              f"no adapter; use any of {valid}")
        if not groups or len(set(groups)) < len(groups):
            raise ConfigError("lora.matmuls", f"must name each group once and at least one, got "
                              f"{[g.value for g in groups]}; groups: {valid}")
        object.__setattr__(self, "matmuls", tuple(groups))
        if self.rank < 0:
            raise ConfigError("lora.rank", f"must be >= 0 (0: every parameter trains), got {self.rank}")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ConfigError("lora.alpha", f"must be a finite number > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ConfigError("lora.dropout", f"must be in [0, 1), got {self.dropout}")
        if self.init_from is not None and not self.enabled:
            raise ConfigError("lora.init_from", "is set but train.lora.rank is 0 (LoRA off); set the adapter's rank")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclasses.dataclass(frozen=True)
class AdaptedWeight:
    """One weight with an adapter: its base's logical ``axes`` and ``shape`` (stacked axes first:
    ``leading`` of them), and how many axes after those are its ``inputs``."""

    axes: LogicalAxes
    shape: tuple[int, ...]
    leading: int
    inputs: int

    def adapter_axes(self) -> tuple[LogicalAxes, LogicalAxes]:
        """Logical axes of ``a`` and ``b``: the base's, with None for the rank."""
        split = self.leading + self.inputs
        return (*self.axes[:split], None), (*self.axes[:self.leading], None, *self.axes[split:])

    def adapter_shapes(self, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        split = self.leading + self.inputs
        return (*self.shape[:split], rank), (*self.shape[:self.leading], rank, *self.shape[split:])

    @property
    def fan_in(self) -> int:
        return math.prod(self.shape[self.leading:self.leading + self.inputs])


class LoraTraining:
    """LoRA for one model under ``cfg``: its adapted weights (by dotted path) in ``abstract_params``
    (shapes suffice) of ``family``, whose stacked axes (``layers`` and its ``AxisRole.STACKED``
    axes) lead an adapter's axes."""

    def __init__(self, cfg: LoraConfig, abstract_params: nnx.State, family: ModelFamily):
        self.cfg = cfg
        stacked_axes = {LAYERS_KEY} | {name for name, role in family.axis_roles.items() if role is AxisRole.STACKED}
        self.weights: dict[str, AdaptedWeight] = {}
        tagged: set[MatmulGroup] = set()
        self.base_size = 0

        def visit(path, variable):
            self.base_size += math.prod(variable.get_value().shape)
            group = variable.get_metadata().get(MATMUL_GROUP)
            tagged.add(group)
            if group in cfg.matmuls:
                axes = logical_axes_of(variable)
                leading = next((i for i, axis in enumerate(axes) if axis not in stacked_axes), len(axes))
                inputs = len(axes) - leading - 1 if axes[-1] == "embed" else 1
                self.weights[dotted_name(path)] = AdaptedWeight(axes, tuple(variable.get_value().shape), leading,
                                                                inputs)
            return variable

        jax.tree_util.tree_map_with_path(visit, abstract_params, is_leaf=lambda x: isinstance(x, nnx.Variable))
        has = ", ".join(sorted(g.value for g in tagged if g is not None)) or "no group"
        missing = [g.value for g in cfg.matmuls if g not in tagged]
        if missing:
            raise ConfigError("train.lora.matmuls", f"{missing}: the model tags {has}; name only groups it has")

    def describe(self, compute_dtype: jnp.dtype) -> str:
        """One line: where the adapters are, how many parameters train, what stays frozen."""
        cfg = self.cfg
        return (f"lora: rank {cfg.rank} (alpha {cfg.alpha:g}, dropout {cfg.dropout:g}) on the "
                f"{', '.join(g.value for g in cfg.matmuls)} matmuls ({len(self.weights)} weights): "
                f"{self.adapter_size:,} parameters train ({self.adapter_size / self.base_size:.2%} of "
                f"{self.base_size:,}), the rest frozen in {jnp.dtype(compute_dtype).name}")

    @property
    def adapter_size(self) -> int:
        return sum(math.prod(shape) for weight in self.weights.values()
                   for shape in weight.adapter_shapes(self.cfg.rank))

    def initial_adapters(self, seed: int) -> nnx.State:
        """Fresh adapters (layers in logical order): ``a`` uniform in +-1/sqrt(fan_in), ``b`` zero,
        each weight's draw from ``seed`` and its path (the same on every layout)."""
        found = {}
        for name, weight in self.weights.items():
            (a_axes, b_axes), (a_shape, b_shape) = weight.adapter_axes(), weight.adapter_shapes(self.cfg.rank)
            key = jax.random.fold_in(jax.random.key(seed), zlib.crc32(name.encode()))
            bound = weight.fan_in ** -0.5
            a = jax.random.uniform(key, a_shape, jnp.float32, -bound, bound)
            found[f"{name}.a"] = nnx.Param(a, out_sharding=a_axes, eager_sharding=False)
            found[f"{name}.b"] = nnx.Param(jnp.zeros(b_shape, jnp.float32), out_sharding=b_axes, eager_sharding=False)
        return nested(found)

    def abstract_adapters(self) -> nnx.State:
        """The adapters' shapes and logical axes (``initial_adapters`` traced, nothing allocated)."""
        return jax.eval_shape(self.initial_adapters, 0)

    def dropout_seeds(self, key: jax.Array, to_storage: Callable[[nnx.State], nnx.State]) -> nnx.State:
        """fp32 [stacked...] per adapted weight: integers below 2**24 drawn from ``key`` (the step's) for
        the layers in logical order, then put in storage order by ``to_storage``."""
        seeds = {name: jax.random.randint(jax.random.fold_in(key, zlib.crc32(name.encode())),
                                          weight.shape[:weight.leading], 0, 1 << 24).astype(jnp.float32)
                 for name, weight in self.weights.items()}
        return to_storage(nested(seeds))

    def attach(self, params: nnx.State, adapters: nnx.State, seeds: nnx.State) -> nnx.State:
        """``params`` with each adapted weight as a ``LoraWeight`` of it, its adapter and its seeds
        (the same for trees of shardings)."""
        adapters, seeds = flat(adapters), flat(seeds)

        def wrap(path, leaf):
            name = dotted_name(path)
            if name not in self.weights:
                return leaf
            return LoraWeight(base=leaf, a=adapters[f"{name}.a"], b=adapters[f"{name}.b"], seed=seeds[name],
                              scale=self.cfg.scale, inputs=self.weights[name].inputs, dropout=self.cfg.dropout)

        return jax.tree_util.tree_map_with_path(wrap, params)

    @staticmethod
    def frozen(params: nnx.State) -> nnx.State:
        """An attached tree with every leaf but the adapters under ``stop_gradient`` (for the model
        built inside the differentiated function): no gradient of a frozen parameter is computed,
        the head's and the embedding's included."""
        return jax.tree.map(lambda leaf: leaf if isinstance(leaf, LoraWeight) else jax.lax.stop_gradient(leaf),
                            params, is_leaf=lambda x: isinstance(x, LoraWeight))

    def seed_shardings(self, param_shardings: nnx.State) -> nnx.State:
        """Where the dropout seeds live: split like their weight's stacked axes."""
        found = {}
        for name, sharding in flat(param_shardings).items():
            if name in self.weights:
                leading = self.weights[name].leading
                found[name] = NamedSharding(sharding.mesh, PartitionSpec(*(tuple(sharding.spec) + (None,) * leading)
                                                                         [:leading]))
        return nested(found)

    def split(self, grads: nnx.State, adapters: nnx.State) -> nnx.State:
        """Gradients of an attached tree -> the adapters' gradients (a tree like ``adapters``)."""
        found = {}

        def take(path, leaf):
            if isinstance(leaf, LoraWeight):
                name = dotted_name(path)
                found[f"{name}.a"], found[f"{name}.b"] = leaf.a, leaf.b
            return leaf

        jax.tree_util.tree_map_with_path(take, grads, is_leaf=lambda x: isinstance(x, LoraWeight))
        return jax.tree_util.tree_map_with_path(lambda path, _: found[dotted_name(path)], adapters)

    def merged(self, params: nnx.State, adapters: nnx.State, dtype: jnp.dtype | None = None) -> nnx.State:
        """``params`` with ``scale x a @ b`` added to each adapted weight (summed in fp32), in ``dtype``
        (default: the parameters' own): the fine-tuned model as plain parameters."""
        adapters = flat(adapters)

        def merge(path, leaf):
            name = dotted_name(path)
            weight = self.weights.get(name)
            if weight is None:
                return leaf if dtype is None else leaf.astype(dtype)
            a, b = adapters[f"{name}.a"].astype(jnp.float32), adapters[f"{name}.b"].astype(jnp.float32)
            batch = weight.leading
            a = a.reshape(*a.shape[:batch], -1, a.shape[-1])  # [stacked..., in, rank]
            b = b.reshape(*b.shape[:batch + 1], -1)  # [stacked..., rank, out]
            update = jnp.matmul(a, b).reshape(leaf.shape) * self.cfg.scale
            return (leaf.astype(jnp.float32) + update).astype(leaf.dtype if dtype is None else dtype)

        return jax.tree_util.tree_map_with_path(merge, params)

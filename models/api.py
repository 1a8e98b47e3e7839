"""The one interface between meshtrain and a model family, and the registry of families.

A family is a decoder over stacked layers. The framework calls only what ``DecoderModel`` declares
(embed, the stacked layers, logits), reads only what ``ModelConfig`` declares, and learns everything
else about the family from its ``ModelFamily`` entry: its config class, its logical axes beyond the
framework's own (``FRAMEWORK_AXES``) and the role each plays under the rules, its costs
(``FamilyCosts``: FLOPs per token, and for the planner per-layer activation bytes queried with a
``LayerRequest``) and, optionally, its Hugging Face adapter.

Adding a family: write the module (config dataclass, ``nnx.Module``, ``ModelFamily(...)``), call
``register(family)`` at import time, and either list the module in ``models/__init__.py`` (built in)
or name it in ``model.plugin``: an importable module (``my_models.gpt``, found on the Python path) or
the path of its ``.py`` file (``toy_family.py``: in a config file, relative to that file's directory;
imported under its file name, with nothing added to the Python path). No file under ``meshtrain/``
changes.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Collection, Mapping
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from flax import nnx

from models.kernels.attention import AttentionSpec, attention_mask
from models.kernels.grouped_matmul import GroupedSpec
from models.common import ActivationSharding, RematPolicy, matmul
from models.kernels.fp8 import MatmulGroup

# Logical axes the framework itself names: batch rows; positions in the residual stream
# (``sequence``), in attention queries and block-internal activations (``length``) and in attention
# keys and values (``kv_length``), so that sequence and context parallelism can split them apart;
# hidden size, vocabulary, the stacked-layer axis. A family adds its own in ``ModelFamily.axis_roles``.
FRAMEWORK_AXES = ("batch", "sequence", "length", "kv_length", "embed", "vocab", "layers")
# The residual stream between layers (what ``embed`` returns and ``run_layers`` takes): how the
# pipeline keeps a stage's input where it chooses between the embedding and a received activation.
RESIDUAL_AXES = ("batch", "sequence", "embed")
# ``model.family`` when a config names none (every config and run directory from before families).
DEFAULT_FAMILY = "llama"
# The stacked-layers sub-module of every family: parameters under it lead with the ``layers`` axis.
LAYERS_KEY = "layers"
# The entry of ``run_layers``' auxiliary terms that is added to the training objective.
AUX_LOSS = "loss"
# What ``run_layers`` returns besides the activations: fp32 arrays, each summed over the batch rows.
LayerAux = dict[str, jax.Array]


def no_aux() -> LayerAux:
    """The auxiliary terms of layers that have none: a zero loss."""
    return {AUX_LOSS: jnp.zeros((), jnp.float32)}


class AxisRole(str, enum.Enum):
    """What a family's logical axis is, so that each rules preset knows where to put it.

    REPLICATED: never split (e.g. ``head_dim``).
    TENSOR: split by tensor parallelism, in parameters and activations alike (attention heads, MLP
    hidden units: the column- and row-parallel dimensions of Megatron's layer).
    EXPERT: the experts of a mixture-of-experts layer, split by expert parallelism over the mesh
    axes that split the batch (each device holds its share of the experts; tokens travel to them).
    EXPERT_ROWS: the batch rows of an expert's token buffer: split over the batch's mesh axes that
    the EXPERT axes do not take (none under full expert parallelism; all of them when the experts
    are replicated), so that each token's expert work is done once.
    PARAM_SHARDED: a weight dimension that fully sharded data parallelism splits as it splits
    ``embed``, for weights without an ``embed`` dimension (e.g. the input of a low-rank bottleneck's
    up-projection); activations keep it whole.
    STACKED: the leading axis of a stack of layers other than ``layers`` (which pipeline stages
    split), e.g. dense layers a family runs inside ``embed``: never split; a Hugging Face checkpoint
    stores one tensor per layer of it, as for ``layers`` (``TensorSpec.layer_offset``).
    """

    REPLICATED = "replicated"
    STACKED = "stacked"
    PARAM_SHARDED = "param_sharded"
    TENSOR = "tensor_parallel"
    EXPERT = "expert_parallel"
    EXPERT_ROWS = "expert_rows"


class ModelConfig(Protocol):
    """What the framework reads from any family's config (a frozen dataclass)."""

    vocab_size: int
    embed_dim: int
    num_layers: int
    seq_len: int
    remat: RematPolicy

    @property
    def attention_spec(self) -> AttentionSpec:
        """The attention the model asks ``ActivationSharding.attend`` for (the start-up line says
        which kernel runs it)."""

    @property
    def num_params(self) -> int: ...


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Documents:
    """Where each token of rows packed from several documents sits (``data.packing: documents``).

    Attributes:
      positions: int32 [batch, length], the token's position within its document (0 at its first
        token): position-dependent parts (rotary angles, learned position tables) restart there.
      segments: int32 [batch, length], which document of the row the token belongs to (numbered
        from 1 in the row; padding is segment 0). A token attends only to itself and earlier tokens
        of the same segment.
    """

    positions: jax.Array
    segments: jax.Array

    def attention_mask(self) -> jax.Array:
        """bool [batch, 1, length, length]: query t may attend key s (causal, same segment)."""
        index = jnp.arange(self.segments.shape[1])
        return attention_mask(index, index, self.segments)


def positions_of(documents: Documents | None, length: int) -> jax.Array:
    """int32 [batch or 1, length]: the documents' positions, or 0..length-1 for one sequence per row."""
    return jnp.arange(length, dtype=jnp.int32)[None] if documents is None else documents.positions


class DecoderModel(Protocol):
    """What the framework (trainer, every pipeline schedule, the tools) calls on a family's module.

    ``layers`` holds the stacked layers: every parameter under it leads with the ``layers`` axis, and a
    module merged from a slice of them (a pipeline stage's chunk) runs just those layers.

    ``documents`` is None when every row is one sequence (causal attention over the row, positions
    0..length-1), and a ``Documents`` when rows are packed from several documents: attention must
    then stay within ``documents.segments`` (``shard.attend`` does, as does
    ``documents.attention_mask()``) and positions restart at each document, so that each
    document's outputs equal those of the document run alone.
    """

    layers: nnx.Module

    def embed(self, tokens: jax.Array, shard: ActivationSharding,
              documents: Documents | None = None) -> jax.Array:
        """tokens [batch, length] -> x [batch, length, embed]."""

    def run_layers(self, x: jax.Array, shard: ActivationSharding,
                   documents: Documents | None = None) -> tuple[jax.Array, LayerAux]:
        """x [batch, length, embed] through the layers this module holds -> (x, aux).

        ``aux`` maps names to fp32 arrays, each **summed over the batch rows** of ``x``; the same
        names whatever layers the module holds. ``aux[AUX_LOSS]`` (a scalar) is the layers'
        auxiliary loss, already weighted by its coefficients (e.g. an MoE load-balancing loss); the
        framework divides it by the rows of the global batch and adds it to the objective, so the
        objective does not depend on how the rows are split into microbatches, pipeline microbatches
        or devices (``no_aux()`` when there is none). Every other entry is a statistic: the trainer
        reports its mean over the rows (of the step's batch; summed over pipeline stages, so a
        per-layer average should be summed per layer and divided by the model's layer count) as a
        metric of that name. (Return per-layer values as outputs of the layer scan and sum them,
        rather than carrying a sum: inside a pipeline stage a fresh carry would not be varying over
        the stage axis.)
        """

    def logits(self, x: jax.Array, shard: ActivationSharding) -> jax.Array:
        """x [batch, length, embed] -> logits [batch, length, vocab]:
        ``head_logits(head_input(x, shard), head_weight(), shard)``."""

    def head_input(self, x: jax.Array, shard: ActivationSharding) -> jax.Array:
        """x [batch, length, embed] (``run_layers``' output) -> the output head's input [batch, length,
        embed] (e.g. the final norm's output), which ``head_logits`` projects onto the vocabulary."""

    def head_weight(self) -> jax.Array:
        """The output head's weight [embed, vocab] (a tied embedding's transpose). The training loss
        projects onto it one slice of the vocabulary at a time (``meshtrain.loss.head_loss``)."""


# The head's input: whole positions (the vocabulary may split over tensor).
HEAD_AXES = ("batch", "length", "embed")


def head_logits(normed: jax.Array, weight: jax.Array, shard: ActivationSharding) -> jax.Array:
    """The output projection: normed [batch, length, embed] (``head_input``'s output) and ``weight``
    [embed, vocab] (``head_weight``'s, or a slice of its columns) -> fp32 logits [batch, length, vocab]
    (the fp32 sums, not rounded to the compute dtype)."""
    logits = matmul("btd,dv->btv", shard(normed, HEAD_AXES), weight, result_dtype=jnp.float32)
    return shard(logits, ("batch", "length", "vocab"))


# The metric of multi-token prediction: the mean over depths of their token losses, in the units of
# the main loss (``PredictsAhead``).
MTP_LOSS = "mtp_loss"


@runtime_checkable
class PredictsAhead(Protocol):
    """The optional multi-token prediction path: heads that predict tokens further ahead.

    Depth k (1..``ahead_depths``) reads, at position t, the token k positions after t's target (the
    target of position t + k). The framework adds ``ahead_weight`` times the mean over depths of
    their token losses (each as the main loss: summed over the targets, normalised by the main
    loss's target count) and ``aux[AUX_LOSS]`` to the objective, and reports the mean as
    ``MTP_LOSS``; under a pipeline the depths run with the head, on the last stage.
    """

    ahead_depths: int
    ahead_weight: float

    def predict_ahead(self, x: jax.Array, ahead_inputs: jax.Array, shard: ActivationSharding,
                      documents: Documents | None = None) -> tuple[jax.Array, LayerAux]:
        """x [batch, length, embed] (``run_layers``' output over all the layers), ahead_inputs int
        [depths, batch, length] (depth k's: the input token k positions after each position, in the
        batch's order) -> (streams [depths, batch, length, embed], each an input of the output head
        as ``head_input``'s output is: projected by ``head_weight``; aux with ``AUX_LOSS``, the depths'
        auxiliary loss summed over the rows, as ``run_layers``')."""


@runtime_checkable
class CachedDecoder(Protocol):
    """The optional generation path (``meshtrain.generate``): a KV cache filled position by position."""

    def init_cache(self, batch: int, max_len: int) -> Any:
        """An empty cache (a pytree) for ``batch`` sequences of up to ``max_len`` positions."""

    def cached_forward(self, tokens: jax.Array, cache: Any, start: jax.Array,
                       shard: ActivationSharding) -> tuple[jax.Array, Any]:
        """tokens [batch, length] at positions start.. -> (logits, the cache with them written)."""


def forward(model: DecoderModel, tokens: jax.Array, shard: ActivationSharding,
            documents: Documents | None = None) -> jax.Array:
    """tokens [batch, length] -> logits [batch, length, vocab] through the whole model."""
    x, _ = model.run_layers(model.embed(tokens, shard, documents), shard, documents)
    return model.logits(x, shard)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """How one of our parameters is stored in a Hugging Face checkpoint.

    ``name``: the HF tensor name (per-layer names hold ``{layer}``). ``groups``: our logical axes per
    HF dimension, outermost first (q_proj's rows are ``("heads", "head_dim")`` flattened).
    ``per_tensor``: our logical axes that HF stores as one tensor per index rather than as a
    dimension; ``name`` holds ``{axis}`` for each (Mixtral's experts:
    ``"model.layers.{layer}.block_sparse_moe.experts.{experts}.w1.weight"``, ``per_tensor=("experts",)``).
    ``layer_offset``: for a stacked parameter (under ``layers`` or a ``STACKED`` axis), the HF layer
    number of its first layer (``{layer}`` is the index in the stack plus it).
    """

    name: str
    groups: tuple[tuple[str, ...], ...]
    per_tensor: tuple[str, ...] = ()
    layer_offset: int = 0


class HFAdapter(Protocol):
    """A family's mapping to and from Hugging Face ``config.json`` + safetensors checkpoints."""

    model_types: tuple[str, ...]  # the config.json ``model_type`` values this family reads
    architecture_fields: tuple[str, ...]  # config fields that fix the weights' meaning

    def config_from_hf(self, config: dict, *, seq_len: int | None = None) -> Any:
        """The family config of a parsed ``config.json`` (``InvalidField`` naming the json key)."""

    def hf_config(self, cfg: Any, *, dtype: str, base: dict | None = None) -> dict:
        """A ``config.json`` for ``cfg``; non-architecture fields of ``base`` are kept."""

    def tensor(self, cfg: Any, path: tuple[str, ...]) -> TensorSpec:
        """The HF tensor of our parameter at ``path`` (``("layers", ...)`` for stacked ones) in a
        checkpoint of the model config ``cfg`` (whose fields may choose between layouts)."""

    def overrides(self, name: str, value: Any, ours: Any) -> list[str]:
        """``model.x=...`` overrides that set architecture field ``name`` to ``value``."""

    def unused_ok(self, name: str) -> bool:
        """Whether HF tensor ``name`` may be in a checkpoint without a parameter taking it (buffers,
        a duplicate of a tied embedding); any other unmapped tensor makes the import an error."""

    def config_for_weights(self, config: dict, tensor_names: Collection[str]) -> tuple[dict, str | None]:
        """``config.json`` as the checkpoint's weights (``tensor_names``) are, and a one-line note when
        that differs from what it says (e.g. modules it asks for that no tensor holds), else None."""


@runtime_checkable
class RoutedExperts(Protocol):
    """A model config whose layers route each token to some of their experts."""

    @property
    def sorted_dispatch(self) -> bool:
        """Whether the tokens' choices are sorted by expert and sent to the experts' devices by the
        framework (``ActivationSharding.run_experts``); else a one-hot dispatch, whose exchange XLA's
        partitioner writes."""


@runtime_checkable
class BlockedExperts(Protocol):
    """A model config whose experts may run the blocked kernel: ``expert_block`` rows per block (0:
    ``models.kernels.grouped_matmul.auto_block``). The trainer bounds it by the tokens of one step:
    an expert gets each token's row at most once, so a larger block holds no more of its rows, only
    padding (a buffer of ``experts x block`` rows, which XLA cannot allocate for a large enough block).
    ``grouped_spec``: the grouped-matmul kernel its sorted dispatch runs (``GroupedSpec``)."""

    expert_block: int

    @property
    def grouped_spec(self) -> GroupedSpec: ...


@dataclasses.dataclass(frozen=True)
class LayerRequest:
    """What the planner asks of one stacked layer's activations on one device (``FamilyCosts.layer_bytes``).

    ``block_ways``: how many ways tensor parallelism splits the blocks' heads and MLP units;
    ``remat``: the policy whose kept values ``saved`` counts; ``compute_bytes``: bytes per element the
    values are held in; ``sequence``: how many more ways the residual stream's positions are split than
    the blocks' (sequence parallelism's ``block_ways``); ``keys``: the key positions a query's attention scores span at
    once, on average (None: the whole sequence; under ring attention one ``[block, block]`` tile's
    over the rank's positions, ``block^2 / (seq_len / ring size)``); ``experts``: how many ways expert
    parallelism splits the experts over the devices holding the tokens (1: none); ``fp8``: the
    ``MatmulGroup``s whose matmuls run in FP8, whose operands the backward may keep as E4M3 (1 B)."""

    block_ways: int
    remat: RematPolicy
    compute_bytes: int
    sequence: int = 1
    keys: float | None = None
    experts: int = 1
    fp8: frozenset[MatmulGroup] = frozenset()

    def __post_init__(self):
        for name in ("block_ways", "compute_bytes", "sequence", "experts"):
            if getattr(self, name) < 1:
                raise ValueError(f"LayerRequest.{name} must be >= 1, got {getattr(self, name)}")
        if self.keys is not None and self.keys <= 0:
            raise ValueError(f"LayerRequest.keys must be > 0 or None, got {self.keys}")


@dataclasses.dataclass(frozen=True)
class LayerBytes:
    """Activation bytes per token and layer on one device: ``saved``, what the backward keeps under
    the request's remat policy; ``working``, one layer's live set while its backward runs (its
    recomputed activations and their gradients)."""

    saved: float
    working: float


@dataclasses.dataclass(frozen=True)
class FamilyCosts(abc.ABC):
    """A family's cost formulas for one model config ``cfg`` (``ModelFamily.costs(cfg)``): training
    FLOPs per token (MFU, the planner's roofline) and the planner's per-token sizes. A family
    subclasses it (``models/<family>/costs.py``) and implements the three abstract queries; the
    defaults describe a family without experts whose attention width the planner bounds."""

    cfg: Any

    @abc.abstractmethod
    def flops_per_token(self) -> float:
        """Training (forward + backward) FLOPs per token."""

    @abc.abstractmethod
    def recompute_flops_per_token(self, remat: RematPolicy) -> float:
        """Extra forward FLOPs per token that ``remat`` recomputes in the backward."""

    @abc.abstractmethod
    def layer_bytes(self, request: LayerRequest) -> LayerBytes:
        """One stacked layer's activation bytes per token on one device (``LayerRequest``)."""

    def exchange_bytes(self, experts: int, compute_bytes: int) -> float:
        """Bytes per token and layer one exchange of expert parallelism over ``experts`` ranks sends from
        a device (the token rows bound for the experts); 0 for a family without experts."""
        del experts, compute_bytes
        return 0.0

    def key_value_width(self, block_ways: int) -> float:
        """Elements per token of the keys and values one layer's attention hands the kernel on one
        device of a ``block_ways``-way split (what context parallelism's all-gather scheme gathers); by
        default bounded by ``2 * embed_dim``."""
        del block_ways
        return 2 * self.cfg.embed_dim


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """One registry entry: everything the framework needs to know about a family.

    Attributes:
      name: the ``model.family`` value.
      config_class: the family's config dataclass (the ``model`` section, less ``family``/``plugin``).
      model_class: ``model_class(cfg, rngs=nnx.Rngs)`` builds a ``DecoderModel``.
      axis_roles: the family's logical axes beyond ``FRAMEWORK_AXES`` and the role of each.
      costs: the family's ``FamilyCosts`` subclass; ``costs(cfg)`` answers for one model config.
      hf: the Hugging Face adapter, or None when the family has none.
      alerts: statistics of ``run_layers`` that should stay 0, each with what to do when one does
        not (the run warns once, in one line, at the first logged step where it is positive).
    """

    name: str
    config_class: type
    model_class: Callable[..., DecoderModel]
    axis_roles: Mapping[str, AxisRole]
    costs: type[FamilyCosts]
    hf: HFAdapter | None = None
    alerts: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        clash = sorted(set(self.axis_roles) & set(FRAMEWORK_AXES))
        if clash:
            raise ValueError(f"family {self.name!r} redefines the framework's logical axes {clash}")

    @property
    def logical_axes(self) -> tuple[str, ...]:
        """Every logical axis a model of this family may name."""
        return FRAMEWORK_AXES + tuple(self.axis_roles)

    def build(self, cfg: Any, seed: int = 0) -> DecoderModel:
        return self.model_class(cfg, rngs=nnx.Rngs(seed))


class UnknownFamily(LookupError):
    """``model.family`` or ``model.plugin`` names nothing registered or importable."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


_FAMILIES: dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> ModelFamily:
    """Adds ``family`` to the registry (at import of its module); a name is registered once."""
    known = _FAMILIES.get(family.name)
    if known is not None and known.config_class is not family.config_class:
        raise ValueError(f"model family {family.name!r} is already registered by {known.config_class}")
    _FAMILIES[family.name] = family
    return family


# ``model.plugin`` naming a file rather than a module: the path of a Python source file.
PLUGIN_FILE_SUFFIX = ".py"
# Plugin modules imported from a file: module name -> the file's absolute path (what ``plugin_of``
# records, so that a run's saved config finds the family again without the Python path).
_PLUGIN_FILES: dict[str, str] = {}


def is_plugin_file(plugin: str) -> bool:
    """Whether ``model.plugin`` names a ``.py`` file (else a module on the Python path)."""
    return plugin.endswith(PLUGIN_FILE_SUFFIX)


def import_plugin(module: str) -> None:
    """Imports ``module`` so that the families it defines register themselves: a module name, or the
    path of a ``.py`` file (relative to the current directory), imported under its file name."""
    if is_plugin_file(module):
        _import_file(module)
        return
    try:
        importlib.import_module(module)
    except Exception as err:  # noqa: BLE001 - whatever the plugin's own code raises, named in one line
        raise UnknownFamily("plugin", f"cannot import {module!r}: {_failure(err)}") from None


def plugin_imported(module: str) -> bool:
    """Whether ``import_plugin(module)`` would run no code: the module (or the ``.py`` file, by
    path) is imported already."""
    if not is_plugin_file(module):
        return module in sys.modules
    file = os.path.abspath(module)
    return any(_same_file(getattr(loaded, "__file__", None), file) for loaded in list(sys.modules.values()))


def _same_file(a: str | None, b: str) -> bool:
    try:
        return a is not None and os.path.samefile(a, b)
    except OSError:
        return False


def _import_file(path: str) -> None:
    """Imports the Python file ``path`` as the module named by its file name; the module already
    imported from that file (e.g. through the Python path) is used as it is."""
    file = os.path.abspath(path)
    name = os.path.basename(file)[:-len(PLUGIN_FILE_SUFFIX)]
    if not os.path.isfile(file):
        raise UnknownFamily("plugin", f"no such file: {file} (a model.plugin path in a config file is relative "
                            "to that file's directory; a module name is written without .py, e.g. my_models.gpt)")
    if not name.isidentifier():
        raise UnknownFamily("plugin", f"{file}: the file name must be a Python identifier (it becomes the module's "
                            f"name), got {name!r}")
    loaded = sys.modules.get(name)
    if loaded is not None:
        there = getattr(loaded, "__file__", None)
        if not _same_file(there, file):
            raise UnknownFamily("plugin", f"cannot import {file} as module {name!r}: a module of that name is "
                                f"already imported from {there or 'Python itself'}; rename the file")
        _PLUGIN_FILES[name] = file
        return
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        found = None
    if found is not None and found.origin not in (None, "built-in", "frozen") and not _same_file(found.origin, file):
        raise UnknownFamily("plugin", f"cannot import {file} as module {name!r}: another module of that name is on "
                            f"the Python path ({found.origin}); rename the file")
    spec = importlib.util.spec_from_file_location(name, file)
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[name] = loaded  # before running it: its dataclasses' type hints are resolved there
    try:
        spec.loader.exec_module(loaded)
    except Exception as err:  # noqa: BLE001 - whatever the plugin's own code raises, named in one line
        del sys.modules[name]
        raise UnknownFamily("plugin", f"cannot import {file}: {_failure(err)}") from None
    except BaseException:
        del sys.modules[name]
        raise
    _PLUGIN_FILES[name] = file


def _failure(err: Exception) -> str:
    """A plugin's import failure on one line: its type and message, and where a syntax error is."""
    if isinstance(err, SyntaxError):
        return f"SyntaxError at line {err.lineno}: {err.msg}"
    return f"{type(err).__name__}: {err}"


def family_named(name: str) -> ModelFamily:
    """The registered family ``name``."""
    if name not in _FAMILIES:
        raise UnknownFamily("family", f"unknown model family {name!r}; known: {sorted(_FAMILIES)} "
                            "(a family defined elsewhere needs model.plugin=its.module)")
    return _FAMILIES[name]


def family_of(cfg: Any) -> ModelFamily:
    """The family whose config class ``cfg`` is an instance of."""
    for family in _FAMILIES.values():
        if type(cfg) is family.config_class:
            return family
    raise UnknownFamily("family", f"{type(cfg).__name__} is not the config of a registered model family")


def plugin_of(family: ModelFamily) -> str | None:
    """The ``model.plugin`` that registers ``family`` again elsewhere (None for built-in families):
    the absolute path of the file it was imported from by path, else its module's name."""
    module = family.config_class.__module__
    return None if module.split(".")[0] == "models" else _PLUGIN_FILES.get(module, module)


def families() -> list[str]:
    return sorted(_FAMILIES)

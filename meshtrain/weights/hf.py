"""Hugging Face checkpoints <-> meshtrain models: config.json, safetensors, weights, for any model
family with an HF adapter (``models.api.HFAdapter``).

An HF directory holds ``config.json`` and either ``model.safetensors`` or sharded
``model-0000k-of-0000n.safetensors`` files listed in ``model.safetensors.index.json``
(``{"metadata": {"total_size": bytes}, "weight_map": {tensor name: file name}}``). The family is
chosen by ``config.json``'s ``model_type``; its adapter maps the config and names each tensor and
the logical axes of each of its dimensions (``TensorSpec``).

Loading builds every global array with ``jax.make_array_from_callback`` in its target
``NamedSharding``; each callback reads only its shard's slice from the safetensors files
(``safe_open(...).get_slice``), so no device and no host holds a full copy of a sharded parameter.
A parameter that HF stores as one tensor per index of one of its axes (``TensorSpec.per_tensor``:
one tensor per expert) is read the same way: a shard opens only the tensors of the indices it holds.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from meshtrain import jsonio
from meshtrain.distributed import log
from meshtrain.errors import ConfigError
from models.api import LAYERS_KEY, AxisRole, HFAdapter, ModelFamily, families, family_named, family_of
from models.common import InvalidField, logical_axes_of

INIT_PREFIX = "hf:"  # checkpoint.init_from=hf:DIR
CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Files copied along with the weights (tokenizer and generation defaults) when present.
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "generation_config.json", "tokenizer.model", "chat_template.jinja")
DTYPES = {"float32": np.float32, "bfloat16": "bfloat16", "float16": np.float16}
# safetensors dtypes an import refuses (``SafetensorsFiles.dtype`` spells them so).
NON_FLOAT_DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16",
                    "U32": "uint32", "I32": "int32", "U64": "uint64", "I64": "int64"}
DEFAULT_MAX_SHARD_BYTES = 5 * 10 ** 9
# --- config.json <-> the family's config -------------------------------------------------------------------

def _field(key: str) -> str:
    return f"{CONFIG_FILE}:{key}"


def read_config(hf_dir: str | pathlib.Path, *, field: str = "--hf") -> dict:
    """The parsed ``config.json`` of ``hf_dir`` (ConfigError on ``field`` when missing or invalid), as
    its weights are (``_fit_to_weights``)."""
    path = pathlib.Path(hf_dir) / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(field, f"{hf_dir} has no {CONFIG_FILE}; give a Hugging Face model directory")
    try:
        config = jsonio.loads(path.read_text())
    except ValueError as err:
        raise ConfigError(field, f"{path} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise ConfigError(field, f"{path} must hold a JSON object")
    return _fit_to_weights(config, path.parent)


def _fit_to_weights(config: dict, hf_dir: pathlib.Path) -> dict:
    """``config`` as the adapter of its ``model_type`` reads it against the tensors in ``hf_dir``
    (``HFAdapter.config_for_weights``: a DeepSeek-V3 ``config.json`` asking for prediction modules the
    weights lack); its note goes to stderr. Unchanged for a type no family reads or without readable
    weights (the import reports both)."""
    model_type = config.get("model_type")
    family = _supported_types().get(model_type) if isinstance(model_type, str) else None
    if family is None:
        return config
    try:
        tensor_names = SafetensorsFiles(hf_dir).file_of
    except ConfigError:
        return config
    config, note = family_named(family).hf.config_for_weights(config, tensor_names)
    if note:
        log(f"warning: {hf_dir}: {note}")
    return config


def adapter_of(family: ModelFamily, *, field: str) -> HFAdapter:
    """``family``'s HF adapter; a ConfigError on ``field`` when it has none."""
    if family.hf is None:
        raise ConfigError(field, f"model family {family.name!r} has no Hugging Face adapter")
    return family.hf


def _supported_types() -> dict[str, str]:
    """``config.json`` model_type -> the name of the family whose HF adapter reads it."""
    return {model_type: name for name in families() if family_named(name).hf is not None
            for model_type in family_named(name).hf.model_types}


def model_config(config: dict, *, seq_len: int | None = None) -> Any:
    """The model config (of the family whose adapter reads ``config.json``'s ``model_type``).

    Raises:
      ConfigError: naming the ``config.json`` field of an architecture or option that no family
        (or the chosen family) implements, or of a NaN or infinite number (any key).
    """
    found = jsonio.non_finite(config)
    if found is not None:  # Python's json reads NaN, Infinity and 1e999; no HF config holds one
        raise ConfigError(_field(found[0]), f"must be a finite number, got {found[1]}")
    supported = _supported_types()
    model_type = config.get("model_type")
    if model_type not in supported:
        raise ConfigError(_field("model_type"), f"{model_type!r} is not supported; supported: "
                          f"{sorted(supported)} (model families {sorted(set(supported.values()))})")
    try:
        return family_named(supported[model_type]).hf.config_from_hf(config, seq_len=seq_len)
    except InvalidField as err:  # the adapter's (a json key) or the config class's (a model field)
        raise ConfigError(_field(err.field), err.message) from None


def hf_config(cfg: Any, *, dtype: str, base: dict | None = None) -> dict:
    """A ``config.json`` for the model config ``cfg``.

    Raises:
      ConfigError: on ``model.<field>`` when no HF architecture holds what that field describes.
    """
    try:
        return adapter_of(family_of(cfg), field="--from").hf_config(cfg, dtype=dtype, base=base)
    except InvalidField as err:  # a model field (e.g. shared experts no HF architecture we write has)
        raise ConfigError(f"model.{err.field}", err.message) from None


def check_architecture(model: Any, hf: Any, *, field: str, where: str) -> None:
    """ConfigError on ``field`` when ``model`` (the run's) and ``hf`` differ in family or in an
    architecture field; the message lists the overrides that make the run's model section fit."""
    ours, theirs = family_of(model), family_of(hf)
    if ours is not theirs:
        raise ConfigError(field, f"{where} is a {theirs.name!r} model, but model.family is {ours.name!r}")
    adapter = adapter_of(ours, field=field)
    differ = [name for name in adapter.architecture_fields if getattr(model, name) != getattr(hf, name)]
    if not differ:
        return
    changes = " ".join(item for name in differ
                       for item in adapter.overrides(name, getattr(hf, name), getattr(model, name)))
    raise ConfigError(field, f"{where} does not fit the model section: {differ[0]} is "
                      f"{getattr(model, differ[0])} here but {getattr(hf, differ[0])} there"
                      f"{f' (and {len(differ) - 1} more)' if len(differ) > 1 else ''}; set {changes}")


# --- safetensors files -----------------------------------------------------------------------------

class SafetensorsFiles:
    """The tensors of an HF directory (one file or an index of shards), read slice by slice."""

    def __init__(self, hf_dir: str | pathlib.Path, *, field: str = "--hf"):
        from safetensors import safe_open

        self.root = pathlib.Path(hf_dir)
        self.field = field
        index = self.root / INDEX_FILE
        if index.is_file():
            try:
                weight_map = jsonio.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as err:
                raise ConfigError(field, f"{index} is not a safetensors index ({type(err).__name__}: "
                                  f"{str(err)[:80]}); expected {{\"weight_map\": {{tensor: file}}}}") from None
            if not isinstance(weight_map, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
                raise ConfigError(field, f"{index}: weight_map must map tensor names to file names")
            outside = next((item for item in weight_map.items() if not jsonio.is_plain_file_name(item[1])), None)
            if outside is not None:
                raise ConfigError(field, f"{index}: weight_map puts {outside[0]} in {outside[1]!r}, which is not a "
                                  f"plain file name; shards must be files in {hf_dir} (no directory part, not . "
                                  "or ..)")
            files = sorted(set(weight_map.values()))
        elif (self.root / SINGLE_FILE).is_file():
            files, weight_map = [SINGLE_FILE], None
        else:
            found = sorted(p.name for p in self.root.glob("*.bin")) or sorted(p.name for p in self.root.iterdir())
            raise ConfigError(field, f"{hf_dir} has neither {SINGLE_FILE} nor {INDEX_FILE} (found "
                              f"{found[:5]}); only safetensors weights are supported")
        self._handles = {}
        for name in files:
            try:
                self._handles[name] = safe_open(str(self.root / name), framework="numpy")
            except Exception as err:  # noqa: BLE001 - missing or corrupt shard
                raise ConfigError(field, f"cannot open {self.root / name}: {err}") from None
        self.file_of = (dict(weight_map) if weight_map is not None
                        else dict.fromkeys(self._handles[SINGLE_FILE].keys(), SINGLE_FILE))
        for name, file_name in self.file_of.items():
            if name not in set(self._handles[file_name].keys()):
                raise ConfigError(field, f"{INDEX_FILE} says tensor {name} is in {file_name}, which does not "
                                  "hold it")
        self.slices_read: list[tuple[str, int]] = []  # (tensor, elements) of every read, for tests

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self.file_of[name]].get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The tensor's dtype as a ``DTYPES`` key (``bfloat16``, ``float32``, ...)."""
        kind = self._handles[self.file_of[name]].get_slice(name).get_dtype()
        return {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}.get(kind, kind)

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """``tensor[index]`` (contiguous slices), reading only that part of the file; a ConfigError
        naming the tensor when the part holds a NaN or an infinity (a damaged checkpoint, refused
        here rather than reported by the first training step or as NaN logits)."""
        part = np.asarray(self._handles[self.file_of[name]].get_slice(name)[index])
        self.slices_read.append((name, int(part.size)))
        # One pass and no temporary the size of the part: a NaN or an infinity makes the float64 sum
        # non-finite (which finite float32/16 weights cannot: 3.4e38 each at most); then counted.
        bad = (0 if math.isfinite(float(np.sum(part, dtype=np.float64)))
               else int(np.count_nonzero(~np.isfinite(part))))
        if bad:
            raise ConfigError(self.field, f"tensor {name} in {self.root} holds NaN or infinite values ({bad} of "
                              f"the {part.size} read); the checkpoint is damaged, and no model can be trained or "
                              "run from it")
        return part


# --- the weight mapping ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TensorMap:
    """One of our parameters and the HF tensor(s) it comes from: one per layer when ``stacked``, and
    one per index of each ``per_tensor`` axis (the HF tensors then lack those dimensions)."""

    path: tuple[str, ...]  # our parameter path, e.g. ("layers", "attention", "query")
    hf_name: str  # with "{layer}" when stacked and "{axis}" for each per_tensor axis
    hf_groups: tuple[tuple[str, ...], ...]  # our axes per HF dimension
    axes: tuple[str, ...]  # our logical axes per layer (without "layers")
    sizes: dict[str, int]  # size of each of our axes
    stacked: bool
    per_tensor: tuple[str, ...] = ()  # our axes that index separate HF tensors, e.g. ("experts",)
    layer_offset: int = 0  # the HF layer number of the stack's first layer
    stack_size: int = 0  # layers in a stack other than ``layers`` (a STACKED axis); 0: ``layers``'

    def hf_tensor(self, layer: int | None, index: tuple[int, ...] = ()) -> str:
        """The HF name of layer ``layer``'s tensor (its index in the stack) at ``index`` (one int
        per ``per_tensor`` axis)."""
        return self.hf_name.format(layer=None if layer is None else layer + self.layer_offset,
                                   **dict(zip(self.per_tensor, index)))

    def hf_tensors(self, num_layers: int) -> list[str]:
        """Every HF tensor this parameter is stored in, layer by layer, then in index order
        (``num_layers``: the ``layers`` stack's size; another stack has its own)."""
        layers = range(self.stack_size or num_layers) if self.stacked else [None]
        return [self.hf_tensor(layer, index) for layer in layers for index in np.ndindex(*self.per_tensor_shape)]

    @property
    def per_tensor_shape(self) -> tuple[int, ...]:
        return tuple(self.sizes[axis] for axis in self.per_tensor)

    @property
    def hf_shape(self) -> tuple[int, ...]:
        """The shape of each HF tensor."""
        return tuple(math.prod(self.sizes[axis] for axis in group) for group in self.hf_groups)

    @property
    def _split_axes(self) -> list[str]:
        """Our axes in the order of the HF dimensions: the per-tensor ones, then those of each HF dimension."""
        return [*self.per_tensor, *(axis for group in self.hf_groups for axis in group)]

    def read(self, files: SafetensorsFiles, layer: int | None, ours: dict[str, slice]) -> np.ndarray:
        """Our per-layer array restricted to the ranges ``ours`` (axis -> slice), from the HF files.

        Only the HF tensors of the ``per_tensor`` indices in range are opened. Each HF dimension is
        read over the range of its outermost axis (times the inner axes' sizes), then split into our
        axes, cut to the inner ranges, stacked over the per-tensor indices and transposed to our order.
        """
        hf_index = []
        for group in self.hf_groups:
            inner = math.prod(self.sizes[axis] for axis in group[1:])
            outer = ours[group[0]]
            hf_index.append(slice(outer.start * inner, outer.stop * inner))
        split_shape = [ours[group[0]].stop - ours[group[0]].start if axis == group[0] else self.sizes[axis]
                       for group in self.hf_groups for axis in group]
        inner_ranges = tuple(slice(None) if axis == group[0] else ours[axis]
                             for group in self.hf_groups for axis in group)
        ranges = [range(ours[axis].start, ours[axis].stop) for axis in self.per_tensor]
        parts = [files.read(self.hf_tensor(layer, index), tuple(hf_index)).reshape(split_shape)[inner_ranges]
                 for index in itertools.product(*ranges)]
        part = np.stack(parts).reshape(*map(len, ranges), *parts[0].shape)
        return part.transpose([self._split_axes.index(axis) for axis in self.axes])

    def to_hf(self, layer_value: np.ndarray) -> np.ndarray:
        """Our per-layer array -> the HF tensor; [*per_tensor_shape, *hf_shape] when ``per_tensor``
        (``to_hf(x)[index]`` is the tensor ``hf_tensor(layer, index)``)."""
        return layer_value.transpose([self.axes.index(axis) for axis in self._split_axes]).reshape(
            *self.per_tensor_shape, *self.hf_shape)


def tensor_maps(adapter: HFAdapter, cfg: Any, abstract_params: nnx.State) -> list[TensorMap]:
    """The mapping of every parameter in ``abstract_params`` (an abstract model's state of model
    config ``cfg``)."""
    maps = []
    roles = family_of(cfg).axis_roles
    for path, variable in nnx.to_flat_state(abstract_params):
        path = tuple(str(key) for key in path)
        axes, shape = logical_axes_of(variable), variable.shape
        other_stack = roles.get(axes[0]) is AxisRole.STACKED if axes else False
        stacked = path[0] == LAYERS_KEY or other_stack
        stack_size = shape[0] if other_stack else 0
        if stacked:
            axes, shape = axes[1:], shape[1:]
        try:
            spec = adapter.tensor(cfg, path)
        except InvalidField as err:  # a parameter no HF tensor holds, named by the model field that makes it
            raise ConfigError(f"model.{err.field}", err.message) from None
        maps.append(TensorMap(path, spec.name, spec.groups, tuple(axes), dict(zip(axes, shape)), stacked,
                              spec.per_tensor, spec.layer_offset, stack_size))
    return maps


def num_layers_of(abstract_params: nnx.State) -> int:
    return jax.tree.leaves(abstract_params[LAYERS_KEY])[0].shape[0]


def _ranges(index: tuple[slice, ...], shape: tuple[int, ...]) -> list[slice]:
    """``index`` (from ``make_array_from_callback``) with every slice made explicit."""
    ranges = []
    for entry, size in zip(index, shape):
        start, stop, step = entry.indices(size)
        if step != 1:
            raise ValueError(f"strided shard index {index}")
        ranges.append(slice(start, stop))
    return ranges + [slice(0, size) for size in shape[len(index):]]


def check_tensors(files: SafetensorsFiles, maps: list[TensorMap], num_layers: int, adapter: HFAdapter, *,
                  field: str) -> None:
    """ConfigError naming the first HF tensor that is missing, has another shape than the config
    says or holds integers or booleans (which an import would cast to float without a word), or
    listing the tensors no parameter takes (weights that an import would silently drop, such as the
    q/k/v biases of a Qwen2 checkpoint labelled ``llama``)."""
    mapped = {name for tensor_map in maps for name in tensor_map.hf_tensors(num_layers)}
    unused = sorted(name for name in files.file_of if name not in mapped and not adapter.unused_ok(name))
    if unused:
        raise ConfigError(field, f"{files.root} holds {len(unused)} tensors this model has no parameter for "
                          f"({', '.join(unused[:4])}{', ...' if len(unused) > 4 else ''}); config.json does not "
                          "describe these weights, so importing would drop them")
    for tensor_map in maps:
        for name in tensor_map.hf_tensors(num_layers):
            if name not in files.file_of:
                raise ConfigError(field, f"tensor {name} is missing from {files.root} (config.json "
                                  f"describes a {num_layers}-layer model)")
            if files.shape(name) != tensor_map.hf_shape:
                raise ConfigError(field, f"tensor {name} in {files.root} has shape {list(files.shape(name))}, "
                                  f"but config.json implies {list(tensor_map.hf_shape)}")
            kind = NON_FLOAT_DTYPES.get(files.dtype(name))
            if kind is not None:
                raise ConfigError(field, f"tensor {name} in {files.root} is {kind}, not floating point; weights "
                                  "must be float32, bfloat16 or float16 (quantized checkpoints are not supported)")


def load_params(files: SafetensorsFiles, adapter: HFAdapter, cfg: Any, abstract_params: nnx.State,
                shardings: nnx.State, *, storage_of_logical: np.ndarray | None = None,
                field: str = "--hf") -> nnx.State:
    """The HF weights as fp32 global arrays in ``shardings`` (an ``nnx.State`` like ``abstract_params``,
    the abstract state of a model of config ``cfg``).

    Each device's shard is read from the files on its own (``make_array_from_callback``).
    ``storage_of_logical[i]`` is the logical layer stored at index i (interleaved pipelines);
    default: the identity.
    """
    maps = tensor_maps(adapter, cfg, abstract_params)
    num_layers = num_layers_of(abstract_params)
    check_tensors(files, maps, num_layers, adapter, field=field)
    order = np.arange(num_layers) if storage_of_logical is None else storage_of_logical
    flat_shardings = nnx.to_flat_state(shardings)
    loaded = []
    for tensor_map, (path, variable), (_, sharding) in zip(maps, nnx.to_flat_state(abstract_params),
                                                           flat_shardings):
        shape = tuple(variable.shape)

        def shard(index: tuple[slice, ...], tensor_map=tensor_map, shape=shape) -> np.ndarray:
            ranges = _ranges(index, shape)
            if not tensor_map.stacked:
                return tensor_map.read(files, None, dict(zip(tensor_map.axes, ranges))).astype(np.float32)
            ours = dict(zip(tensor_map.axes, ranges[1:]))
            stored = range(tensor_map.stack_size) if tensor_map.stack_size else order  # only ``layers`` is reordered
            layers = [tensor_map.read(files, int(stored[i]), ours) for i in range(ranges[0].start, ranges[0].stop)]
            return np.stack(layers).astype(np.float32)

        array = jax.make_array_from_callback(shape, sharding.get_value(), shard)
        loaded.append((path, variable.replace(array)))
    return nnx.from_flat_state(loaded)


def init_loader(hf_dir: str, trainer: Any, *, field: str = "checkpoint.init_from") -> Callable[[], dict]:
    """For ``checkpoint.init_from=hf:DIR``: checks ``config.json`` and the tensors' shapes against the
    trainer's model (reading no weights) and returns the loader of the weights, a plain nested dict
    of arrays in model layer order and in ``trainer.param_shardings``.

    Raises:
      ConfigError: on ``field`` when the checkpoint is unsupported or does not fit the model section.
    """
    try:
        hf_cfg = model_config(read_config(hf_dir, field=field))
    except ConfigError as err:
        if err.field == field:
            raise
        raise ConfigError(field, f"{hf_dir}: {err}") from None
    check_architecture(trainer.layout.model, hf_cfg, field=field, where=f"{INIT_PREFIX}{hf_dir}")
    adapter = adapter_of(family_of(hf_cfg), field=field)
    files = SafetensorsFiles(hf_dir, field=field)
    check_tensors(files, tensor_maps(adapter, trainer.layout.model, trainer.abstract_params), hf_cfg.num_layers,
                  adapter, field=field)
    return lambda: nnx.to_pure_dict(load_params(files, adapter, trainer.layout.model, trainer.abstract_params,
                                                trainer.param_shardings, field=field))


def tensor_dtypes(files: SafetensorsFiles) -> dict[str, str]:
    """HF tensor name -> dtype name, to write an import back in its own dtypes."""
    return {name: files.dtype(name) for name in files.file_of}


# --- writing -----------------------------------------------------------------------------------------

def _numpy_dtype(dtype: str) -> np.dtype:
    if dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def _files_of_tensors(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names grouped, in order, into files of at most ``max_shard_bytes`` (a larger tensor
    gets a file of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, nbytes in sizes.items():
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def save(out: str | pathlib.Path, cfg: Any, params: nnx.State, *, dtype: str | Callable[[str], str],
         base_config: dict | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
    """Writes ``params`` as an HF checkpoint under ``out``: ``config.json`` and ``model.safetensors``,
    or numbered shards of at most ``max_shard_bytes`` each plus ``model.safetensors.index.json``.

    ``dtype``: the file dtype of every tensor (``float32``, ``bfloat16``, ``float16``), or a function
    of the HF tensor name. Parameters are copied to the host one at a time and each file is written
    as soon as it is complete, so the host holds at most one stacked parameter and one file's tensors.
    Single-process only; returns the names of the files written.
    """
    from safetensors.numpy import save_file

    out = pathlib.Path(out)
    dtype_of = dtype if callable(dtype) else (lambda name: dtype)
    maps = list(zip(tensor_maps(adapter_of(family_of(cfg), field="--from"), cfg, params), nnx.to_flat_state(params)))
    sizes = {name: math.prod(tensor_map.hf_shape) * _numpy_dtype(dtype_of(name)).itemsize
             for tensor_map, _ in maps for name in tensor_map.hf_tensors(cfg.num_layers)}
    dtypes = set(map(dtype_of, sizes))
    config = hf_config(cfg, dtype=dtypes.pop() if len(dtypes) == 1 else "float32", base=base_config)
    groups = _files_of_tensors(sizes, max_shard_bytes)
    files = ([SINGLE_FILE] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    file_of = {name: file_name for file_name, group in zip(files, groups) for name in group}
    last_of = {group[-1]: file_name for file_name, group in zip(files, groups)}
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    pending: dict[str, np.ndarray] = {}
    for tensor_map, (_, variable) in maps:
        value = np.asarray(jax.device_get(variable.get_value()))
        for layer in range(value.shape[0]) if tensor_map.stacked else [None]:
            hf_value = tensor_map.to_hf(value[layer] if tensor_map.stacked else value)
            for index in np.ndindex(*tensor_map.per_tensor_shape):  # () alone without per-tensor axes
                name = tensor_map.hf_tensor(layer, index)
                pending[name] = np.ascontiguousarray(hf_value[index].astype(_numpy_dtype(dtype_of(name))))
                if name in last_of:  # its file is complete
                    # "format: pt" is what transformers expects of the files it loads.
                    save_file(pending, str(out / last_of[name]), metadata={"format": "pt"})
                    pending = {}
    if len(files) == 1:
        return [CONFIG_FILE, SINGLE_FILE]
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": file_of}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return [CONFIG_FILE, *files, INDEX_FILE]

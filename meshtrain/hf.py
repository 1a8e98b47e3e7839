"""Hugging Face Llama-family checkpoints <-> meshtrain's Llama: config.json, safetensors, weights.

An HF directory holds ``config.json`` and either ``model.safetensors`` or sharded
``model-0000k-of-0000n.safetensors`` files listed in ``model.safetensors.index.json``
(``{"metadata": {"total_size": bytes}, "weight_map": {tensor name: file name}}``).

Weight mapping (HF ``nn.Linear`` weights are ``[out_features, in_features]``; ``L`` = layer)::

    model.embed_tokens.weight                [vocab, embed]        -> embedding [vocab, embed]
    model.layers.L.input_layernorm.weight    [embed]               -> layers.attn_norm.scale [L, embed]
    model.layers.L.self_attn.q_proj.weight   [heads*head_dim, embed]    -> layers.attention.query [L, embed, heads, head_dim]
    model.layers.L.self_attn.k_proj.weight   [kv_heads*head_dim, embed] -> layers.attention.key   [L, embed, kv_heads, head_dim]
    model.layers.L.self_attn.v_proj.weight   [kv_heads*head_dim, embed] -> layers.attention.value [L, embed, kv_heads, head_dim]
    model.layers.L.self_attn.o_proj.weight   [embed, heads*head_dim]    -> layers.attention.out   [L, heads, head_dim, embed]
    model.layers.L.post_attention_layernorm.weight [embed]         -> layers.mlp_norm.scale [L, embed]
    model.layers.L.mlp.gate_proj.weight / up_proj  [mlp, embed]    -> layers.mlp.gate / up [L, embed, mlp]
    model.layers.L.mlp.down_proj.weight      [embed, mlp]          -> layers.mlp.down [L, mlp, embed]
    model.norm.weight                        [embed]               -> final_norm.scale [embed]
    lm_head.weight                           [vocab, embed]        -> head [embed, vocab] (absent when tied)

No rotary permutation is needed: HF stores q/k rows in the layout its ``rotate_half`` (half-split)
expects, which is the convention of ``models.llama.apply_rotary``.

Loading builds every global array with ``jax.make_array_from_callback`` in its target
``NamedSharding``; each callback reads only its shard's slice from the safetensors files
(``safe_open(...).get_slice``), so no device and no host holds a full copy of a sharded parameter.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from meshtrain.errors import ConfigError
from models.common import logical_axes_of
from models.llama import LlamaConfig, RopeScaling, RopeScalingConfig

INIT_PREFIX = "hf:"  # checkpoint.init_from=hf:DIR
CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Files copied along with the weights (tokenizer and generation defaults) when present.
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "generation_config.json", "tokenizer.model")
SUPPORTED_MODEL_TYPES = ("llama", "mistral")
DTYPES = {"float32": np.float32, "bfloat16": "bfloat16", "float16": np.float16}
DEFAULT_MAX_SHARD_BYTES = 5 * 10 ** 9
# Fields that fix the weights' meaning; a fine-tune's model section must agree on all of them.
ARCHITECTURE_FIELDS = ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                       "mlp_dim", "rope_theta", "rope_scaling", "norm_eps", "tie_embeddings")


# --- config.json <-> LlamaConfig -------------------------------------------------------------------

def _field(key: str) -> str:
    return f"{CONFIG_FILE}:{key}"


def read_config(hf_dir: str | pathlib.Path, *, field: str = "--hf") -> dict:
    """The parsed ``config.json`` of ``hf_dir`` (ConfigError on ``field`` when missing or invalid)."""
    path = pathlib.Path(hf_dir) / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(field, f"{hf_dir} has no {CONFIG_FILE}; give a Hugging Face model directory")
    try:
        config = json.loads(path.read_text())
    except ValueError as err:
        raise ConfigError(field, f"{path} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise ConfigError(field, f"{path} must hold a JSON object")
    return config


def _rope_parameters(config: dict) -> tuple[float, RopeScalingConfig]:
    """rope_theta and the scaling, from the transformers 4 (``rope_theta`` + ``rope_scaling``) or
    the transformers 5 (``rope_parameters``) spelling."""
    key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    rope = config.get(key) or {}
    if not isinstance(rope, dict):
        raise ConfigError(_field(key), f"must be an object or null, got {rope!r}")
    if rope and all(isinstance(value, dict) for value in rope.values()):
        raise ConfigError(_field(key), "per-layer-type rotary parameters are not supported")
    theta = float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConfigError(_field("partial_rotary_factor"), "partial rotary embeddings are not supported "
                          "(only 1.0)")
    if kind == "default":
        return theta, RopeScalingConfig()
    if kind != "llama3":
        raise ConfigError(_field(f"{key}.rope_type"), f"{kind!r} is not supported; supported: "
                          "none (default) and 'llama3'")
    try:
        original = rope.get("original_max_position_embeddings") or config["max_position_embeddings"]
        return theta, RopeScalingConfig(
            kind=RopeScaling.LLAMA3, factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]), original_max_len=int(original))
    except KeyError as err:
        raise ConfigError(_field(key), f"llama3 rotary scaling needs {err.args[0]!r}") from None


def llama_config(config: dict, *, seq_len: int | None = None) -> LlamaConfig:
    """The ``LlamaConfig`` of an HF ``config.json`` (already parsed).

    ``seq_len`` (the training length, which HF does not record) defaults to
    ``min(max_position_embeddings, 2048)``.

    Raises:
      ConfigError: naming the ``config.json`` field of an architecture or option meshtrain's
        Llama does not implement.
    """
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(_field("model_type"), f"{model_type!r} is not supported; supported: "
                          f"{list(SUPPORTED_MODEL_TYPES)} (Llama-family decoders)")
    architectures = config.get("architectures") or []
    unsupported = [name for name in architectures if not name.endswith("ForCausalLM")]
    if unsupported:
        raise ConfigError(_field("architectures"), f"{unsupported} is not supported; only "
                          "*ForCausalLM checkpoints (with an lm_head) are")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise ConfigError(_field(key), "is true; meshtrain's Llama has no biases (only false is "
                              "supported)")
    if config.get("sliding_window") is not None and config.get("use_sliding_window", True):
        raise ConfigError(_field("sliding_window"), f"is {config['sliding_window']}; sliding-window "
                          "attention is not supported (only null)")
    if config.get("hidden_act", "silu") != "silu":
        raise ConfigError(_field("hidden_act"), f"{config['hidden_act']!r} is not supported (only 'silu')")
    if config.get("quantization_config"):
        raise ConfigError(_field("quantization_config"), "quantized checkpoints are not supported")
    missing = [key for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if not isinstance(config.get(key), int)]
    if missing:
        raise ConfigError(_field(missing[0]), "is missing or not an integer")
    theta, scaling = _rope_parameters(config)
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    max_len = int(config.get("max_position_embeddings") or 2048)
    try:
        return LlamaConfig(
            vocab_size=config["vocab_size"], embed_dim=config["hidden_size"],
            num_layers=config["num_hidden_layers"], num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads, head_dim=head_dim,
            mlp_dim=config["intermediate_size"], seq_len=seq_len or min(max_len, 2048),
            rope_theta=theta, rope_scaling=scaling, norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)))
    except ValueError as err:  # models.common.InvalidField
        raise ConfigError(_field(getattr(err, "field", "config")), getattr(err, "message", str(err))) from None


def hf_config(cfg: LlamaConfig, *, dtype: str, base: dict | None = None) -> dict:
    """A ``config.json`` for ``cfg`` (LlamaForCausalLM). Fields of ``base`` (the config an import
    came from) that do not describe the architecture are kept: token ids, max_position_embeddings."""
    config = {key: value for key, value in (base or {}).items()
              if key in ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings",
                         "initializer_range")}
    if cfg.rope_scaling.kind is RopeScaling.LLAMA3:
        scaling = cfg.rope_scaling
        rope_scaling = {"rope_type": "llama3", "factor": scaling.factor,
                        "low_freq_factor": scaling.low_freq_factor,
                        "high_freq_factor": scaling.high_freq_factor,
                        "original_max_position_embeddings": scaling.original_max_len}
    else:
        rope_scaling = None
    config.update({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.embed_dim,
        "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": rope_scaling,
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "mlp_bias": False,
        "attention_dropout": 0.0, "torch_dtype": dtype, "dtype": dtype,  # transformers 4 and 5 spellings
    })
    original = cfg.rope_scaling.original_max_len if rope_scaling else 0
    config.setdefault("max_position_embeddings", max(cfg.seq_len, original))
    return config


def _architecture(cfg: LlamaConfig) -> dict[str, Any]:
    return {name: getattr(cfg, name) for name in ARCHITECTURE_FIELDS}


def check_architecture(model: LlamaConfig, hf: LlamaConfig, *, field: str, where: str) -> None:
    """ConfigError on ``field`` when ``model`` (the run's) and ``hf`` differ in an architecture field;
    the message lists the overrides that make the run's model section fit."""
    ours, theirs = _architecture(model), _architecture(hf)
    differ = [name for name in ARCHITECTURE_FIELDS if ours[name] != theirs[name]]
    if not differ:
        return

    def overrides(name: str, value: Any) -> list[str]:
        if isinstance(value, RopeScalingConfig):
            return [f"model.rope_scaling.{key}={getattr(value, key).value if key == 'kind' else getattr(value, key)}"
                    for key in ("kind", "factor", "low_freq_factor", "high_freq_factor", "original_max_len")
                    if getattr(value, key) != getattr(ours[name], key)]
        return [f"model.{name}={str(value).lower() if isinstance(value, bool) else value}"]

    changes = " ".join(item for name in differ for item in overrides(name, theirs[name]))
    raise ConfigError(field, f"{where} does not fit the model section: {differ[0]} is {ours[differ[0]]} "
                      f"here but {theirs[differ[0]]} there"
                      f"{f' (and {len(differ) - 1} more)' if len(differ) > 1 else ''}; set {changes}")


# --- safetensors files -----------------------------------------------------------------------------

class SafetensorsFiles:
    """The tensors of an HF directory (one file or an index of shards), read slice by slice."""

    def __init__(self, hf_dir: str | pathlib.Path, *, field: str = "--hf"):
        from safetensors import safe_open

        self.root = pathlib.Path(hf_dir)
        index = self.root / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as err:
                raise ConfigError(field, f"{index} is not a safetensors index ({err})") from None
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
            except Exception as err:  # missing or corrupt shard
                raise ConfigError(field, f"cannot open {self.root / name}: {err}") from None
        self.file_of = dict(weight_map) if weight_map is not None else {
            key: SINGLE_FILE for key in self._handles[SINGLE_FILE].keys()}
        self.slices_read: list[tuple[str, int]] = []  # (tensor, elements) of every read, for tests

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self.file_of[name]].get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The tensor's dtype as a ``DTYPES`` key (``bfloat16``, ``float32``, ...)."""
        kind = self._handles[self.file_of[name]].get_slice(name).get_dtype()
        return {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}.get(kind, kind)

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """``tensor[index]`` (contiguous slices), reading only that part of the file."""
        part = self._handles[self.file_of[name]].get_slice(name)[index]
        self.slices_read.append((name, int(part.size)))
        return np.asarray(part)


# --- the weight mapping ------------------------------------------------------------------------------

# Each HF tensor dimension is a group of our logical axes, outermost first (q_proj's rows are
# (heads, head_dim) flattened). Per-layer names take the layer number.
_LAYER_TENSORS: dict[tuple[str, ...], tuple[str, tuple[tuple[str, ...], ...]]] = {
    ("attn_norm", "scale"): ("input_layernorm.weight", (("embed",),)),
    ("attention", "query"): ("self_attn.q_proj.weight", (("heads", "head_dim"), ("embed",))),
    ("attention", "key"): ("self_attn.k_proj.weight", (("kv_heads", "head_dim"), ("embed",))),
    ("attention", "value"): ("self_attn.v_proj.weight", (("kv_heads", "head_dim"), ("embed",))),
    ("attention", "out"): ("self_attn.o_proj.weight", (("embed",), ("heads", "head_dim"))),
    ("mlp_norm", "scale"): ("post_attention_layernorm.weight", (("embed",),)),
    ("mlp", "gate"): ("mlp.gate_proj.weight", (("mlp",), ("embed",))),
    ("mlp", "up"): ("mlp.up_proj.weight", (("mlp",), ("embed",))),
    ("mlp", "down"): ("mlp.down_proj.weight", (("embed",), ("mlp",))),
}
_GLOBAL_TENSORS: dict[tuple[str, ...], tuple[str, tuple[tuple[str, ...], ...]]] = {
    ("embedding",): ("model.embed_tokens.weight", (("vocab",), ("embed",))),
    ("final_norm", "scale"): ("model.norm.weight", (("embed",),)),
    ("head",): ("lm_head.weight", (("vocab",), ("embed",))),
}


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """One of our parameters and the HF tensor(s) it comes from (one per layer when ``stacked``)."""

    path: tuple[str, ...]  # our parameter path, e.g. ("layers", "attention", "query")
    hf_name: str  # with "{layer}" when stacked
    hf_groups: tuple[tuple[str, ...], ...]  # our axes per HF dimension
    axes: tuple[str, ...]  # our logical axes per layer (without "layers")
    sizes: dict[str, int]  # size of each of our axes
    stacked: bool

    def hf_tensor(self, layer: int | None) -> str:
        return self.hf_name.format(layer=layer)

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(math.prod(self.sizes[axis] for axis in group) for group in self.hf_groups)

    def read(self, files: SafetensorsFiles, layer: int | None, ours: dict[str, slice]) -> np.ndarray:
        """Our per-layer array restricted to the ranges ``ours`` (axis -> slice), from the HF file.

        Each HF dimension is read over the range of its outermost axis (times the inner axes'
        sizes), then split into our axes, cut to the inner ranges and transposed to our order.
        """
        hf_index = []
        for group in self.hf_groups:
            inner = math.prod(self.sizes[axis] for axis in group[1:])
            outer = ours[group[0]]
            hf_index.append(slice(outer.start * inner, outer.stop * inner))
        part = files.read(self.hf_tensor(layer), tuple(hf_index))
        split_axes = [axis for group in self.hf_groups for axis in group]
        part = part.reshape([ours[group[0]].stop - ours[group[0]].start if axis == group[0] else self.sizes[axis]
                             for group in self.hf_groups for axis in group])
        part = part[tuple(slice(None) if axis == group[0] else ours[axis]
                          for group in self.hf_groups for axis in group)]
        return part.transpose([split_axes.index(axis) for axis in self.axes])

    def to_hf(self, layer_value: np.ndarray) -> np.ndarray:
        """Our per-layer array -> the HF tensor."""
        split_axes = [axis for group in self.hf_groups for axis in group]
        return layer_value.transpose([self.axes.index(axis) for axis in split_axes]).reshape(self.hf_shape)


def tensor_maps(abstract_params: nnx.State) -> list[TensorMap]:
    """The mapping of every parameter in ``abstract_params`` (from ``nnx.eval_shape(Llama)``)."""
    maps = []
    for path, variable in nnx.to_flat_state(abstract_params):
        path = tuple(str(key) for key in path)
        axes = logical_axes_of(variable)
        stacked = path[0] == "layers"
        if stacked:
            name, groups = _LAYER_TENSORS[path[1:]]
            name, axes, shape = f"model.layers.{{layer}}.{name}", axes[1:], variable.shape[1:]
        else:
            name, groups = _GLOBAL_TENSORS[path]
            shape = variable.shape
        maps.append(TensorMap(path, name, groups, tuple(axes), dict(zip(axes, shape)), stacked))
    return maps


def _ranges(index: tuple[slice, ...], shape: tuple[int, ...]) -> list[slice]:
    """``index`` (from ``make_array_from_callback``) with every slice made explicit."""
    ranges = []
    for entry, size in zip(index, shape):
        start, stop, step = entry.indices(size)
        if step != 1:
            raise ValueError(f"strided shard index {index}")
        ranges.append(slice(start, stop))
    return ranges + [slice(0, size) for size in shape[len(index):]]


def check_tensors(files: SafetensorsFiles, maps: list[TensorMap], num_layers: int, *, field: str) -> None:
    """ConfigError naming the first HF tensor that is missing or has another shape than the config says."""
    for tensor_map in maps:
        for layer in range(num_layers) if tensor_map.stacked else [None]:
            name = tensor_map.hf_tensor(layer)
            if name not in files.file_of:
                raise ConfigError(field, f"tensor {name} is missing from {files.root} (config.json "
                                  f"describes a {num_layers}-layer model)")
            if files.shape(name) != tensor_map.hf_shape:
                raise ConfigError(field, f"tensor {name} in {files.root} has shape {list(files.shape(name))}, "
                                  f"but config.json implies {list(tensor_map.hf_shape)}")


def load_params(files: SafetensorsFiles, abstract_params: nnx.State, shardings: nnx.State, *,
                storage_of_logical: np.ndarray | None = None, field: str = "--hf") -> nnx.State:
    """The HF weights as fp32 global arrays in ``shardings`` (an ``nnx.State`` like ``abstract_params``).

    Each device's shard is read from the files on its own (``make_array_from_callback``).
    ``storage_of_logical[i]`` is the logical layer stored at index i (interleaved pipelines);
    default: the identity.
    """
    maps = tensor_maps(abstract_params)
    num_layers = abstract_params["layers"]["attn_norm"]["scale"].shape[0]
    check_tensors(files, maps, num_layers, field=field)
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
            layers = [tensor_map.read(files, int(order[i]), ours) for i in range(ranges[0].start, ranges[0].stop)]
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
        hf_cfg = llama_config(read_config(hf_dir, field=field))
    except ConfigError as err:
        if err.field == field:
            raise
        raise ConfigError(field, f"{hf_dir}: {err}") from None
    check_architecture(trainer.model_cfg, hf_cfg, field=field, where=f"{INIT_PREFIX}{hf_dir}")
    files = SafetensorsFiles(hf_dir, field=field)
    check_tensors(files, tensor_maps(trainer.abstract_params), hf_cfg.num_layers, field=field)
    return lambda: nnx.to_pure_dict(load_params(files, trainer.abstract_params, trainer.param_shardings,
                                                field=field))


def tensor_dtypes(files: SafetensorsFiles) -> dict[str, str]:
    """HF tensor name -> dtype name, to write an import back in its own dtypes."""
    return {name: files.dtype(name) for name in files.file_of}


# --- writing -----------------------------------------------------------------------------------------

def _numpy_dtype(dtype: str) -> np.dtype:
    if dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def _shard_plan(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
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


def save(out: str | pathlib.Path, cfg: LlamaConfig, params: nnx.State, *, dtype: str | Callable[[str], str],
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
    maps = list(zip(tensor_maps(params), nnx.to_flat_state(params)))
    names = [(tensor_map, tensor_map.hf_tensor(layer)) for tensor_map, (_, variable) in maps
             for layer in (range(variable.shape[0]) if tensor_map.stacked else [None])]
    sizes = {name: math.prod(tensor_map.hf_shape) * _numpy_dtype(dtype_of(name)).itemsize
             for tensor_map, name in names}
    plan = _shard_plan(sizes, max_shard_bytes)
    files = ([SINGLE_FILE] if len(plan) == 1 else
             [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))])
    file_of = {name: file_name for file_name, shard in zip(files, plan) for name in shard}
    last_of = {shard[-1]: file_name for file_name, shard in zip(files, plan)}
    out.mkdir(parents=True, exist_ok=True)
    dtypes = set(map(dtype_of, sizes))
    config = hf_config(cfg, dtype=dtypes.pop() if len(dtypes) == 1 else "float32", base=base_config)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    pending: dict[str, np.ndarray] = {}
    for tensor_map, (_, variable) in maps:
        value = np.asarray(jax.device_get(variable.get_value()))
        for layer in range(value.shape[0]) if tensor_map.stacked else [None]:
            name = tensor_map.hf_tensor(layer)
            hf_value = tensor_map.to_hf(value[layer] if tensor_map.stacked else value)
            pending[name] = np.ascontiguousarray(hf_value.astype(_numpy_dtype(dtype_of(name))))
            if name in last_of:  # its file is complete
                # "format: pt" is what transformers expects of the files it loads.
                save_file(pending, str(out / last_of[name]), metadata={"format": "pt"})
                pending = {}
    if len(files) == 1:
        return [CONFIG_FILE, SINGLE_FILE]
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": file_of}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return [CONFIG_FILE, *files, INDEX_FILE]

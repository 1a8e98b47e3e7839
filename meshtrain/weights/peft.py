"""LoRA adapters as PEFT writes them: ``adapter_config.json`` + ``adapter_model.safetensors``, which
``peft.PeftModel.from_pretrained`` loads onto the transformers base (``convert to-peft``), and read
back to continue training (``train.lora.init_from``).

PEFT stores a ``torch.nn.Linear``'s adapter as ``lora_A.weight`` [rank, in] and ``lora_B.weight``
[out, rank] beside the base's ``weight`` [out, in], under ``base_model.model.`` + the base tensor's
name, scaled by ``lora_alpha / r``. Ours are ``a`` [in..., rank] and ``b`` [rank, out...], so each
maps through the base weight's HF dimensions (their two groups of our logical axes, ``models.api.TensorSpec``)
with the rank as one more axis.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from meshtrain.errors import ConfigError
from meshtrain.fp8_training import nested
from meshtrain.lora import LoraTraining
from meshtrain.weights import hf
from models.api import family_of

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
RANK = "lora_rank"  # the rank's axis name in the adapters' TensorMaps


def adapter_maps(lora: LoraTraining, cfg: Any, abstract_params: nnx.State, *, field: str
                 ) -> dict[str, tuple[hf.TensorMap, hf.TensorMap]]:
    """Per adapted weight (dotted path): the TensorMaps of its ``a`` and ``b`` to PEFT's
    ``lora_A.weight`` and ``lora_B.weight`` (``field`` names a family without HF tensors)."""
    adapter = hf.adapter_of(family_of(cfg), field=field)
    base = {".".join(tensor_map.path): tensor_map for tensor_map in hf.tensor_maps(adapter, cfg, abstract_params)}
    maps = {}
    for name, weight in lora.weights.items():
        tensor_map = base[name]
        inputs, outputs = tensor_map.axes[:weight.inputs], tensor_map.axes[weight.inputs:]
        if tensor_map.per_tensor or len(tensor_map.hf_groups) != 2 or set(tensor_map.hf_groups[1]) != set(inputs):
            raise ConfigError(field, f"{name} is not stored as one linear layer's [out, in] weight in HF "
                              f"({tensor_map.hf_name}), so PEFT has no adapter for it")
        out_group, in_group = tensor_map.hf_groups
        stem = PEFT_PREFIX + tensor_map.hf_name.removesuffix(".weight")
        sizes = {**tensor_map.sizes, RANK: lora.cfg.rank}
        common = dict(sizes=sizes, stacked=tensor_map.stacked, layer_offset=tensor_map.layer_offset,
                      stack_size=tensor_map.stack_size)
        maps[name] = (hf.TensorMap((*tensor_map.path, "a"), f"{stem}.lora_A.weight", ((RANK,), in_group),
                                   (*inputs, RANK), **common),
                      hf.TensorMap((*tensor_map.path, "b"), f"{stem}.lora_B.weight", (out_group, (RANK,)),
                                   (RANK, *outputs), **common))
    return maps


def _module_names(maps: dict[str, tuple[hf.TensorMap, hf.TensorMap]]) -> list[str]:
    """PEFT's ``target_modules``: the adapted linear layers' own names (``q_proj``, ``down_proj``)."""
    return sorted({a.hf_name.removesuffix(".lora_A.weight").rsplit(".", 1)[-1] for a, _ in maps.values()})


def save_adapter(out: pathlib.Path, lora: LoraTraining, cfg: Any, abstract_params: nnx.State, adapters: nnx.State,
                 *, base_model: str | None) -> list[str]:
    """Writes ``adapters`` (in model layer order) as a PEFT adapter directory ``out``; returns the
    files written. ``base_model``: the ``base_model_name_or_path`` recorded (the HF base)."""
    from safetensors.numpy import save_file

    maps = adapter_maps(lora, cfg, abstract_params, field="--run")
    values = {".".join(str(key) for key in path): np.asarray(jax.device_get(variable.get_value()), np.float32)
              for path, variable in nnx.to_flat_state(adapters)}
    tensors = {}
    for name, pair in maps.items():
        for tensor_map, value in zip(pair, (values[f"{name}.a"], values[f"{name}.b"])):
            for layer in range(value.shape[0]) if tensor_map.stacked else [None]:
                tensors[tensor_map.hf_tensor(layer)] = np.ascontiguousarray(
                    tensor_map.to_hf(value[layer] if tensor_map.stacked else value))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
              "r": lora.cfg.rank, "lora_alpha": lora.cfg.alpha, "lora_dropout": lora.cfg.dropout,
              "target_modules": _module_names(maps), "bias": "none", "fan_in_fan_out": False,
              "use_rslora": False, "use_dora": False, "modules_to_save": None, "init_lora_weights": True,
              "inference_mode": True}
    out.mkdir(parents=True, exist_ok=True)
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return [ADAPTER_CONFIG, ADAPTER_WEIGHTS]


class _Tensors:
    """The ``read(name, index)`` that ``hf.TensorMap.read`` asks of safetensors files, over a dict."""

    def __init__(self, tensors: dict[str, np.ndarray]):
        self.tensors = tensors

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        return self.tensors[name][index]


def adapter_loader(adapter_dir: str, lora: LoraTraining, cfg: Any, abstract_params: nnx.State, *,
                   field: str = "train.lora.init_from") -> Callable[[], dict]:
    """For ``train.lora.init_from=DIR``: checks the PEFT adapter's config and tensor shapes against
    ``lora`` (reading no weights beyond the header) and returns the loader of its weights, a nested
    dict like the train state's adapters (model layer order, numpy fp32)."""
    from safetensors import safe_open

    root = pathlib.Path(adapter_dir)
    if not (root / ADAPTER_CONFIG).is_file() or not (root / ADAPTER_WEIGHTS).is_file():
        raise ConfigError(field, f"{adapter_dir} holds no {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}; give a PEFT "
                          "LoRA adapter directory (convert to-peft, or PeftModel.save_pretrained)")
    try:
        config = json.loads((root / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(field, f"{root / ADAPTER_CONFIG} is not readable JSON ({err})") from None
    maps = adapter_maps(lora, cfg, abstract_params, field=field)
    wanted = {"peft_type": "LORA", "r": lora.cfg.rank, "lora_alpha": lora.cfg.alpha, "use_rslora": False,
              "use_dora": False, "fan_in_fan_out": False}
    for key, value in wanted.items():
        if config.get(key, value if key.startswith(("use_", "fan_")) else None) != value:
            raise ConfigError(field, f"{key} is {config.get(key)!r} in {root / ADAPTER_CONFIG}, but this run needs "
                              f"{value!r} (train.lora: rank {lora.cfg.rank}, alpha {lora.cfg.alpha:g})")
    targets = config.get("target_modules")
    if sorted(targets if isinstance(targets, list) else [targets]) != _module_names(maps):
        raise ConfigError(field, f"target_modules {targets!r} in {root / ADAPTER_CONFIG} differ from "
                          f"{_module_names(maps)}, what train.lora.matmuls adapts here")
    try:
        with safe_open(str(root / ADAPTER_WEIGHTS), "numpy") as files:
            shapes = {name: tuple(files.get_slice(name).get_shape()) for name in files.keys()}  # noqa: SIM118
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error types for damaged files
        raise ConfigError(field, f"{root / ADAPTER_WEIGHTS} is unreadable ({err})") from None
    layers = hf.num_layers_of(abstract_params)
    for tensor_map in (m for pair in maps.values() for m in pair):
        for name in tensor_map.hf_tensors(layers):
            if shapes.get(name) != tensor_map.hf_shape:
                raise ConfigError(field, f"{name} has shape {shapes.get(name)} in {root / ADAPTER_WEIGHTS}, "
                                  f"{tensor_map.hf_shape} here")

    def load() -> dict:
        from safetensors.numpy import load_file

        files = _Tensors(load_file(str(root / ADAPTER_WEIGHTS)))
        found = {}
        for name, pair in maps.items():
            for tensor_map, which in zip(pair, ("a", "b")):
                whole = {axis: slice(0, size) for axis, size in tensor_map.sizes.items()}
                per_layer = [tensor_map.read(files, layer, whole).astype(np.float32)
                             for layer in (range(tensor_map.stack_size or layers) if tensor_map.stacked else [None])]
                found[f"{name}.{which}"] = np.stack(per_layer) if tensor_map.stacked else per_layer[0]
        return nnx.to_pure_dict(nested(found))

    return load

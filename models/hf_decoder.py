"""What the Hugging Face adapters of Llama-shaped decoders share (the Llama, MoE and DeepSeek-V3
families): the attention, MLP, norm and global tensors' names and shapes, the experts' tensors, the
rotary-embedding and sliding-window keys, and ``DecoderHF``, the adapter machinery a family's
``HFAdapter`` builds on (checks, common fields, ``config.json`` writing, tensor lookup, overrides).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any

from models.api import LAYERS_KEY, TensorSpec
from models.blocks import RopeScaling, RopeScalingConfig
from models.common import InvalidField

LAYER_TENSORS: dict[tuple[str, ...], TensorSpec] = {
    ("attn_norm", "scale"): TensorSpec("input_layernorm.weight", (("embed",),)),
    ("attention", "query"): TensorSpec("self_attn.q_proj.weight", (("heads", "head_dim"), ("embed",))),
    ("attention", "key"): TensorSpec("self_attn.k_proj.weight", (("kv_heads", "head_dim"), ("embed",))),
    ("attention", "value"): TensorSpec("self_attn.v_proj.weight", (("kv_heads", "head_dim"), ("embed",))),
    ("attention", "out"): TensorSpec("self_attn.o_proj.weight", (("embed",), ("heads", "head_dim"))),
    ("mlp_norm", "scale"): TensorSpec("post_attention_layernorm.weight", (("embed",),)),
    ("mlp", "gate"): TensorSpec("mlp.gate_proj.weight", (("mlp",), ("embed",))),
    ("mlp", "up"): TensorSpec("mlp.up_proj.weight", (("mlp",), ("embed",))),
    ("mlp", "down"): TensorSpec("mlp.down_proj.weight", (("embed",), ("mlp",))),
}
GLOBAL_TENSORS: dict[tuple[str, ...], TensorSpec] = {
    ("embedding",): TensorSpec("model.embed_tokens.weight", (("vocab",), ("embed",))),
    ("final_norm", "scale"): TensorSpec("model.norm.weight", (("embed",),)),
    ("head",): TensorSpec("lm_head.weight", (("vocab",), ("embed",))),
}
# Qwen3's per-head query and key norms (dense and MoE): only in a config with ``qk_norm``.
QK_NORM_TENSORS: dict[tuple[str, ...], TensorSpec] = {
    ("attention", "query_norm", "scale"): TensorSpec("self_attn.q_norm.weight", (("head_dim",),)),
    ("attention", "key_norm", "scale"): TensorSpec("self_attn.k_norm.weight", (("head_dim",),)),
}


def sparse_tensors(block: str, gate: str, up: str, down: str) -> dict[tuple[str, ...], TensorSpec]:
    """The router and the per-expert SwiGLU weights under ``block`` (with their HF names)."""
    experts = f"{block}.experts.{{experts}}"
    into, out_of = (("expert_mlp",), ("expert_embed",)), (("expert_embed",), ("expert_mlp",))
    return {
        ("moe", "router"): TensorSpec(f"{block}.gate.weight", (("expert_logits",), ("embed",))),
        ("moe", "gate"): TensorSpec(f"{experts}.{gate}.weight", into, ("experts",)),
        ("moe", "up"): TensorSpec(f"{experts}.{up}.weight", into, ("experts",)),
        ("moe", "down"): TensorSpec(f"{experts}.{down}.weight", out_of, ("experts",)),
    }


def rope_parameters(config: dict, *, default_theta: float = 10000.0) -> tuple[float, RopeScalingConfig]:
    """rope_theta (``default_theta`` when the config gives none, as transformers' ``default_theta``)
    and the scaling, from the transformers 4 (``rope_theta`` + ``rope_scaling``) or the
    transformers 5 (``rope_parameters``) spelling."""
    key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    rope = config.get(key) or {}
    if not isinstance(rope, dict):
        raise InvalidField(key, f"must be an object or null, got {rope!r}")
    if rope and all(isinstance(value, dict) for value in rope.values()):
        raise InvalidField(key, "per-layer-type rotary parameters are not supported")
    theta = float(config.get("rope_theta") or rope.get("rope_theta") or default_theta)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) != 1.0:
        raise InvalidField("partial_rotary_factor", "partial rotary embeddings are not supported (only 1.0)")
    if kind == "default":
        return theta, RopeScalingConfig()
    if kind == "yarn":
        return theta, _yarn(rope, key, int(config.get("max_position_embeddings") or 2048))
    if kind != "llama3":
        raise InvalidField(f"{key}.rope_type", f"{kind!r} is not supported; supported: none (default), "
                           "'llama3' and 'yarn'")
    try:
        original = rope.get("original_max_position_embeddings") or config["max_position_embeddings"]
        return theta, RopeScalingConfig(
            kind=RopeScaling.LLAMA3, factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]), original_max_len=int(original))
    except KeyError as err:
        raise InvalidField(key, f"llama3 rotary scaling needs {err.args[0]!r}") from None


def _yarn(rope: dict, key: str, max_len: int) -> RopeScalingConfig:
    """The ``RopeScalingConfig`` of a YaRN ``rope_scaling`` / ``rope_parameters`` object, read as
    transformers reads it (``factor`` defaults to max_position_embeddings / the original length)."""
    if rope.get("attention_factor") is not None:
        raise InvalidField(f"{key}.attention_factor", "an explicit attention_factor is not supported (only the "
                           "one YaRN derives from factor, mscale and mscale_all_dim)")
    try:
        original = int(rope.get("original_max_position_embeddings") or max_len)
        number = lambda name, default: float(rope.get(name) or default)
        return RopeScalingConfig(kind=RopeScaling.YARN, factor=number("factor", max_len / original),
                                 original_max_len=original, beta_fast=number("beta_fast", 32),
                                 beta_slow=number("beta_slow", 1), mscale=number("mscale", 0),
                                 mscale_all_dim=number("mscale_all_dim", 0), truncate=bool(rope.get("truncate", True)))
    except (TypeError, ValueError) as err:
        raise InvalidField(key, f"yarn rotary scaling is invalid: {err}") from None


def rope_config(scaling: RopeScalingConfig) -> dict | None:
    """The ``rope_scaling`` object of a ``config.json`` for ``scaling`` (None: no scaling)."""
    if scaling.kind is RopeScaling.LLAMA3:
        return {"rope_type": "llama3", "factor": scaling.factor, "low_freq_factor": scaling.low_freq_factor,
                "high_freq_factor": scaling.high_freq_factor,
                "original_max_position_embeddings": scaling.original_max_len}
    if scaling.kind is RopeScaling.YARN:
        return {"type": "yarn", "rope_type": "yarn", "factor": scaling.factor,
                "original_max_position_embeddings": scaling.original_max_len, "beta_fast": scaling.beta_fast,
                "beta_slow": scaling.beta_slow, "mscale": scaling.mscale, "mscale_all_dim": scaling.mscale_all_dim,
                "truncate": scaling.truncate}
    return None


def sliding_window(config: dict) -> int:
    """The sliding window every layer uses (0: none) from a ``config.json``: ``sliding_window``
    unless ``use_sliding_window`` is false (Qwen); per-layer windows (``layer_types`` or
    ``max_window_layers`` mixing windowed and full layers) are refused."""
    window = config.get("sliding_window")
    if window is None or config.get("use_sliding_window") is False:
        return 0
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise InvalidField("sliding_window", f"must be a positive integer or null, got {window!r}")
    layers = config.get("num_hidden_layers")
    kinds = set(config.get("layer_types") or ())
    if len(kinds) > 1:
        raise InvalidField("layer_types", f"mixes {sorted(kinds)}; only one attention kind for every layer "
                           "is supported")
    if kinds == {"full_attention"}:
        return 0
    if not kinds and isinstance(config.get("max_window_layers"), int) and isinstance(layers, int):
        # Qwen: layers from index max_window_layers on use the window.
        if config["max_window_layers"] >= layers:
            return 0
        if config["max_window_layers"] > 0:
            raise InvalidField("max_window_layers", f"is {config['max_window_layers']} of {layers} layers: "
                               "windowed and full layers mixed are not supported")
    return window


class DecoderHF:
    """The ``models.api.HFAdapter`` machinery every Llama-shaped decoder family shares; a family's
    adapter subclasses it with its ``model_types``, ``architecture_fields``, ``config_from_hf`` and
    ``hf_config``."""

    def check_decoder(self, config: dict, sizes: tuple[str, ...]) -> None:
        """InvalidField naming the first ``config.json`` key of a Llama-shaped decoder that meshtrain
        does not implement, or that is missing (the common sizes and ``sizes``)."""
        architectures = config.get("architectures") or []
        if not isinstance(architectures, list):
            raise InvalidField("architectures", f"must be a list of class names, got {architectures!r}")
        unsupported = [name for name in architectures if not name.endswith("ForCausalLM")]
        if unsupported:
            raise InvalidField("architectures", f"{unsupported} is not supported; only *ForCausalLM "
                               "checkpoints (with an lm_head) are")
        for key in ("attention_bias", "mlp_bias"):
            if config.get(key):
                raise InvalidField(key, "is true; meshtrain's Llama has no biases (only false is supported)")
        if config.get("hidden_act", "silu") != "silu":
            raise InvalidField("hidden_act", f"{config['hidden_act']!r} is not supported (only 'silu')")
        if config.get("quantization_config"):
            raise InvalidField("quantization_config", "quantized checkpoints are not supported")
        missing = [key for key in ("vocab_size", "hidden_size", *sizes, "num_hidden_layers",
                                   "num_attention_heads") if not isinstance(config.get(key), int)]
        if missing:
            raise InvalidField(missing[0], "is missing or not an integer")

    def decoder_fields(self, config: dict, seq_len: int | None, *, default_theta: float = 10000.0,
                       default_norm_eps: float = 1e-6) -> dict[str, Any]:
        """The config fields of a checked (``check_decoder``) ``config.json`` that every Llama-shaped
        decoder has: sizes, attention heads, rotary embedding, norms, embedding tying, seq_len. The
        defaults are what the architecture's transformers config assumes when a key is left out."""
        theta, scaling = rope_parameters(config, default_theta=default_theta)
        heads = config["num_attention_heads"]
        max_len = int(config.get("max_position_embeddings") or 2048)
        return {
            "vocab_size": config["vocab_size"], "embed_dim": config["hidden_size"],
            "num_layers": config["num_hidden_layers"], "num_heads": heads,
            "num_kv_heads": config.get("num_key_value_heads") or heads,
            "head_dim": config.get("head_dim") or config["hidden_size"] // heads,
            "seq_len": seq_len or min(max_len, 2048), "rope_theta": theta, "rope_scaling": scaling,
            "norm_eps": float(config.get("rms_norm_eps", default_norm_eps)),
            "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
            "sliding_window": sliding_window(config)}

    def decoder_config(self, cfg: Any, *, dtype: str, base: dict | None, architecture: str, model_type: str,
                       **fields: Any) -> dict:
        """The ``config.json`` of a Llama-shaped ``cfg`` as ``architecture`` / ``model_type``, with that
        architecture's own ``fields``; ``base``'s token ids, max_position_embeddings and
        initializer_range are kept."""
        config = {key: value for key, value in (base or {}).items()
                  if key in ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings",
                             "initializer_range")}
        rope_scaling = rope_config(cfg.rope_scaling)
        config.update({
            "architectures": [architecture], "model_type": model_type,
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.embed_dim, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_theta, "rope_scaling": rope_scaling,
            "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False,
            "sliding_window": cfg.sliding_window or None, **fields,
            "attention_dropout": 0.0, "torch_dtype": dtype, "dtype": dtype,  # transformers 4 and 5 spellings
        })
        original = cfg.rope_scaling.original_max_len if rope_scaling else 0
        config.setdefault("max_position_embeddings", max(cfg.seq_len, original))
        return config

    def layer_tensors(self, cfg: Any) -> dict[tuple[str, ...], TensorSpec]:
        """The HF tensor of each per-layer parameter (path within a layer; names within
        ``model.layers.L``) in a checkpoint of ``cfg``: with the per-head q_norm/k_norm when ``qk_norm``."""
        # getattr: a family's config may have no qk_norm.
        return {**LAYER_TENSORS, **QK_NORM_TENSORS} if getattr(cfg, "qk_norm", False) else LAYER_TENSORS

    def tensor(self, cfg: Any, path: tuple[str, ...]) -> TensorSpec:
        if path[0] == LAYERS_KEY:
            spec = self.layer_tensors(cfg)[path[1:]]
            return TensorSpec(f"model.layers.{{layer}}.{spec.name}", spec.groups, spec.per_tensor)
        return GLOBAL_TENSORS[path]

    def unused_ok(self, name: str) -> bool:
        # Rotary buffers some older exports carry, and lm_head.weight beside a tied embedding.
        return name.endswith("rotary_emb.inv_freq") or name == "lm_head.weight"

    def config_for_weights(self, config: dict, tensor_names: Collection[str]) -> tuple[dict, str | None]:
        return config, None  # every tensor a Llama config.json describes is one its weights must hold

    def overrides(self, name: str, value: Any, ours: Any) -> list[str]:
        if isinstance(value, RopeScalingConfig):
            shown = lambda v: v.value if isinstance(v, RopeScaling) else str(v).lower() if isinstance(v, bool) else v
            return [f"model.rope_scaling.{field.name}={shown(getattr(value, field.name))}"
                    for field in dataclasses.fields(value) if getattr(value, field.name) != getattr(ours, field.name)]
        return [f"model.{name}={str(value).lower() if isinstance(value, bool) else value}"]

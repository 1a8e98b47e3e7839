"""Hugging Face DeepSeek-V3 checkpoints (``DeepseekV3ForCausalLM``, ``model_type: deepseek_v3``) <-> ``DeepSeekConfig``.

HF numbers the decoder layers 0..num_hidden_layers-1 (the first ``first_k_dense_replace`` dense) and
stores the multi-token prediction modules after them, as layers num_hidden_layers.. (DeepSeek's own
numbering). ``L`` = HF layer; ``nn.Linear`` weights are ``[out_features, in_features]``::

    model.layers.L.input_layernorm / post_attention_layernorm.weight  -> attn_norm / mlp_norm.scale
    model.layers.L.self_attn.q_a_proj.weight [q_lora, embed]          -> attention.query_down
    model.layers.L.self_attn.q_a_layernorm.weight [q_lora]            -> attention.query_norm.scale
    model.layers.L.self_attn.q_b_proj.weight [heads*(nope+rope), q_lora] -> attention.query_up
    model.layers.L.self_attn.q_proj.weight [heads*(nope+rope), embed] -> attention.query (q_lora_rank 0)
    model.layers.L.self_attn.kv_a_proj_with_mqa.weight [kv_lora+rope, embed] -> attention.latent_down
    model.layers.L.self_attn.kv_a_layernorm.weight [kv_lora]          -> attention.latent_norm.scale
    model.layers.L.self_attn.kv_b_proj.weight [heads*(nope+v), kv_lora] -> attention.latent_up
    model.layers.L.self_attn.o_proj.weight [embed, heads*v]           -> attention.out
    model.layers.L.mlp.{gate,up,down}_proj.weight                     -> dense_layers.mlp.* (L < k)
    model.layers.L.mlp.gate.weight [experts, embed]                   -> layers.moe.router
    model.layers.L.mlp.gate.e_score_correction_bias [experts]         -> layers.moe.routing_bias
    model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight           -> layers.moe.gate/up/down [E]
    model.layers.L.mlp.shared_experts.{gate,up,down}_proj.weight      -> layers.shared.*
    model.layers.M.enorm / hnorm.weight, eh_proj.weight [embed, 2*embed] -> mtp.* (M >= num_hidden_layers)
    model.layers.M.shared_head.norm.weight                            -> mtp.head_norm.scale

The MTP modules' copies of the embedding and the output head (``model.layers.M.embed_tokens``,
``shared_head.head``) are the model's own: read as duplicates, not written. A ``config.json`` that asks
for MTP modules of which the weights hold no tensor (what transformers' ``save_pretrained`` writes) is
imported without them (``DeepSeekHF.config_for_weights``). The correction bias is
the routing bias of auxiliary-loss-free balancing, so an import keeps it learning
(``bias_update_rate`` 0.001, DeepSeek-V3's rate). The sequence-wise balance loss's weight is
``aux_loss_alpha`` (0 when absent, as in transformers' configs, whose loss has none). Rotary pairs
are interleaved in DeepSeek's weights (``rope_interleave``), which the model reads as such. YaRN
rotary scaling maps to ``rope_scaling.kind: yarn``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection

from models.api import LAYERS_KEY, TensorSpec
from models.common import InvalidField
from models.deepseek.model import DENSE_LAYERS, DeepSeekConfig
from models.hf_decoder import GLOBAL_TENSORS, LAYER_TENSORS, DecoderHF, rope_parameters, sparse_tensors
from models.experts import Dispatch, RouterScore

_NORMS = {path: spec for path, spec in LAYER_TENSORS.items() if path[-1] == "scale"}
_DENSE_MLP = {path: spec for path, spec in LAYER_TENSORS.items() if path[0] == "mlp"}
_ATTENTION = {
    ("attention", "query_down"): TensorSpec("self_attn.q_a_proj.weight", (("latent",), ("embed",))),
    ("attention", "query_norm", "scale"): TensorSpec("self_attn.q_a_layernorm.weight", (("latent",),)),
    ("attention", "query_up"): TensorSpec("self_attn.q_b_proj.weight", (("heads", "head_dim"), ("latent_in",))),
    ("attention", "query"): TensorSpec("self_attn.q_proj.weight", (("heads", "head_dim"), ("embed",))),
    ("attention", "latent_down"): TensorSpec("self_attn.kv_a_proj_with_mqa.weight", (("latent",), ("embed",))),
    ("attention", "latent_norm", "scale"): TensorSpec("self_attn.kv_a_layernorm.weight", (("latent",),)),
    ("attention", "latent_up"): TensorSpec("self_attn.kv_b_proj.weight", (("heads", "head_dim"), ("latent_in",))),
    ("attention", "out"): TensorSpec("self_attn.o_proj.weight", (("embed",), ("heads", "head_dim"))),
}
_SPARSE = {
    **sparse_tensors("mlp", "gate_proj", "up_proj", "down_proj"),
    ("moe", "routing_bias"): TensorSpec("mlp.gate.e_score_correction_bias", (("expert_logits",),)),
    ("shared", "gate"): TensorSpec("mlp.shared_experts.gate_proj.weight", (("mlp",), ("embed",))),
    ("shared", "up"): TensorSpec("mlp.shared_experts.up_proj.weight", (("mlp",), ("embed",))),
    ("shared", "down"): TensorSpec("mlp.shared_experts.down_proj.weight", (("embed",), ("mlp",))),
}
_MTP = {
    ("embed_norm", "scale"): TensorSpec("enorm.weight", (("embed",),)),
    ("hidden_norm", "scale"): TensorSpec("hnorm.weight", (("embed",),)),
    ("project",): TensorSpec("eh_proj.weight", (("embed",), ("mtp_inputs", "mtp_embed"))),
    ("head_norm", "scale"): TensorSpec("shared_head.norm.weight", (("embed",),)),
}
# A layer's tensors, within ``model.layers.L``.
_DENSE_LAYER = {**_NORMS, **_ATTENTION, **_DENSE_MLP}
_SPARSE_LAYER = {**_NORMS, **_ATTENTION, **_SPARSE}
# Copies of the embedding and head an MTP module carries in DeepSeek's checkpoints.
_MTP_DUPLICATES = re.compile(r"model\.layers\.\d+\.(embed_tokens|shared_head\.head)\.weight")
_ROUTING_KEYS = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}
# transformers' DeepseekV3Config defaults of the routing keys a config.json may leave out.
_ROUTING_DEFAULTS = {"n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True}
# config.json's number of multi-token prediction modules (transformers' DeepseekV3Config: its alias first).
_MTP_KEYS = ("num_nextn_predict_layers", "num_mtp_layers")


class DeepSeekHF(DecoderHF):
    """The ``models.api.HFAdapter`` of the DeepSeek-V3 family."""

    model_types = ("deepseek_v3",)
    architecture_fields = ("vocab_size", "embed_dim", "num_layers", "num_dense_layers", "num_heads", "q_lora_rank",
                           "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mlp_dim",
                           "num_experts", "top_k", "expert_mlp_dim", "num_shared_experts", "expert_groups",
                           "groups_per_token", "routed_scaling_factor", "norm_topk_prob",
                           "mtp_layers", "rope_theta", "rope_scaling", "rope_interleave", "norm_eps",
                           "tie_embeddings")

    def config_from_hf(self, config: dict, *, seq_len: int | None = None) -> DeepSeekConfig:
        """The ``DeepSeekConfig`` of a ``deepseek_v3`` ``config.json`` (sorted dropless dispatch, one
        routing group per row): its values as written, transformers' defaults for absent routing keys
        (``_ROUTING_DEFAULTS``). ``seq_len`` defaults to ``min(max_position_embeddings, 2048)``.

        Raises:
          InvalidField: naming the ``config.json`` key of an option this family does not implement.
        """
        sizes = ("intermediate_size", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok",
                 "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        self.check_decoder(config, sizes)
        for key, value in _ROUTING_KEYS.items():
            if config.get(key, value) != value:
                raise InvalidField(key, f"is {config[key]!r}; only {value!r} (DeepSeek-V3's) is supported")
        heads = config["num_attention_heads"]
        if config.get("num_key_value_heads", heads) not in (heads, None):
            raise InvalidField("num_key_value_heads", f"must equal num_attention_heads={heads} (latent attention "
                               f"expands keys and values per head), got {config['num_key_value_heads']}")
        theta, scaling = rope_parameters(config)
        dense = config.get("first_k_dense_replace") or 0
        total = config["num_hidden_layers"]
        if not 0 <= dense < total:
            raise InvalidField("first_k_dense_replace", f"must be between 0 and num_hidden_layers - 1 = {total - 1}, "
                               f"got {dense}")
        groups, groups_per_token, scaling_factor = _routing_groups(config)
        mtp = config.get(_MTP_KEYS[0], config.get(_MTP_KEYS[1])) or 0
        json_key = {"vocab_size": "vocab_size", "embed_dim": "hidden_size", "num_layers": "num_hidden_layers",
                    "num_heads": "num_attention_heads", "mlp_dim": "intermediate_size",
                    "num_experts": "n_routed_experts", "top_k": "num_experts_per_tok",
                    "expert_mlp_dim": "moe_intermediate_size", "num_shared_experts": "n_shared_experts",
                    "expert_groups": "n_group", "groups_per_token": "topk_group",
                    "mtp_layers": "num_nextn_predict_layers", "num_dense_layers": "first_k_dense_replace"}
        max_len = int(config.get("max_position_embeddings") or 2048)
        try:
            return DeepSeekConfig(
                vocab_size=config["vocab_size"], embed_dim=config["hidden_size"], num_layers=total - dense,
                num_dense_layers=dense, num_heads=heads, q_lora_rank=config.get("q_lora_rank") or 0,
                kv_lora_rank=config["kv_lora_rank"], qk_nope_head_dim=config["qk_nope_head_dim"],
                qk_rope_head_dim=config["qk_rope_head_dim"], v_head_dim=config["v_head_dim"],
                mlp_dim=config["intermediate_size"], num_experts=config["n_routed_experts"],
                top_k=config["num_experts_per_tok"], expert_mlp_dim=config["moe_intermediate_size"],
                num_shared_experts=config.get("n_shared_experts") or 0, expert_groups=groups,
                groups_per_token=groups_per_token, routed_scaling_factor=scaling_factor,
                norm_topk_prob=bool(config.get("norm_topk_prob", _ROUTING_DEFAULTS["norm_topk_prob"])),
                router_score=RouterScore.SIGMOID,
                bias_update_rate=0.001, dispatch=Dispatch.DROPLESS, group_size=0, mtp_layers=mtp,
                load_balancing_coef=float(config.get("aux_loss_alpha") or 0.0) if config.get("seq_aux", True) else 0.0,
                seq_len=seq_len or min(max_len, 2048), rope_theta=theta, rope_scaling=scaling,
                rope_interleave=bool(config.get("rope_interleave", True)),
                norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                tie_embeddings=bool(config.get("tie_word_embeddings", False)))
        except InvalidField as err:
            raise InvalidField(json_key.get(err.field, err.field), err.message) from None

    def hf_config(self, cfg: DeepSeekConfig, *, dtype: str, base: dict | None = None) -> dict:
        """A ``config.json`` for ``cfg`` (``DeepseekV3ForCausalLM``); ``base``'s token ids and
        max_position_embeddings are kept.

        Raises:
          InvalidField: naming the model field that DeepseekV3ForCausalLM cannot express.
        """
        if cfg.router_score is not RouterScore.SIGMOID:
            raise InvalidField("router_score", f"is {cfg.router_score.value}; DeepseekV3ForCausalLM scores experts "
                               "by sigmoid (only sigmoid can be written)")
        if cfg.bias_update_rate == 0:
            raise InvalidField("bias_update_rate", "is 0, so the model has no routing bias; DeepseekV3ForCausalLM "
                               "always has one (e_score_correction_bias): set a rate > 0")
        if not cfg.num_shared_experts:
            raise InvalidField("num_shared_experts", "is 0; DeepseekV3ForCausalLM always has shared experts")
        config = self.decoder_config(
            cfg, dtype=dtype, base=base, architecture="DeepseekV3ForCausalLM", model_type="deepseek_v3",
            num_hidden_layers=cfg.num_dense_layers + cfg.num_layers, num_key_value_heads=cfg.num_heads,
            head_dim=cfg.qk_rope_head_dim, intermediate_size=cfg.mlp_dim, moe_intermediate_size=cfg.expert_mlp_dim,
            n_routed_experts=cfg.num_experts, n_shared_experts=cfg.num_shared_experts,
            num_experts_per_tok=cfg.top_k, n_group=cfg.expert_groups, topk_group=cfg.groups_per_token,
            routed_scaling_factor=cfg.routed_scaling_factor, norm_topk_prob=cfg.norm_topk_prob,
            first_k_dense_replace=cfg.num_dense_layers, q_lora_rank=cfg.q_lora_rank or None,
            kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
            qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, rope_interleave=cfg.rope_interleave,
            num_nextn_predict_layers=cfg.mtp_layers, scoring_func="sigmoid", topk_method="noaux_tc",
            aux_loss_alpha=cfg.load_balancing_coef, seq_aux=True,
            sliding_window=None)
        return config

    def tensor(self, cfg: DeepSeekConfig, path: tuple[str, ...]) -> TensorSpec:
        if path[0] in (LAYERS_KEY, DENSE_LAYERS, "mtp"):
            table, offset = {LAYERS_KEY: (_SPARSE_LAYER, cfg.num_dense_layers),
                             DENSE_LAYERS: (_DENSE_LAYER, 0),
                             "mtp": ({**_MTP, **{("layer", *key): spec for key, spec in _SPARSE_LAYER.items()}},
                                     cfg.num_dense_layers + cfg.num_layers)}[path[0]]
            spec = table[path[1:]]
            return TensorSpec(f"model.layers.{{layer}}.{spec.name}", spec.groups, spec.per_tensor, offset)
        return GLOBAL_TENSORS[path]

    def unused_ok(self, name: str) -> bool:
        return super().unused_ok(name) or bool(_MTP_DUPLICATES.fullmatch(name))

    def config_for_weights(self, config: dict, tensor_names: Collection[str]) -> tuple[dict, str | None]:
        """``config`` as the weights (``tensor_names``) are, and a note when that is not as written: a
        ``config.json`` asking for multi-token prediction modules of which the weights hold no tensor
        at all (transformers' DeepseekV3Config asks for one by default, and its ``save_pretrained``
        writes none) is read without them. A partial set stays as written, for the import to name the
        missing tensor."""
        depths = config.get(_MTP_KEYS[0], config.get(_MTP_KEYS[1]))
        layers = config.get("num_hidden_layers")
        if not (_is_int(depths) and depths > 0 and _is_int(layers)):
            return config, None
        prefixes = tuple(f"model.layers.{layers + depth}." for depth in range(depths))
        if any(name.startswith(prefixes) for name in tensor_names):
            return config, None
        key = next(key for key in _MTP_KEYS if key in config)
        return {**config, key: 0}, (f"config.json asks for {depths} multi-token prediction module(s) ({key}), but "
                                    f"the weights hold none of their tensors (model.layers.{layers}.* and after, "
                                    "which transformers' save_pretrained does not write); importing the model "
                                    "without them (model.mtp_layers: 0)")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _routing_groups(config: dict) -> tuple[int, int, float]:
    """``(n_group, topk_group, routed_scaling_factor)`` as ``config.json`` writes them (transformers'
    defaults for absent keys).

    Raises:
      InvalidField: naming the key whose value DeepSeek-V3's routing cannot take.
    """
    groups, per_token, factor = (config.get(key, _ROUTING_DEFAULTS[key])
                                 for key in ("n_group", "topk_group", "routed_scaling_factor"))
    if not (_is_int(groups) and groups >= 1):
        raise InvalidField("n_group", f"must be an integer >= 1 (the groups n_routed_experts is split into), "
                           f"got {groups!r}")
    if not (_is_int(per_token) and 1 <= per_token <= groups):
        raise InvalidField("topk_group", f"must be an integer between 1 and n_group={groups} (the groups a "
                           f"token's experts come from), got {per_token!r}")
    if not (isinstance(factor, (int, float)) and not isinstance(factor, bool) and math.isfinite(factor)
            and factor > 0):
        raise InvalidField("routed_scaling_factor", f"must be a finite number > 0 (the routed experts' output "
                           f"scale), got {factor!r}")
    return groups, per_token, float(factor)

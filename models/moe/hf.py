"""Hugging Face mixture-of-experts checkpoints (``MixtralForCausalLM``, ``Qwen3MoeForCausalLM``) <-> ``MoEConfig``.

Attention, norms, embedding and head are stored as Llama's (``models/hf_decoder.py``). The sparse
block (``L`` = layer, ``E`` = expert; HF ``nn.Linear`` weights are ``[out_features, in_features]``),
Mixtral's names first, then Qwen3-MoE's::

    model.layers.L.block_sparse_moe.gate.weight | model.layers.L.mlp.gate.weight
        [experts, embed] -> layers.moe.router [L, embed, expert_logits]
    model.layers.L.block_sparse_moe.experts.E.w1.weight | model.layers.L.mlp.experts.E.gate_proj.weight
        [expert_mlp, embed] -> layers.moe.gate [L, E, expert_embed, expert_mlp]
    model.layers.L.block_sparse_moe.experts.E.w3.weight | model.layers.L.mlp.experts.E.up_proj.weight
        [expert_mlp, embed] -> layers.moe.up [L, E, expert_embed, expert_mlp]
    model.layers.L.block_sparse_moe.experts.E.w2.weight | model.layers.L.mlp.experts.E.down_proj.weight
        [embed, expert_mlp] -> layers.moe.down [L, E, expert_mlp, expert_embed]
    model.layers.L.self_attn.q_norm.weight / k_norm.weight   (Qwen3-MoE only)
        [head_dim] -> layers.attention.query_norm.scale / key_norm.scale [L, head_dim]

Each expert is its own HF tensor (``TensorSpec.per_tensor``), so a device reads only the experts
it holds. Whether a config has the per-head norm tensors follows from ``qk_norm``: Qwen3-MoE has
them, Mixtral has not. Imports route dropless (``Dispatch.DROPLESS``, one group per row), as transformers
does, so that the logits are transformers'.

``router_aux_loss_coef`` weighs transformers' load-balancing loss pooled over all layers (about the
mean of the per-layer losses), while ``MoEConfig.load_balancing_coef`` weighs the sum of the
per-layer losses: an import divides by ``num_hidden_layers``, an export multiplies.
"""

from __future__ import annotations

import dataclasses

from models.api import LAYERS_KEY, TensorSpec
from models.common import InvalidField
from models.hf_decoder import LAYER_TENSORS, QK_NORM_TENSORS, DecoderHF, sparse_tensors
from models.experts import Dispatch, RouterScore
from models.moe.model import MoEConfig

_ATTENTION_TENSORS = {path: spec for path, spec in LAYER_TENSORS.items() if path[0] != "mlp"}


_MIXTRAL_TENSORS = {**_ATTENTION_TENSORS, **sparse_tensors("block_sparse_moe", "w1", "w3", "w2")}
_QWEN3_TENSORS = {**_ATTENTION_TENSORS, **QK_NORM_TENSORS,
                  **sparse_tensors("mlp", "gate_proj", "up_proj", "down_proj")}


@dataclasses.dataclass(frozen=True)
class _Architecture:
    """What differs between the two HF architectures in ``config.json``."""

    name: str
    model_type: str
    experts_keys: tuple[str, ...]  # the spellings of the expert count, the preferred first
    expert_mlp_key: str
    default_theta: float  # transformers' default_theta and rms_norm_eps of the architecture
    default_norm_eps: float


_MIXTRAL = _Architecture("MixtralForCausalLM", "mixtral", ("num_local_experts", "num_experts"), "intermediate_size",
                         default_theta=1e6, default_norm_eps=1e-5)
# Hub configs spell the count num_experts, transformers 5 writes num_local_experts (an alias).
_QWEN3 = _Architecture("Qwen3MoeForCausalLM", "qwen3_moe", ("num_experts", "num_local_experts"),
                       "moe_intermediate_size", default_theta=10000.0, default_norm_eps=1e-6)
# Shared experts (Qwen2-MoE, DeepSeek): weights no parameter here takes.
_SHARED_EXPERT_KEYS = ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts")


class MoEHF(DecoderHF):
    """The ``models.api.HFAdapter`` of the MoE family."""

    model_types = (_MIXTRAL.model_type, _QWEN3.model_type)
    architecture_fields = ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                           "num_experts", "top_k", "expert_mlp_dim", "shared_mlp_dim", "norm_topk_prob", "qk_norm",
                           "rope_theta", "rope_scaling", "norm_eps", "tie_embeddings", "sliding_window")

    def config_from_hf(self, config: dict, *, seq_len: int | None = None) -> MoEConfig:
        """The ``MoEConfig`` of a Mixtral or Qwen3-MoE ``config.json`` (dropless routing, one group per
        row). ``seq_len`` defaults to ``min(max_position_embeddings, 2048)``.

        Raises:
          InvalidField: naming the ``config.json`` key of an option the MoE family does not implement.
        """
        arch = _QWEN3 if config.get("model_type") == _QWEN3.model_type else _MIXTRAL
        experts_key = next((key for key in arch.experts_keys if key in config), arch.experts_keys[0])
        self.check_decoder(config, (experts_key, "num_experts_per_tok", arch.expert_mlp_key))
        _check_sparse_layers(config)
        fields = self.decoder_fields(config, seq_len, default_theta=arch.default_theta,
                                     default_norm_eps=arch.default_norm_eps)
        coef = float(config.get("router_aux_loss_coef", 0.001)) / config["num_hidden_layers"]
        qwen3 = arch is _QWEN3
        json_key = {"num_experts": experts_key, "top_k": "num_experts_per_tok", "expert_mlp_dim": arch.expert_mlp_key,
                    "load_balancing_coef": "router_aux_loss_coef", "vocab_size": "vocab_size",
                    "embed_dim": "hidden_size", "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
                    "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim"}
        try:
            return MoEConfig(num_experts=config[experts_key], top_k=config["num_experts_per_tok"],
                             expert_mlp_dim=config[arch.expert_mlp_key], shared_mlp_dim=0,
                             norm_topk_prob=bool(config.get("norm_topk_prob", False)) if qwen3 else True,
                             qk_norm=qwen3, dispatch=Dispatch.DROPLESS, group_size=0, load_balancing_coef=coef,
                             z_loss_coef=0.0, **fields)
        except InvalidField as err:  # named by its config.json key
            raise InvalidField(json_key.get(err.field, err.field), err.message) from None

    def hf_config(self, cfg: MoEConfig, *, dtype: str, base: dict | None = None) -> dict:
        """A ``config.json`` for ``cfg``: ``Qwen3MoeForCausalLM`` when ``qk_norm``, else ``MixtralForCausalLM``.
        Fields of ``base`` that do not describe the architecture are kept (see ``DecoderHF.decoder_config``).

        Raises:
          InvalidField: naming the model field that neither architecture can express.
        """
        if cfg.shared_mlp_dim:
            raise InvalidField("shared_mlp_dim", f"is {cfg.shared_mlp_dim}; neither MixtralForCausalLM nor "
                               "Qwen3MoeForCausalLM has shared experts (only 0 can be written as Hugging Face)")
        if cfg.bias_update_rate:
            raise InvalidField("bias_update_rate", f"is {cfg.bias_update_rate}; neither MixtralForCausalLM nor "
                               "Qwen3MoeForCausalLM has a routing bias (only 0 can be written as Hugging Face)")
        if cfg.expert_groups > 1 or cfg.routed_scaling_factor != 1.0:
            field = "expert_groups" if cfg.expert_groups > 1 else "routed_scaling_factor"
            raise InvalidField(field, f"is {getattr(cfg, field)}; MixtralForCausalLM and Qwen3MoeForCausalLM have no "
                               "group-limited routing or gate scaling (only expert_groups 1 and "
                               "routed_scaling_factor 1.0 can be written; the deepseek family has both)")
        if cfg.router_score is not RouterScore.SOFTMAX:
            raise InvalidField("router_score", f"is {cfg.router_score.value}; MixtralForCausalLM and "
                               "Qwen3MoeForCausalLM score experts by softmax (only softmax can be written)")
        if not (cfg.qk_norm or cfg.norm_topk_prob):
            raise InvalidField("norm_topk_prob", "is false, which MixtralForCausalLM cannot express (it always "
                               "renormalises the top-k weights); Qwen3MoeForCausalLM can, but needs qk_norm: true")
        base = base or {}
        coef = cfg.load_balancing_coef * cfg.num_layers
        if base.get("router_aux_loss_coef") is not None and (
                float(base["router_aux_loss_coef"]) / cfg.num_layers == cfg.load_balancing_coef):
            coef = base["router_aux_loss_coef"]  # the import's own spelling of it
        sparse = {"num_experts_per_tok": cfg.top_k, "router_aux_loss_coef": coef}
        if cfg.qk_norm:
            return self.decoder_config(
                cfg, dtype=dtype, base=base, architecture=_QWEN3.name, model_type=_QWEN3.model_type,
                num_experts=cfg.num_experts, moe_intermediate_size=cfg.expert_mlp_dim,
                # The dense MLP's size, which only mlp_only_layers (none here) use.
                intermediate_size=base.get("intermediate_size", cfg.expert_mlp_dim),
                norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[],
                use_sliding_window=bool(cfg.sliding_window), max_window_layers=0, **sparse)
        return self.decoder_config(cfg, dtype=dtype, base=base, architecture=_MIXTRAL.name,
                                   model_type=_MIXTRAL.model_type, num_local_experts=cfg.num_experts,
                                   intermediate_size=cfg.expert_mlp_dim, router_jitter_noise=0.0, **sparse)

    def layer_tensors(self, cfg: MoEConfig) -> dict[tuple[str, ...], TensorSpec]:
        return _QWEN3_TENSORS if cfg.qk_norm else _MIXTRAL_TENSORS

    def tensor(self, cfg: MoEConfig, path: tuple[str, ...]) -> TensorSpec:
        if path[:2] == (LAYERS_KEY, "shared"):
            raise InvalidField("shared_mlp_dim", f"is {cfg.shared_mlp_dim}; shared experts have no Hugging Face "
                               "tensors in MixtralForCausalLM or Qwen3MoeForCausalLM (only 0 is supported)")
        return super().tensor(cfg, path)


def _check_sparse_layers(config: dict) -> None:
    """InvalidField naming the ``config.json`` key of a sparse-block option that is not implemented:
    dense layers among the sparse ones (Qwen3-MoE), shared experts, router jitter."""
    if config.get("mlp_only_layers"):
        raise InvalidField("mlp_only_layers", f"is {config['mlp_only_layers']}; dense MLP layers between the "
                           "sparse ones are not supported (only [] or null)")
    if config.get("decoder_sparse_step", 1) != 1:
        raise InvalidField("decoder_sparse_step", f"is {config['decoder_sparse_step']}; every layer must be "
                           "sparse (only 1 is supported)")
    for key in _SHARED_EXPERT_KEYS:
        if config.get(key):
            raise InvalidField(key, f"is {config[key]}; shared experts are not mapped from Hugging Face "
                               "checkpoints (only 0 or absent is supported)")
    if config.get("router_jitter_noise"):
        raise InvalidField("router_jitter_noise", f"is {config['router_jitter_noise']}; the router has no "
                           "jitter noise (only 0 is supported)")

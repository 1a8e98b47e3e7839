"""The DeepSeek-V3 family (multi-head latent attention, shared and group-routed experts, multi-token
prediction): the model, its Hugging Face adapter, its registry entry."""

from models.api import AxisRole, ModelFamily, register
from models.blocks import BLOCK_AXIS_ROLES
from models.deepseek.hf import DeepSeekHF
from models.deepseek.model import (CHECKPOINT_NAMES, DENSE_LAYERS, MTP_LAYERS, DeepSeek, DeepSeekConfig,
                                   activation_bytes, flops_per_token, key_value_width, recompute_flops_per_token)
from models.experts import EXPERT_ALERTS, EXPERT_AXIS_ROLES, exchange_bytes

FAMILY = register(ModelFamily(
    name="deepseek", config_class=DeepSeekConfig, model_class=DeepSeek,
    axis_roles={**BLOCK_AXIS_ROLES, **EXPERT_AXIS_ROLES, "latent": AxisRole.REPLICATED,
                "latent_in": AxisRole.PARAM_SHARDED, DENSE_LAYERS: AxisRole.STACKED, MTP_LAYERS: AxisRole.STACKED,
                "mtp_inputs": AxisRole.REPLICATED, "mtp_embed": AxisRole.REPLICATED},
    flops_per_token=flops_per_token, recompute_flops_per_token=recompute_flops_per_token,
    activation_bytes=activation_bytes, hf=DeepSeekHF(), exchange_bytes=exchange_bytes, alerts=EXPERT_ALERTS,
    key_value_width=key_value_width))

__all__ = ["CHECKPOINT_NAMES", "FAMILY", "DeepSeek", "DeepSeekConfig"]

"""The mixture-of-experts family (Mixtral, Qwen3-MoE): the model, its Hugging Face adapter, its registry entry."""

from models.api import ModelFamily, register
from models.blocks import BLOCK_AXIS_ROLES, key_value_width
from models.experts import EXPERT_ALERTS, EXPERT_AXIS_ROLES, Dispatch, exchange_bytes
from models.moe.hf import MoEHF
from models.moe.model import (CHECKPOINT_NAMES, MoE, MoEConfig, activation_bytes, flops_per_token,
                              recompute_flops_per_token)

FAMILY = register(ModelFamily(
    name="moe", config_class=MoEConfig, model_class=MoE,
    axis_roles={**BLOCK_AXIS_ROLES, **EXPERT_AXIS_ROLES},
    flops_per_token=flops_per_token, recompute_flops_per_token=recompute_flops_per_token,
    activation_bytes=activation_bytes, hf=MoEHF(), exchange_bytes=exchange_bytes, key_value_width=key_value_width,
    alerts=EXPERT_ALERTS))

__all__ = ["CHECKPOINT_NAMES", "FAMILY", "Dispatch", "MoE", "MoEConfig"]

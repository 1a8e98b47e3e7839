"""The mixture-of-experts family (Mixtral, Qwen3-MoE): the model, its Hugging Face adapter, its registry entry."""

from models.api import ModelFamily, register
from models.blocks import BLOCK_AXIS_ROLES
from models.experts import EXPERT_ALERTS, EXPERT_AXIS_ROLES, Dispatch
from models.moe.costs import MoECosts
from models.moe.hf import MoEHF
from models.moe.model import MoE, MoEConfig

FAMILY = register(ModelFamily(
    name="moe", config_class=MoEConfig, model_class=MoE,
    axis_roles={**BLOCK_AXIS_ROLES, **EXPERT_AXIS_ROLES},
    costs=MoECosts, hf=MoEHF(), alerts=EXPERT_ALERTS))

__all__ = ["FAMILY", "Dispatch", "MoE", "MoEConfig"]

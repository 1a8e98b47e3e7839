"""The DeepSeek-V3 family (multi-head latent attention, shared and group-routed experts, multi-token
prediction): the model, its Hugging Face adapter, its registry entry."""

from models.api import AxisRole, ModelFamily, register
from models.blocks import BLOCK_AXIS_ROLES
from models.deepseek.hf import DeepSeekHF
from models.deepseek.costs import DeepSeekCosts
from models.deepseek.model import DENSE_LAYERS, MTP_LAYERS, DeepSeek, DeepSeekConfig
from models.experts import EXPERT_ALERTS, EXPERT_AXIS_ROLES

FAMILY = register(ModelFamily(
    name="deepseek", config_class=DeepSeekConfig, model_class=DeepSeek,
    axis_roles={**BLOCK_AXIS_ROLES, **EXPERT_AXIS_ROLES, "latent": AxisRole.REPLICATED,
                "latent_in": AxisRole.PARAM_SHARDED, DENSE_LAYERS: AxisRole.STACKED, MTP_LAYERS: AxisRole.STACKED,
                "mtp_inputs": AxisRole.REPLICATED, "mtp_embed": AxisRole.REPLICATED},
    costs=DeepSeekCosts, hf=DeepSeekHF(), alerts=EXPERT_ALERTS))

__all__ = ["FAMILY", "DeepSeek", "DeepSeekConfig"]

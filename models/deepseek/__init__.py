"""The DeepSeek-V3 family (multi-head latent attention, shared and group-routed experts, multi-token
prediction): the model, its Hugging Face adapter, its registry entry."""

from models.api import AxisRole, ModelFamily, register
from models.deepseek.hf import DeepSeekHF
from models.deepseek.model import (CHECKPOINT_NAMES, DENSE_LAYERS, MTP_LAYERS, DeepSeek, DeepSeekConfig,
                                   activation_bytes, flops_per_token, key_value_width, recompute_flops_per_token)
from models.moe import FAMILY as MOE
from models.moe.model import exchange_bytes

FAMILY = register(ModelFamily(
    name="deepseek", config_class=DeepSeekConfig, model_class=DeepSeek,
    axis_roles={"heads": AxisRole.TENSOR, "kv_heads": AxisRole.TENSOR, "head_dim": AxisRole.REPLICATED,
                "latent": AxisRole.REPLICATED, "latent_in": AxisRole.PARAM_SHARDED, "mlp": AxisRole.TENSOR,
                "experts": AxisRole.EXPERT,
                "expert_embed": AxisRole.REPLICATED, "expert_mlp": AxisRole.TENSOR,
                "expert_logits": AxisRole.REPLICATED, "expert_rows": AxisRole.EXPERT_ROWS,
                DENSE_LAYERS: AxisRole.STACKED, MTP_LAYERS: AxisRole.STACKED,
                "mtp_inputs": AxisRole.REPLICATED, "mtp_embed": AxisRole.REPLICATED},
    flops_per_token=flops_per_token, recompute_flops_per_token=recompute_flops_per_token,
    activation_bytes=activation_bytes, hf=DeepSeekHF(), exchange_bytes=exchange_bytes, alerts=MOE.alerts,
    key_value_width=key_value_width))

__all__ = ["CHECKPOINT_NAMES", "FAMILY", "DeepSeek", "DeepSeekConfig"]

"""The mixture-of-experts family (Mixtral, Qwen3-MoE): the model, its Hugging Face adapter, its registry entry."""

from models.api import AxisRole, ModelFamily, register
from models.llama.model import key_value_width
from models.moe.hf import MoEHF
from models.moe.model import (CHECKPOINT_NAMES, Dispatch, MoE, MoEConfig, activation_bytes, exchange_bytes,
                              flops_per_token, recompute_flops_per_token)

FAMILY = register(ModelFamily(
    name="moe", config_class=MoEConfig, model_class=MoE,
    axis_roles={"heads": AxisRole.TENSOR, "kv_heads": AxisRole.TENSOR, "head_dim": AxisRole.REPLICATED,
                "mlp": AxisRole.TENSOR, "experts": AxisRole.EXPERT, "expert_embed": AxisRole.REPLICATED,
                "expert_mlp": AxisRole.TENSOR, "expert_logits": AxisRole.REPLICATED,
                "expert_rows": AxisRole.EXPERT_ROWS},
    flops_per_token=flops_per_token, recompute_flops_per_token=recompute_flops_per_token,
    activation_bytes=activation_bytes, hf=MoEHF(), exchange_bytes=exchange_bytes, key_value_width=key_value_width,
    alerts={"moe_exchange_overflow": "token choices were dropped by a full expert-exchange buffer; raise "
                                     "model.exchange_buffer_factor (0: buffers for the worst case, never dropping)"}))

__all__ = ["CHECKPOINT_NAMES", "FAMILY", "Dispatch", "MoE", "MoEConfig"]

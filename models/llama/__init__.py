"""The Llama family (Llama 2/3, Mistral shapes): the model, its Hugging Face adapter, its registry entry."""

from models.api import ModelFamily, register
from models.blocks import BLOCK_AXIS_ROLES, key_value_width
from models.llama.hf import LlamaHF
from models.llama.model import (CHECKPOINT_NAMES, Llama, LlamaConfig, activation_bytes, flops_per_token,
                                recompute_flops_per_token)

FAMILY = register(ModelFamily(
    name="llama", config_class=LlamaConfig, model_class=Llama,
    axis_roles=BLOCK_AXIS_ROLES,
    flops_per_token=flops_per_token, recompute_flops_per_token=recompute_flops_per_token,
    activation_bytes=activation_bytes, hf=LlamaHF(), key_value_width=key_value_width))

__all__ = ["CHECKPOINT_NAMES", "FAMILY", "Llama", "LlamaConfig"]

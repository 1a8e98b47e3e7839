"""The Llama family (Llama 2/3, Mistral shapes): the model, its Hugging Face adapter, its registry entry."""

from models.api import ModelFamily, register
from models.blocks import BLOCK_AXIS_ROLES
from models.llama.costs import LlamaCosts
from models.llama.hf import LlamaHF
from models.llama.model import Llama, LlamaConfig

FAMILY = register(ModelFamily(
    name="llama", config_class=LlamaConfig, model_class=Llama,
    axis_roles=BLOCK_AXIS_ROLES,
    costs=LlamaCosts, hf=LlamaHF()))

__all__ = ["FAMILY", "Llama", "LlamaConfig"]

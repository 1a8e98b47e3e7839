"""Hugging Face Llama-family checkpoints (``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen3ForCausalLM``)
<-> ``LlamaConfig``.

Weight mapping (HF ``nn.Linear`` weights are ``[out_features, in_features]``; ``L`` = layer)::

    model.embed_tokens.weight                [vocab, embed]        -> embedding [vocab, embed]
    model.layers.L.input_layernorm.weight    [embed]               -> layers.attn_norm.scale [L, embed]
    model.layers.L.self_attn.q_proj.weight   [heads*head_dim, embed]
                                             -> layers.attention.query [L, embed, heads, head_dim]
    model.layers.L.self_attn.k_proj.weight   [kv_heads*head_dim, embed]
                                             -> layers.attention.key   [L, embed, kv_heads, head_dim]
    model.layers.L.self_attn.v_proj.weight   [kv_heads*head_dim, embed]
                                             -> layers.attention.value [L, embed, kv_heads, head_dim]
    model.layers.L.self_attn.o_proj.weight   [embed, heads*head_dim]
                                             -> layers.attention.out   [L, heads, head_dim, embed]
    model.layers.L.self_attn.q_norm.weight / k_norm.weight   [head_dim]   (Qwen3 only: ``qk_norm``)
                                             -> layers.attention.query_norm.scale / key_norm.scale [L, head_dim]
    model.layers.L.post_attention_layernorm.weight [embed]         -> layers.mlp_norm.scale [L, embed]
    model.layers.L.mlp.gate_proj.weight / up_proj  [mlp, embed]    -> layers.mlp.gate / up [L, embed, mlp]
    model.layers.L.mlp.down_proj.weight      [embed, mlp]          -> layers.mlp.down [L, mlp, embed]
    model.norm.weight                        [embed]               -> final_norm.scale [embed]
    lm_head.weight                           [vocab, embed]        -> head [embed, vocab] (absent when tied)

No rotary permutation is needed: HF stores q/k rows in the order its ``rotate_half`` (half-split)
expects, which is the convention of ``models.blocks.apply_rotary``.

Which architecture a config is written as follows from ``qk_norm`` and ``sliding_window``: Qwen3
(``qk_norm``, with or without a window on every layer), else Mistral (a window), else Llama.
"""

from __future__ import annotations

from models.hf_decoder import DecoderHF
from models.llama.model import LlamaConfig

# What transformers' Qwen3Config assumes for a key that config.json leaves out, where that differs
# from what ``DecoderHF.decoder_fields`` / ``sliding_window`` assume (head_dim: not hidden / heads;
# key/value heads: not the query heads; no window unless use_sliding_window).
_QWEN3_DEFAULTS = {"head_dim": 128, "num_key_value_heads": 32, "use_sliding_window": False,
                   "sliding_window": 4096, "max_window_layers": 28}


class LlamaHF(DecoderHF):
    """The ``models.api.HFAdapter`` of the Llama family (``hf_decoder.DecoderHF``'s machinery)."""

    model_types = ("llama", "mistral", "qwen3")
    architecture_fields = ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                           "mlp_dim", "qk_norm", "rope_theta", "rope_scaling", "norm_eps", "tie_embeddings",
                           "sliding_window")

    def config_from_hf(self, config: dict, *, seq_len: int | None = None) -> LlamaConfig:
        """The ``LlamaConfig`` of an HF ``config.json`` (Llama, Mistral, or Qwen3 with ``qk_norm``, a key
        it leaves out read as transformers' Qwen3Config does). ``seq_len`` (the training length, which HF
        does not record) defaults to ``min(max_position_embeddings, 2048)``.

        Raises:
          InvalidField: naming the ``config.json`` key of an option this Llama does not implement.
        """
        qwen3 = config.get("model_type") == "qwen3"
        if qwen3:
            config = {**_QWEN3_DEFAULTS, **config}
        self.check_decoder(config, ("intermediate_size",))
        return LlamaConfig(mlp_dim=config["intermediate_size"], qk_norm=qwen3, **self.decoder_fields(config, seq_len))

    def hf_config(self, cfg: LlamaConfig, *, dtype: str, base: dict | None = None) -> dict:
        """A ``config.json`` for ``cfg``: Qwen3ForCausalLM with ``qk_norm`` (a sliding window, if any, on
        every layer: ``use_sliding_window`` with ``max_window_layers`` 0), else MistralForCausalLM with a
        sliding window (Llama's has none), else LlamaForCausalLM. Fields of ``base`` (the config an
        import came from) that do not describe the architecture are kept: token ids,
        max_position_embeddings."""
        if cfg.qk_norm:
            return self.decoder_config(cfg, dtype=dtype, base=base, architecture="Qwen3ForCausalLM",
                                       model_type="qwen3", intermediate_size=cfg.mlp_dim,
                                       use_sliding_window=bool(cfg.sliding_window),
                                       max_window_layers=0 if cfg.sliding_window else cfg.num_layers)
        if cfg.sliding_window:
            return self.decoder_config(cfg, dtype=dtype, base=base, architecture="MistralForCausalLM",
                                       model_type="mistral", intermediate_size=cfg.mlp_dim)
        return self.decoder_config(cfg, dtype=dtype, base=base, architecture="LlamaForCausalLM", model_type="llama",
                                   intermediate_size=cfg.mlp_dim, mlp_bias=False)

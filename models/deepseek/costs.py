"""The DeepSeek-V3 family's costs (``models.api.FamilyCosts``): FLOPs per token of the active
parameters with the prediction depths, one stacked layer's activation bytes with MLA's attention,
the keys' and values' width and the experts' exchange for the planner."""

from __future__ import annotations

import dataclasses

from models.api import LayerBytes, LayerRequest
from models.blocks import score_bytes
from models.common import RematPolicy, palm_train_flops_per_token
from models.experts import ExpertCosts, expert_terms


@dataclasses.dataclass(frozen=True)
class DeepSeekCosts(ExpertCosts):
    """Costs of one ``DeepSeekConfig``."""

    def flops_per_token(self) -> float:
        """Training FLOPs per token (PaLM convention) of the active parameters, the prediction depths
        included; the attention term with ``attention_dim`` = heads * (qk + v) / 2."""
        cfg = self.cfg
        return palm_train_flops_per_token(matmul_params=cfg.active_matmul_params, num_layers=cfg.all_layers,
                                          seq_len=cfg.seq_len, attention_dim=cfg.attention_dim)

    def recompute_flops_per_token(self, remat: RematPolicy) -> float:
        """Forward FLOPs per token the backward recomputes: DOTS the attention matmuls, FULL every
        layer's forward (NAMED and OFFLOAD count 0, an underestimate)."""
        cfg = self.cfg
        attention_forward = 4 * cfg.all_layers * cfg.seq_len * cfg.attention_dim
        layer_matmul = cfg.active_matmul_params - (1 + cfg.mtp_layers) * cfg.embed_dim * cfg.vocab_size
        return {RematPolicy.DOTS: attention_forward,
                RematPolicy.FULL: 2 * layer_matmul + attention_forward}.get(remat, 0.0)

    def key_value_width(self, block_ways: int) -> float:
        """MLA hands the kernel per-head keys (``qk_head_dim``) and values (``v_head_dim``) expanded from
        the latent, the heads split ``block_ways`` ways."""
        cfg = self.cfg
        return cfg.num_heads * (cfg.qk_head_dim + cfg.v_head_dim) / block_ways

    def layer_bytes(self, request: LayerRequest) -> LayerBytes:
        """Per stacked (mixture-of-experts) layer. As the MoE family's, with MLA's attention: the
        per-head queries, keys and (padded) values at width ``w = max(qk, v)``, the latents
        (``q_lora_rank + kv_lora_rank + rope``, never split) and the shared experts. The saved bytes of
        the dense layers and the prediction depths, which the planner does not count as layers, are
        spread over the stacked ones (x ``all_layers / num_layers``), each as if it were an MoE layer
        (an estimate: under a pipeline they sit on the first and last stage). A stack of one layer (one
        prediction depth, one dense layer) keeps ``none``'s values whatever the policy, as measured
        (DeepSeek-V3's 8 layers, ``full``: 134.5 GB of temp with one prediction depth, 126.5 GB with
        two, 104.3 GB with none); XLA:CPU removes a scan's loop of one trip, and a ``prevent_cse=True``
        checkpoint there does not change it (docs/memory.md). FP8's E4M3 copies are not counted, as
        the MoE family's."""
        cfg, tensor = self.cfg, request.block_ways
        d = cfg.embed_dim / request.sequence
        width = max(cfg.qk_head_dim, cfg.v_head_dim)
        q = cfg.num_heads * width / tensor
        latent = cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim
        g = cfg.shared_mlp_dim / tensor
        none, dots, held, router = expert_terms(cfg, tensor, request.experts, request.compute_bytes)
        saved_scores, working_scores = score_bytes(cfg, tensor, request.keys)
        c = request.compute_bytes
        attention = (6 * d + 3 * q + 6 * q + 2 * latent) * c
        everything = attention + saved_scores + (none + 6 * g) * c + router
        working = attention + working_scores + (held + 2 * g) * c + router
        saved = {RematPolicy.NONE: everything,
                 RematPolicy.DOTS: (3 * d + 3 * q + latent + dots + 2 * g) * c,
                 RematPolicy.FULL: d * c}.get(request.remat, everything)
        stacks = (cfg.num_dense_layers, cfg.num_layers, cfg.mtp_layers)
        kept = sum(n * (everything if n == 1 else saved) for n in stacks)
        return LayerBytes(kept / cfg.num_layers, working)

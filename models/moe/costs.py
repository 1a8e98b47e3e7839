"""The mixture-of-experts family's costs (``models.api.FamilyCosts``): FLOPs per token of the active
parameters, one layer's activation bytes and the experts' exchange for the planner."""

from __future__ import annotations

import dataclasses

from models.api import LayerBytes, LayerRequest
from models.blocks import score_bytes
from models.common import RematPolicy, palm_train_flops_per_token
from models.experts import ExpertCosts, expert_terms


@dataclasses.dataclass(frozen=True)
class MoECosts(ExpertCosts):
    """Costs of one ``MoEConfig``."""

    def flops_per_token(self) -> float:
        """Training FLOPs per token of the *active* parameters (PaLM convention with N = the matmul
        weights a token passes through: ``top_k`` experts, not all; dispatch einsums not counted)."""
        cfg = self.cfg
        return palm_train_flops_per_token(matmul_params=cfg.active_matmul_params, num_layers=cfg.num_layers,
                                          seq_len=cfg.seq_len, attention_dim=cfg.attention_dim)

    def recompute_flops_per_token(self, remat: RematPolicy) -> float:
        """Forward FLOPs per token the backward recomputes (as Llama's, with the active layer matmuls)."""
        cfg = self.cfg
        attention_forward = 4 * cfg.num_layers * cfg.seq_len * cfg.attention_dim
        layer_matmul = cfg.active_matmul_params - cfg.embed_dim * cfg.vocab_size
        return {RematPolicy.DOTS: attention_forward,
                RematPolicy.FULL: 2 * layer_matmul + attention_forward}.get(remat, 0.0)

    def layer_bytes(self, request: LayerRequest) -> LayerBytes:
        """Attention as Llama's (``keys`` too); the shared experts' ``g = shared_mlp / tensor`` (``none``
        keeps 6 g, ``dots`` 2 g, one layer's backward holds 2 g); the router's fp32 values; and the
        experts' dispatch (``models.experts.expert_terms``). FP8's E4M3 copies are not counted: what
        ``none`` keeps is counted wide, an overestimate under FP8 (measured for Llama's layers only:
        ``models.llama.costs.LlamaCosts``)."""
        cfg, tensor = self.cfg, request.block_ways
        d = cfg.embed_dim / request.sequence
        q = cfg.num_heads * cfg.head_dim / tensor
        k = cfg.num_kv_heads * cfg.head_dim / tensor
        g = cfg.shared_mlp_dim / tensor
        none, dots, held, router = expert_terms(cfg, tensor, request.experts, request.compute_bytes)
        saved_scores, working_scores = score_bytes(cfg, tensor, request.keys)
        c = request.compute_bytes
        attention = (6 * d + 3 * q + 3 * k) * c
        everything = attention + saved_scores + (none + 6 * g) * c + router
        working = attention + working_scores + (held + 2 * g) * c + router
        saved = {RematPolicy.NONE: everything,
                 RematPolicy.DOTS: (3 * d + q + 2 * k + dots + 2 * g) * c,
                 RematPolicy.FULL: d * c}.get(request.remat, everything)
        return LayerBytes(saved, working)

"""The Llama family's costs (``models.api.FamilyCosts``): training FLOPs per token and one layer's
activation bytes for the planner."""

from __future__ import annotations

import dataclasses

from models.api import LayerBytes, LayerRequest
from models.blocks import BlockCosts, score_bytes
from models.common import RematPolicy, palm_train_flops_per_token
from models.kernels.fp8 import MatmulGroup


@dataclasses.dataclass(frozen=True)
class LlamaCosts(BlockCosts):
    """Costs of one ``LlamaConfig``."""

    def flops_per_token(self) -> float:
        """Training FLOPs per token (PaLM convention, ``models.common.palm_train_flops_per_token``)."""
        cfg = self.cfg
        return palm_train_flops_per_token(matmul_params=cfg.matmul_params, num_layers=cfg.num_layers,
                                          seq_len=cfg.seq_len, attention_dim=cfg.attention_dim)

    def recompute_flops_per_token(self, remat: RematPolicy) -> float:
        """Forward FLOPs per token the backward recomputes: DOTS recomputes the attention matmuls,
        FULL every layer's forward but the MLP's down projection (its output, the layer's last, is not
        needed by the backward, and XLA drops it). Both equal the count of the traced step
        (``meshtrain.measure.flops``, tests/test_flops.py). NAMED and OFFLOAD count 0, an underestimate: they
        recompute whatever their names do not keep (with the default names, the q/k/v, gate/up and
        output projections and the attention scores)."""
        cfg = self.cfg
        attention_forward = 4 * cfg.num_layers * cfg.seq_len * cfg.attention_dim
        layer_matmul = cfg.num_layers * (cfg.layer_params - cfg.layer_norm_params)
        down_projection = cfg.num_layers * cfg.mlp_dim * cfg.embed_dim
        return {RematPolicy.DOTS: attention_forward,
                RematPolicy.FULL: 2 * (layer_matmul - down_projection) + attention_forward}.get(remat, 0.0)

    def layer_bytes(self, request: LayerRequest) -> LayerBytes:
        """Counts in vectors per token: d = embed / sequence (the residual stream, split ``sequence``
        ways by sequence parallelism), q = heads*head_dim/tensor, k = kv_heads*head_dim/tensor, f =
        mlp/tensor in the compute dtype, s = heads/tensor * keys attention scores in fp32. A dense
        model has no experts to split (``experts`` unused). Under FP8 ``none`` keeps the two values
        only an FP8 matmul reads, the attention's output (the output projection's input) and the
        hidden (the down projection's), as their E4M3 copies, 1 B each (XLA:CPU, 8B with
        ``remat=none``: 3.63 GB less temp than bf16's, 3 B x (q + f) per token and layer)."""
        cfg, tensor = self.cfg, request.block_ways
        d = cfg.embed_dim / request.sequence
        q = cfg.num_heads * cfg.head_dim / tensor
        k = cfg.num_kv_heads * cfg.head_dim / tensor
        f = cfg.mlp_dim / tensor
        saved_scores, working_scores = score_bytes(cfg, tensor, request.keys)
        c = request.compute_bytes
        # ``none`` keeps what XLA:CPU's stash of the 8B step holds per token and layer (its buffer
        # assignment, 32.7 GB): six residual-wide values, three query-wide (two [heads, head_dim] values
        # and the attention kernel's output), two key-wide (keys, values), and six MLP-wide: gate, up,
        # sigmoid(gate), its derivative sigmoid(gate)(1 - sigmoid(gate)), silu(gate) and the hidden
        # silu(gate) * up (autodiff's residuals of SwiGLU).
        attention_output = 1 if MatmulGroup.ATTENTION in request.fp8 else c
        hidden = 1 if MatmulGroup.MLP in request.fp8 else c
        everything = (6 * d + 2 * q + 2 * k + 5 * f) * c + q * attention_output + f * hidden + saved_scores
        # The backward of the MLP holds the gradients of gate, up, silu and hidden besides them.
        working = (8 * d + 3 * q + 3 * k + 8 * f) * c + working_scores
        saved = {RematPolicy.NONE: everything,
                 # the input, q/k/v, the attention's output projection, gate/up (the down projection's
                 # output is the next layer's input, kept as that)
                 RematPolicy.DOTS: (2 * d + q + 2 * k + 2 * f) * c,
                 RematPolicy.FULL: d * c}.get(request.remat, everything)
        return LayerBytes(saved, working)

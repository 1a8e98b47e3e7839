"""The shapes meshtrain is compared with MaxText on, and each framework's settings for one: MaxText's
``key=value`` overrides (:func:`maxtext_args`, what ``scripts/bench_maxtext.py`` runs MaxText with) and
meshtrain's config overrides (:func:`maxtext_overrides`, what ``scripts/bench_vs_maxtext.py`` and
``scripts/gpu_check.py`` load). Plain data: nothing here imports JAX or MaxText.
"""

from __future__ import annotations

import dataclasses

# meshtrain's remat names -> MaxText's remat_policy ("minimal" saves the matmul outputs, as meshtrain's dots).
REMAT = {"full": "full", "dots": "minimal"}


@dataclasses.dataclass(frozen=True)
class Shape:
    """A Llama (or, with ``experts``, a Mixtral) shape, batch, mesh and precision, as both frameworks take them.

    With ``experts`` every layer's feed-forward block is ``experts`` SwiGLU experts of hidden size ``mlp``,
    ``top_k`` of them per token (softmax over the top-k router logits), dropless, no shared expert."""

    embed: int
    layers: int
    mlp: int
    heads: int
    head_dim: int
    vocab: int = 32000
    seq: int = 256
    batch: int = 8  # global batch in sequences
    kv_heads: int | None = None  # None: as many as heads
    fsdp: int = 4
    tensor: int = 2
    dtype: str = "bfloat16"  # compute dtype; master weights stay float32 in both
    remat: str = "full"
    experts: int = 0  # routed experts per layer (0: a dense Llama)
    top_k: int = 0  # experts per token (with experts)
    load_balancing: float = 0.0  # weight of the load-balancing loss (with experts)

    def __post_init__(self):
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k {self.top_k} must be between 1 and experts={self.experts}")
        if not self.experts and (self.top_k or self.load_balancing):
            raise ValueError("top_k and load_balancing need experts")

    @property
    def devices(self) -> int:
        return self.fsdp * self.tensor

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads or self.heads


# A 20.6M-parameter Llama (named "issue" after the request that set it) and a larger one; a Mixtral-like
# MoE (8 experts, top-2, GQA); and smoke-test shapes that compile and run in seconds on CPU devices (the
# test suite's, against a stand-in MaxText).
SHAPES = {
    "issue": Shape(embed=256, layers=4, mlp=1024, heads=4, head_dim=64),
    "large": Shape(embed=512, layers=8, mlp=2048, heads=8, head_dim=64),
    "tiny": Shape(embed=32, layers=1, mlp=64, heads=2, head_dim=16, vocab=256, seq=32),
    "moe": Shape(embed=256, layers=4, mlp=512, heads=4, kv_heads=2, head_dim=64, seq=256, batch=16,
                 experts=8, top_k=2, load_balancing=0.01),
    "moe_tiny": Shape(embed=32, layers=1, mlp=64, heads=2, head_dim=16, vocab=256, seq=32, experts=4, top_k=2,
                      load_balancing=0.01),
}


def maxtext_args(shape: Shape, total_steps: int, out_dir: str) -> list[str]:
    """MaxText ``key=value`` overrides for ``shape`` (after the config file argument)."""
    if shape.remat not in REMAT:
        raise ValueError(f"remat {shape.remat!r}: the MaxText comparison knows {sorted(REMAT)}")
    if shape.batch % shape.devices:
        raise ValueError(f"global batch {shape.batch} is not a multiple of the {shape.devices} devices")
    return [
        "run_name=bench", f"base_output_directory={out_dir}",
        "dataset_type=synthetic", "packing=false", "attention=dot_product", "enable_checkpointing=false",
        "enable_tensorboard=false", "enable_goodput_recording=false", "monitor_goodput=false", "log_config=false",
        "ici_data_parallelism=1", f"ici_fsdp_parallelism={shape.fsdp}", f"ici_tensor_parallelism={shape.tensor}",
        "dcn_data_parallelism=1",
        f"base_emb_dim={shape.embed}", f"base_num_decoder_layers={shape.layers}", f"base_mlp_dim={shape.mlp}",
        f"base_num_query_heads={shape.heads}", f"base_num_kv_heads={shape.num_kv_heads}",
        f"head_dim={shape.head_dim}", f"vocab_size={shape.vocab}", f"max_target_length={shape.seq}",
        f"per_device_batch_size={shape.batch // shape.devices}", f"dtype={shape.dtype}", "weight_dtype=float32",
        f"remat_policy={REMAT[shape.remat]}", f"steps={total_steps}", *moe_args(shape),
    ]


def moe_args(shape: Shape) -> list[str]:
    """MaxText's Mixtral decoder, dropless through its sparse path with ``jax.lax.ragged_dot`` (no megablox:
    a Pallas TPU kernel); none for a dense shape."""
    if not shape.experts:
        return []
    return ["decoder_block=mixtral", f"num_experts={shape.experts}", f"num_experts_per_tok={shape.top_k}",
            f"base_moe_mlp_dim={shape.mlp}", "sparse_matmul=true", "megablox=false", "use_tokamax_gmm=false",
            "capacity_factor=-1", f"load_balance_loss_weight={shape.load_balancing}"]


CONFIGS = {"llama": "configs/tiny.yaml", "moe": "configs/moe_tiny.yaml"}  # each family's starting config


def default_config(shape: Shape) -> str:
    """The config a shape starts from: the MoE family's with experts, else the Llama's."""
    return CONFIGS["moe" if shape.experts else "llama"]


def moe_overrides(shape: Shape) -> list[str]:
    """The experts of a Mixtral shape, dropless as MaxText's sparse path: the sorted dispatch, exchange
    buffers for the worst case (nothing dropped), one routing group per row, the top-k gate weights
    renormalised (Mixtral's softmax over the top-k logits), no shared expert, routing bias or z-loss."""
    return [f"model.num_experts={shape.experts}", f"model.top_k={shape.top_k}", f"model.expert_mlp_dim={shape.mlp}",
            "model.dispatch=dropless", "model.exchange_buffer_factor=0", "model.group_size=0",
            "model.norm_topk_prob=true", "model.shared_mlp_dim=0", "model.bias_update_rate=0",
            f"model.load_balancing_coef={shape.load_balancing}", "model.z_loss_coef=0"]


def maxtext_overrides(shape: Shape) -> list[str]:
    """meshtrain overrides for a ``Shape``: its model, batch, mesh, precision and remat."""
    precision = {"bfloat16": "bf16", "float32": "fp32"}[shape.dtype]
    mlp = moe_overrides(shape) if shape.experts else [f"model.mlp_dim={shape.mlp}"]
    return [f"model.embed_dim={shape.embed}", f"model.num_layers={shape.layers}", *mlp,
            f"model.num_heads={shape.heads}", f"model.num_kv_heads={shape.num_kv_heads}",
            f"model.head_dim={shape.head_dim}", f"model.vocab_size={shape.vocab}", f"model.seq_len={shape.seq}",
            f"model.remat={shape.remat}", "model.attention=xla", f"train.batch_size={shape.batch}",
            "train.grad_accum=1", f"train.precision={precision}",
            "mesh.data=1", f"mesh.fsdp={shape.fsdp}", f"mesh.tensor={shape.tensor}", "mesh.stage=1",
            "sharding.preset=fsdp_tp"]

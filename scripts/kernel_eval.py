"""Grouped GEMM and packed attention kernels compiled by XLA:GPU for one compile-only H100
(``meshtrain.gpu_compile``), compared from the GPU module (docs/kernels.md): matmul FLOPs per call
(``dot``s, cuBLAS GEMMs, and a Pallas kernel's custom call from its shapes), temporaries
(``memory_analysis``) and kernels launched (fusions, custom calls and other thunks, loops counted by
their trip counts). Run in ``.venv-gpu`` with tokamax installed:

    .venv-gpu/bin/python scripts/kernel_eval.py [--experts 128] [--rows 65536] grouped
    .venv-gpu/bin/python scripts/kernel_eval.py [--seq 8192] [--window 4096] [--documents 16] attention

Each line is one JSON record: the kernel, forward or forward + backward (and for attention the
window), and its figures. Attention: one row of causal attention with the row's segment ids an input,
through tokamax's ops (``models.kernels.tokamax_attention.tokamax_attention``), jax's cuDNN kernel in its
packed layout (at most ``--documents`` documents a row) and unpacked, our blockwise kernel and the
dense reference.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

from meshtrain.gpu_compile import Target, start_compile_only, topology
from meshtrain.xla_flags import apply_recommended

start_compile_only()
apply_recommended(force=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jaxlib  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from meshtrain.measure.hlo import Module, kernels_launched, pallas_calls  # noqa: E402

def figures(label: str, fn, *args, backward: bool) -> dict:
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    seconds = time.perf_counter() - start
    hlo = compiled.as_text()
    module = Module(hlo)
    census = module.census()
    calls = pallas_calls(hlo)
    extra = sum(flops for _, flops in calls)
    memory = compiled.memory_analysis()
    return dict(kernel=label, backward=backward, flops=census.flops + extra, xla_flops=census.flops,
                pallas_calls=len(calls), custom_calls=dict(census.custom_calls), fusion_kinds=dict(census.fusion_kinds),
                temp_bytes=memory.temp_size_in_bytes, kernels=kernels_launched(module),
                ragged_dots=census.ragged_dots, compile_seconds=round(seconds, 1))


def grouped(args, mesh) -> None:
    import tokamax

    from models.kernels.grouped_matmul import BlockSlots, auto_block, blocked_matmul

    m, k, n, g = args.rows, args.embed, args.mlp, args.experts
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec()))
    rows, w = spec((m, k), jnp.bfloat16), spec((g, k, n), jnp.bfloat16)
    ids = spec((m,), jnp.int32)
    active = 2.0 * m * k * n

    def sorted_sizes(ids):
        order = jnp.argsort(ids, stable=True)
        return order, jnp.bincount(ids, length=g).astype(jnp.int32)

    def ragged_with(product):
        def run(x, w, ids):
            order, sizes = sorted_sizes(ids)
            y = product(x[order], w, sizes)
            return jnp.zeros_like(y).at[order].set(y, unique_indices=True)
        return run

    def blocked(x, w, ids):
        slots = BlockSlots.of(ids, g, auto_block(m, g))
        return slots.scatter(blocked_matmul(slots.gather(x), w, slots.block_group))

    lax_ragged = lambda x, w, s: jax.lax.ragged_dot(x, w, s, preferred_element_type=jnp.float32).astype(x.dtype)
    tokamax_impl = lambda impl: lambda x, w, s: tokamax.ragged_dot(x, w, s, preferred_element_type=x.dtype,
                                                                   implementation=impl)
    kernels = {"lax.ragged_dot": ragged_with(lax_ragged), "blocked": blocked,
               "tokamax.mosaic_gpu": ragged_with(tokamax_impl("mosaic_gpu")),
               "tokamax.triton": ragged_with(tokamax_impl("triton"))}
    for label, fn in kernels.items():
        if args.only and label not in args.only:
            continue
        for backward in (False, True):
            run = (lambda f: lambda x, w, i: jax.grad(lambda x, w: jnp.sum(f(x, w, i).astype(jnp.float32) ** 2),
                                                      argnums=(0, 1))(x, w))(fn) if backward else fn
            try:
                record = figures(label, run, rows, w, ids, backward=backward)
            except Exception as err:  # noqa: BLE001 - reported, the next kernel goes on
                record = dict(kernel=label, backward=backward, error=" ".join(str(err).split())[:400])
            else:
                record["active_flops"] = active * (3 if backward else 1)
                record["flops_over_active"] = round(record["flops"] / record["active_flops"], 3)
            print(json.dumps(record), flush=True)


def cudnn_packed(q, k, v, segments, window: int, documents: int):
    """jax's cuDNN attention in its packed layout (``q_offsets`` / ``q_seqlen``: each row's
    documents, at most ``documents`` of them, as runs of equal ``segments``), causal within each."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

    batch, length = segments.shape
    boundary = jnp.concatenate([jnp.ones((batch, 1), bool), segments[:, 1:] != segments[:, :-1]], 1)
    document = jnp.cumsum(boundary, axis=1) - 1
    count = document[:, -1:] + 1
    lengths = jnp.zeros((batch, documents), jnp.int32).at[jnp.arange(batch)[:, None], document].add(1)
    starts = jnp.cumsum(lengths, axis=1) - lengths
    slot = jnp.arange(documents + 1)[None]
    offsets = jnp.where(slot <= count, jnp.concatenate([starts, jnp.full((batch, 1), length)], 1), -1)
    seqlen = jnp.where(slot[:, :documents] < count, lengths, -1)
    return dot_product_attention(q, k, v, q_seqlen=seqlen.astype(jnp.int32), kv_seqlen=seqlen.astype(jnp.int32),
                                 q_offsets=offsets.astype(jnp.int32), kv_offsets=offsets.astype(jnp.int32),
                                 scale=q.shape[-1] ** -0.5, mask_type=MaskType.PADDING_CAUSAL,
                                 sliding_window_length=window or None)


def attention(args, mesh) -> None:
    from tokamax._src.ops.attention.base import Mask
    from tokamax._src.ops.attention.xla_chunked import XlaChunkedDotProductAttention

    from meshtrain.gpu_compile import answered_for
    from models.kernels.attention import blockwise_attention, cudnn_attention, dense_attention
    from models.kernels.tokamax_attention import first_visible_keys, tokamax_attention

    b, s, h, kv, d = 1, args.seq, args.heads, args.kv_heads, args.head_dim
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec()))
    q, kk, v = spec((b, s, h, d), jnp.bfloat16), spec((b, s, kv, d), jnp.bfloat16), spec((b, s, kv, d), jnp.bfloat16)
    seg = spec((b, s), jnp.int32)

    def triton(q, k, v, seg, window):
        from tokamax._src.ops.attention.pallas_triton import PallasTritonFlashAttention

        return tokamax_attention(q, k, v, seg, window, PallasTritonFlashAttention())

    def chunked(q, k, v, seg, window):
        """Through tokamax's own ``custom_vjp`` (its XLA op takes no ``return_residuals``): autodiff's backward."""
        mask = Mask(k_start=first_visible_keys(seg, window, q.shape[1]), is_causal=True)
        return XlaChunkedDotProductAttention(chunk_size=(512, 1024))(q, k, v, mask=mask)

    kernels = {
        "tokamax.mosaic_gpu": lambda q, k, v, seg, window: tokamax_attention(q, k, v, seg, window),
        "tokamax.triton": triton,
        "tokamax.xla_chunked": chunked,
        "cudnn.packed": lambda q, k, v, seg, window: cudnn_packed(q, k, v, seg, window, args.documents),
        "cudnn.unpacked": lambda q, k, v, seg, window: cudnn_attention(q, k, v, window),
        "blockwise": lambda q, k, v, seg, window: blockwise_attention(q, k, v, seg, seg, window=window, block=512),
        "xla.dense": dense_attention,
    }
    for label, fn in kernels.items():
        if args.only and label not in args.only:
            continue
        for window in (0, args.window):
            for backward in (False, True):
                attend = functools.partial(lambda f, window, q, k, v, seg: f(q, k, v, seg, window), fn, window)
                run = (lambda f: lambda q, k, v, seg: jax.grad(
                    lambda q, k, v: jnp.sum(f(q, k, v, seg).astype(jnp.float32) ** 2), argnums=(0, 1, 2))(q, k, v)
                       )(attend) if backward else attend
                try:
                    with answered_for(mesh.devices.flat):
                        record = figures(label, run, q, kk, v, seg, backward=backward)
                except Exception as err:  # noqa: BLE001 - reported, the next kernel goes on
                    record = dict(kernel=label, backward=backward, error=" ".join(str(err).split())[:400])
                record["window"] = window
                print(json.dumps(record), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["grouped", "attention"])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--rows", type=int, default=65536)
    parser.add_argument("--embed", type=int, default=2048)
    parser.add_argument("--mlp", type=int, default=768)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--documents", type=int, default=16, help="cuDNN's packed layout: documents per row, at most")
    parser.add_argument("--only", nargs="*", default=[])
    args = parser.parse_args()
    import tokamax

    devices = topology(Target.H100, 1, 1)
    mesh = jax.sharding.Mesh(devices, ("x",))
    jax.config.update("jax_default_device", devices[0])
    versions = dict(jax=jax.__version__, jaxlib=jaxlib.__version__,
                    tokamax=__import__("importlib.metadata").metadata.version("tokamax"))
    print(json.dumps(versions), flush=True)
    with tokamax.config.cross_compile(True), jax.set_mesh(mesh):
        (grouped if args.what == "grouped" else attention)(args, mesh)


if __name__ == "__main__":
    main()

"""One prepared GPU check (run by ``scripts/gpu_check.sh``; < 8 minutes on one H100/H200 is the aim).

    scripts/gpu_check.sh [--dry-run] [--steps N] [--remat R --batch B]

1. correctness: the tiny config (fp32, one device, highest matmul precision) trains 3 steps on the
   GPU and on the host CPU from the same init and batch; the losses must match (``--loss-tol``).
2. throughput: a ~1B Llama (configs/llama_1b.yaml: bf16, seq 2048) on one device with cuDNN fused
   attention and the recommended XLA flags (meshtrain/xla_flags.py). The remat policy and batch are
   the first candidate whose compiled footprint (XLA memory_analysis) fits 90 % of the device's
   memory; prints step time, tokens/s, TFLOP/s and MFU, and the planner's temp estimate of that
   layout (``meshtrain.plan``: its backward and update phases) beside this compiler's temp.
2a. xla_flag_arms: the same model, remat and batch compiled and timed under each flag set of
   meshtrain/xla_flags.py (``fixed``: the flags before issue 37; ``derived``: the recommended set;
   ``o1``: derived at ``jax_optimization_level=O1``), the flags that differ set per compile; a table
   of step time, tokens/s, TFLOP/s, MFU and compile seconds, the fastest named. On one device there
   are no collectives, so the arms differ there in command buffers and O1 only.
2b. fp8: the same model, remat and batch with ``train.precision=fp8`` (current scaling: the attention
   and MLP matmuls with E4M3 / E5M2 operands, XLA's FP8 GEMMs): step time beside bf16's
   (``speedup``); then the tiny config trained ``--fp8-steps`` steps (200) in bf16 and in fp8 on the
   device from the same init and data: the fp8 run's final loss (mean of its last 5 logged steps)
   within ``--fp8-tol`` (1.5 %) of bf16's, as on CPU (scripts/bench_fp8.py).
3. offload: the same model with ``offload.optimizer=true model.remat=offload``: memory_analysis
   (device and host bytes) and the step time.
4. checkpoint: the tiny state after one step saved (per-array checksums computed on the device) and
   restored; the restore verifies the checksums and must equal the saved state bit for bit.
5. packing: the tiny model's logits for one window of three documents (``data.packing=documents``:
   per-document positions and attention mask) equal each document run alone, on the device (fp32,
   highest matmul precision, ``--packing-tol``).
6. moe: a small mixture-of-experts model's logits on the device equal the host CPU's (fp32, highest
   precision, ``--moe-tol``); then the experts' forward + backward timed two ways on one device at a
   Mixtral-like width: the GShard one-hot dispatch the family uses (dropless and capacity 1.25)
   against ``jax.lax.ragged_dot`` over the token choices sorted by expert (a grouped GEMM); and
   whether ``jax.lax.ragged_all_to_all`` (the expert exchange off CPU) compiles and moves rows as
   documented on this backend.
6b. deepseek: the DeepSeek-V3 family, tiny (latent attention with YaRN, one dense and two MoE
   layers, group routing, one prediction depth): logits on the device against the host CPU's, and
   generation with the compressed latent cache against the uncached forward (``--moe-tol``, greedy
   tokens equal); latent attention's forward + backward at V3's head shape (128 heads, q/k 192, v
   128, seq 4096, bf16) timed with cuDNN (values padded to 192) and the blockwise kernel (unpadded).

7. pipeline: ZB-H1's split backward of a Llama chunk (bf16, embed 2048, 4 layers, seq 2048) on the
   device: the input- and weight-gradient parts against the whole backward (values, FLOPs that
   add up exactly) and the three timed; then, in a CPU subprocess of the machine's own jax with 8
   simulated devices, ZB-H1 and interleaved 1F1B against the sequential model (fp32,
   ``--pipeline-tol``; not in the dry run, which the test suite's pipeline tests cover).

8. attention kernels: the blockwise kernel (models/kernels/attention.py; also each step of ring attention)
   against the dense XLA reference at seq 4096 for causal rows, packed documents (one of 1 token)
   and a sliding window (forward and gradients, fp32, ``--attention-tol``), and packed rows against
   each document alone; then forward + backward timed in bf16 at 8,192 and 32,768 tokens (32/8
   heads of 128): blockwise, cuDNN (the ``auto`` choice for unpacked rows on GPUs) and dense XLA
   where its scores fit.

9. overhead: issue 13's 20.6M Llama (bf16, full remat, batch 8 x 256, XLA attention) on one device:
   meshtrain's step interleaved with the hand-written one and with the hand-written one plus the same
   non-finite guard (``scripts/bench.py --vs-baseline``: the update in a ``lax.cond`` on finite loss and
   gradients, then every new parameter and moment checked): ``overhead_ratio``,
   ``guarded_overhead_ratio`` and ``guard_ratio`` (what the guard costs on this device), and each
   step's bytes accessed per device (XLA's cost analysis: ``guard_bytes`` is the guard's extra
   traffic as this compiler fuses it).

2c. compile_parity: the same 1B step compiled on the device and by XLA:GPU without it for the same
   card (``scripts/gpu_compile_parity.py``, ``meshtrain.gpu_compile``): memory_analysis side by side, the
   deviceless compile again with the autotune results this GPU dumped, the card's own target config
   (XLA's dump) and the deviceless executable deserialized and run here (its loss beside the device
   compile's); the files under ``GPU_CHECK_OUT`` (default ``gpu_check_out``).

The phases run in the order of their value (loss, throughput, xla flag arms, fp8, compile parity,
checkpoint, packing, moe, deepseek, attention kernels, pipeline, offload, overhead) within ``--budget``
seconds (450 on a device): each has a cap (its expected seconds on one H100/H200, in ``main``) and starts only while
the budget left holds it; a skipped phase says why. Each phase's result is printed when it is known
(``phase NAME: PASS|FAIL|done|ERROR ...|skipped: ...``); an error in one phase is recorded and the
next runs; a table of every phase's seconds, cap and result ends the run.

``--dry-run`` (or ``GPU_CHECK_DRY_RUN=1``) runs everything on the CPU with tiny shapes and no budget;
the test suite runs that. Exit status 1 when the loss, checkpoint, packing, MoE, pipeline or ring
check fails. Last line: ``json: {...}``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import sys
import time

# (remat, global batch) tried in order on the device: fastest first.
CANDIDATES = (("none", 16), ("dots", 16), ("full", 32), ("full", 16), ("full", 8), ("full", 4))
TINY_1B = ["model.num_layers=2", "model.embed_dim=64", "model.num_heads=4", "model.num_kv_heads=2",
           "model.head_dim=16", "model.mlp_dim=192", "model.seq_len=64", "model.vocab_size=256"]
DRY_CANDIDATES = (("dots", 4), ("full", 2))
# Seconds of the XLA flag arms phase: three compiles and timings of the 1B step.
ARMS_CAP = 120


def log(message: str) -> None:
    print(message, flush=True)


def loss_check(load_config, benchmark, steps: int, tol: float, dry_run: bool) -> dict:
    """Tiny model, fp32: per-step losses on the accelerator vs the host CPU."""
    import jax
    import numpy as np

    cfg = load_config("configs/tiny.yaml", ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "mesh.stage=1",
                                            "train.precision=fp32", "train.batch_size=8"])
    targets = {"reference (cpu)": jax.devices("cpu")[0], "device": jax.devices()[0]}
    losses = {}
    with jax.default_matmul_precision("highest"):
        for name, device in targets.items():
            if name == "device" and device == targets["reference (cpu)"]:  # dry run: same device
                losses[name] = losses["reference (cpu)"]
                log("loss check, device: the reference CPU itself (dry run), not run twice")
                continue
            trainer, compiled, _ = benchmark.prepare(cfg, [device])
            state = trainer.init_state(seed=0)
            batch = benchmark.random_batch(trainer)
            values = []
            for _ in range(steps):
                state, metrics = compiled(state, batch)
                values.append(float(metrics["loss"]))
            losses[name] = values
            log(f"loss check, {name} ({device.platform}): {', '.join(f'{v:.6f}' for v in values)}")
    diff = float(np.max(np.abs(np.array(losses["device"]) - np.array(losses["reference (cpu)"]))))
    ok = diff <= tol
    log(f"loss check: max |device - cpu| = {diff:.2e} (tolerance {tol:.0e}): {'PASS' if ok else 'FAIL'}")
    return {"losses": losses, "max_abs_diff": diff, "tolerance": tol, "passed": ok}


def checkpoint_check(load_config, benchmark) -> dict:
    """Save and restore the tiny state on the device; the checksums recorded at save must verify."""
    import tempfile

    import jax
    import numpy as np

    from meshtrain.checkpoint import RunCheckpoints, checkpoint_meta
    from meshtrain.config import to_dict

    cfg = load_config("configs/tiny.yaml", ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "mesh.stage=1",
                                            "train.batch_size=8"])
    trainer, compiled, _ = benchmark.prepare(cfg, [jax.devices()[0]])
    state, _ = compiled(trainer.init_state(seed=0), benchmark.random_batch(trainer))
    with tempfile.TemporaryDirectory() as root:
        checkpoints = RunCheckpoints(f"{root}/checkpoints", keep=1)
        start = time.perf_counter()
        checkpoints.save(1, state, checkpoint_meta(step=1, config=to_dict(cfg), mesh=trainer.mesh,
                                                   layer_order=trainer.layer_order, batch_size=8,
                                                   data_seed=0, train_seed=0))
        checkpoints.wait()
        save_s = time.perf_counter() - start
        restored = checkpoints.restore(1, trainer.abstract_state(), field="gpu_check", layer_order=trainer.layer_order)
        checkpoints.close()
    equal = all(np.array_equal(np.asarray(a), np.asarray(b))
                for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored.state)))
    log(f"checkpoint: saved in {save_s:.2f} s, checksums verified on restore, bit-equal: {equal}")
    return {"save_s": save_s, "bit_equal": equal, "passed": equal}


def packing_check(load_config, tol: float) -> dict:
    """Logits of a packed window of three documents vs each document alone, on the default device."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from models.api import Documents, family_of, forward
    from models.common import unconstrained

    cfg = load_config("configs/tiny.yaml").model
    graphdef, params = nnx.split(family_of(cfg).build(cfg, seed=0))
    run = jax.jit(lambda p, tokens, documents: forward(nnx.merge(graphdef, p), tokens, unconstrained, documents))
    lengths = (20, 30, cfg.seq_len - 50)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, cfg.seq_len)
    segments = np.repeat(np.arange(1, 4), lengths)
    positions = np.concatenate([np.arange(n) for n in lengths])
    pieces = np.zeros((3, cfg.seq_len), np.int64)  # each document alone, zero-padded after it (causal)
    for i, (start, n) in enumerate(zip(np.cumsum((0,) + lengths[:-1]), lengths)):
        pieces[i, :n] = tokens[start:start + n]
    with jax.default_matmul_precision("highest"):
        packed = np.asarray(run(params, jnp.asarray(tokens[None]), Documents(jnp.asarray(positions[None], jnp.int32),
                                                                         jnp.asarray(segments[None], jnp.int32))))[0]
        alone = np.asarray(run(params, jnp.asarray(pieces), None))
    expected = np.concatenate([alone[i, :n] for i, n in enumerate(lengths)])
    diff = float(np.abs(packed - expected).max())
    ok = diff <= tol
    log(f"packing: max |packed - alone| over 3 documents = {diff:.2e} (tolerance {tol:.0e}): "
        f"{'PASS' if ok else 'FAIL'}")
    return {"max_abs_diff": diff, "tolerance": tol, "passed": ok}


def attention_check(dry_run: bool, tol: float) -> dict:
    """The attention kernels on the device. Values: the blockwise kernel (blocks of ``block``, a
    sliding window, packed documents) against the dense XLA reference in fp32 at highest precision,
    forward and gradients; packed rows against each document alone. Speed: forward + backward in
    bf16 of blockwise, cuDNN (GPU only) and dense XLA (where its [heads, seq, seq] scores fit) at
    each length (GQA 32/8 heads of 128)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from models.kernels.attention import blockwise_attention, cudnn_attention, dense_attention

    gpu = jax.devices()[0].platform == "gpu"
    length, heads, kv_heads, head_dim, block = (256, 4, 2, 16, 64) if dry_run else (4096, 16, 8, 128, 512)
    keys = jax.random.split(jax.random.key(0), 4)
    draw = lambda key, n, seq=length: jax.random.normal(key, (1, seq, n, head_dim))
    q, k, v = draw(keys[0], heads), draw(keys[1], kv_heads), draw(keys[2], kv_heads)
    cotangent = jax.random.normal(keys[3], q.shape)
    sizes = [length // 8, 1, length // 2, length - length // 8 - 1 - length // 2]  # incl. a 1-token document
    segments = jnp.asarray(np.repeat(np.arange(1, 5), sizes)[None], jnp.int32)
    window = length // 4
    grads = lambda fn: jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v) * cotangent), argnums=(0, 1, 2)))
    errors = {}
    with jax.default_matmul_precision("highest"):
        for name, seg, win in (("causal", None, 0), ("documents", segments, 0), ("window", None, window)):
            mine = lambda q, k, v, seg=seg, win=win: blockwise_attention(q, k, v, seg, seg, window=win, block=block)
            ref = lambda q, k, v, seg=seg, win=win: dense_attention(q, k, v, seg, win)
            (_, g_mine), (_, g_ref) = grads(mine)(q, k, v), grads(ref)(q, k, v)
            errors[name] = [float(jnp.abs(jax.jit(mine)(q, k, v) - jax.jit(ref)(q, k, v)).max())] + [
                float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) for a, b in zip(g_mine, g_ref)]
        packed = jax.jit(lambda q, k, v: blockwise_attention(q, k, v, segments, segments, block=block))(q, k, v)
        starts = np.concatenate([[0], np.cumsum(sizes)])
        alone = [blockwise_attention(q[:, a:b], k[:, a:b], v[:, a:b], block=block)
                 for a, b in itertools.pairwise(starts)]
        errors["packed_vs_alone"] = [float(jnp.abs(packed - jnp.concatenate(alone, axis=1)).max())]
    ok = all(max(values) <= tol for values in errors.values())
    log("attention values (fp32, max |out| and grads rel L2 vs dense): " + ", ".join(
        f"{name} {max(values):.2e}" for name, values in errors.items()) + f" (tolerance {tol:.0e}): "
        f"{'PASS' if ok else 'FAIL'}")
    timings = []
    heads, kv_heads = (4, 2) if dry_run else (32, 8)
    for seq in ((256,) if dry_run else (8192, 32768)):
        q, k, v = (draw(key, n, seq).astype(jnp.bfloat16) for key, n in zip(keys, (heads, kv_heads, kv_heads)))
        cotangent = jax.random.normal(keys[3], q.shape, jnp.bfloat16)
        kernels = {"blockwise": lambda q, k, v: blockwise_attention(q, k, v, block=512)}
        if gpu:
            kernels["cudnn"] = lambda q, k, v: cudnn_attention(q, k, v, 0)
        if seq <= 8192:  # dense scores [heads, seq, seq] in fp32: 8 GB at 8k and 32 heads
            kernels["xla"] = lambda q, k, v: dense_attention(q, k, v, None, 0)
        row = {"seq_len": seq, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}
        for name, fn in kernels.items():
            row[f"{name}_s"] = _time(grads(fn), q, k, v)
        timings.append(row)
        log(f"attention seq {seq}: forward + backward bf16 " + ", ".join(
            f"{name} {row[f'{name}_s'] * 1e3:.1f} ms" for name in kernels))
    return {"errors": errors, "tolerance": tol, "passed": ok, "timings": timings}


def _time(fn, *args, repeats: int = 5) -> float:
    """Median seconds of ``fn(*args)`` after one warm-up call."""
    import jax
    import numpy as np

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def moe_check(tol: float, dry_run: bool) -> dict:
    """MoE logits on the device vs the host CPU; the experts under each dispatch and grouped-matmul
    kernel timed, and whether ragged_dot is a grouped GEMM on this backend."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from models.common import unconstrained
    from models.kernels.grouped_matmul import GroupedKernel, tokamax_refusal
    from models.moe import FAMILY, Dispatch, MoEConfig
    from models.experts import SparseMoE

    cfg = MoEConfig(vocab_size=256, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                    num_experts=8, top_k=2, expert_mlp_dim=96, seq_len=64, group_size=32)
    graphdef, params = nnx.split(FAMILY.build(cfg))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, cfg.seq_len)))
    run = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t, unconstrained))
    cpu = jax.devices("cpu")[0]
    with jax.default_matmul_precision("highest"):
        on_device = np.asarray(run(params, tokens))
        on_cpu = np.asarray(run(jax.device_put(params, cpu), jax.device_put(tokens, cpu)))
    diff = float(np.abs(on_device - on_cpu).max())
    ok = diff <= tol
    log(f"moe: max |device - cpu| logits = {diff:.2e} (tolerance {tol:.0e}): {'PASS' if ok else 'FAIL'}")

    # The experts alone (one layer, bf16, forward + backward) at a Mixtral-like and a fine-grained
    # (Qwen3-30B-A3B-like) shape, under each dispatch and grouped-matmul kernel.
    shapes = {"mixtral": dict(embed_dim=4096, expert_mlp_dim=14336, num_experts=8, top_k=2),
              "fine_grained": dict(embed_dim=2048, expert_mlp_dim=768, num_experts=128, top_k=8)}
    rows, length = (2, 64) if dry_run else (2, 2048)
    if dry_run:
        shapes = {name: dict(shape, embed_dim=64, expert_mlp_dim=96) for name, shape in shapes.items()}
    group = 0 if dry_run else 512
    variants = {"onehot": dict(dispatch=Dispatch.ONEHOT, group_size=group),
                "capacity_1.25": dict(dispatch=Dispatch.CAPACITY, capacity_factor=1.25, group_size=group),
                "sorted_blocked": dict(dispatch=Dispatch.DROPLESS, grouped_matmul=GroupedKernel.BLOCKED),
                "sorted_ragged": dict(dispatch=Dispatch.DROPLESS, grouped_matmul=GroupedKernel.RAGGED)}
    # tokamax's grouped GEMM (what `auto` runs on GPUs where tokamax is installed: docs/kernels.md).
    refusal = tokamax_refusal(jnp.bfloat16) or ("" if jax.devices()[0].platform == "gpu" else "not a GPU")
    if refusal:
        log(f"moe: the tokamax grouped GEMM is not timed here: {refusal}")
    else:
        variants["sorted_tokamax"] = dict(dispatch=Dispatch.DROPLESS, grouped_matmul=GroupedKernel.TOKAMAX)
    timings = {}
    for shape_name, shape in shapes.items():
        x = jax.random.normal(jax.random.key(0), (rows, length, shape["embed_dim"]), jnp.bfloat16)
        for name, fields in variants.items():
            layer_cfg = dataclasses.replace(cfg, seq_len=length, **shape, **fields)
            layer_def, layer_params = nnx.split(SparseMoE(layer_cfg, nnx.Rngs(0)))
            layer_params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), layer_params)
            loss = lambda p, x: jnp.sum(nnx.merge(layer_def, p)(x, unconstrained)[0].astype(jnp.float32))  # noqa: B023
            try:
                timings[f"{shape_name}/{name}"] = _time(jax.jit(jax.grad(loss, argnums=(0, 1))), layer_params, x)
            except jax.errors.JaxRuntimeError as err:  # e.g. out of memory: said, the check goes on
                log(f"moe {shape_name}/{name}: {type(err).__name__}: {str(err)[:200]}")
    # Whether ragged_dot is a grouped GEMM here: the same rows and widths in 8 and in 128 groups take
    # about the same time if it is, ~16x longer if it computes every group densely.
    m, width, hidden = (512, 64, 96) if dry_run else (16384, 2048, 768)
    ragged_s = {}
    for groups in (8, 128):
        rows_in = jax.random.normal(jax.random.key(1), (m, width), jnp.bfloat16)
        weights = jax.random.normal(jax.random.key(2), (groups, width, hidden), jnp.bfloat16)
        sizes = jnp.full((groups,), m // groups, jnp.int32)
        ragged_s[groups] = _time(jax.jit(lambda r, w, n: jax.lax.ragged_dot(r, w, n)), rows_in, weights, sizes)
    scaling = ragged_s[128] / ragged_s[8]
    verdict = "dense over every group" if scaling > 4 else "grouped"
    ragged_exchange = _ragged_all_to_all_check()
    log(f"moe exchange: ragged_all_to_all on this backend: {ragged_exchange}")
    log("moe experts fwd+bwd (ms): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in timings.items()))
    log(f"ragged_dot {m}x{width}x{hidden}: 8 groups {ragged_s[8] * 1e3:.2f} ms, 128 groups "
        f"{ragged_s[128] * 1e3:.2f} ms ({scaling:.1f}x): {verdict}")
    return {"max_abs_diff": diff, "tolerance": tol, "passed": ok,
            "experts_ms": {k: v * 1e3 for k, v in timings.items()}, "rows": rows, "length": length,
            "shapes": shapes, "ragged_dot": {"groups_8_ms": ragged_s[8] * 1e3, "groups_128_ms": ragged_s[128] * 1e3,
                                             "scaling": scaling, "verdict": verdict},
            "ragged_all_to_all": ragged_exchange}


def _ragged_all_to_all_check() -> str:
    """Whether ``jax.lax.ragged_all_to_all`` (the expert exchange off CPU,
    meshtrain/parallel/experts.py) compiles here and moves rows as documented: one device sending
    rows 1-4 of 6 to itself at offset 2. "equal", "WRONG: ...", or "unavailable: <the error>"."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:1]), ("peers",))
    layout = [jnp.array([value], jnp.int32) for value in (1, 4, 2, 4)]  # input offset, sizes, output offset
    move = jax.shard_map(lambda r: jax.lax.ragged_all_to_all(r, jnp.zeros_like(r), *layout, axis_name="peers"),
                         mesh=mesh, in_specs=PartitionSpec("peers"), out_specs=PartitionSpec("peers"))
    rows = jnp.arange(24.0).reshape(6, 4)
    try:
        got = np.asarray(jax.jit(move)(rows))
    except jax.errors.JaxRuntimeError as err:  # XLA:CPU: UNIMPLEMENTED
        return f"unavailable: {str(err).splitlines()[0][:120]}"
    expected = np.zeros((6, 4))
    expected[2:6] = np.asarray(rows)[1:5]
    return "equal" if np.array_equal(got, expected) else f"WRONG: {got.tolist()}"


def deepseek_check(tol: float, dry_run: bool) -> dict:
    """DeepSeek-V3 (tiny: latent attention with YaRN, one dense + two MoE layers, group routing, one
    prediction depth) on the device: logits against the host CPU's; generation with the compressed
    latent cache against the uncached forward's greedy tokens; and latent attention's training kernel
    (cuDNN on a GPU, whose one head width pads the values, against the blockwise kernel that takes
    them as they are) timed at a DeepSeek-V3-like head shape."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from models.api import forward
    from models.kernels.attention import AttentionKernel, AttentionSpec, attend
    from models.blocks import RopeScaling, RopeScalingConfig
    from models.common import unconstrained
    from models.deepseek import FAMILY, DeepSeekConfig

    cfg = DeepSeekConfig(vocab_size=256, embed_dim=64, num_layers=2, num_dense_layers=1, num_heads=4, q_lora_rank=32,
                         kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, mlp_dim=128,
                         num_experts=8, top_k=2, expert_mlp_dim=32, expert_groups=4, groups_per_token=2,
                         routed_scaling_factor=2.5, mtp_layers=1, seq_len=64, rope_interleave=True,
                         rope_scaling=RopeScalingConfig(kind=RopeScaling.YARN, factor=4.0, original_max_len=16,
                                                        mscale=1.0, mscale_all_dim=1.0))
    model = FAMILY.build(cfg)
    graphdef, params = nnx.split(model)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 32)))
    run = jax.jit(lambda p, t: forward(nnx.merge(graphdef, p), t, unconstrained))
    cpu = jax.devices("cpu")[0]
    with jax.default_matmul_precision("highest"):
        on_device = np.asarray(run(params, tokens))
        on_cpu = np.asarray(run(jax.device_put(params, cpu), jax.device_put(tokens, cpu)))

        def cached(p, t):
            m = nnx.merge(graphdef, p)
            logits, cache = m.cached_forward(t[:, :16], m.init_cache(2, 32), jnp.int32(0))
            steps = [logits]
            for position in range(16, 32):
                logits, cache = m.cached_forward(t[:, position:position + 1], cache, jnp.int32(position))
                steps.append(logits)
            return jnp.concatenate(steps, axis=1)

        generated = np.asarray(jax.jit(cached)(params, tokens))
    diff = float(np.abs(on_device - on_cpu).max())
    cache_diff = float(np.abs(generated - on_device).max())
    same_tokens = bool((generated.argmax(-1) == on_device.argmax(-1)).all())
    ok = diff <= tol and cache_diff <= tol and same_tokens
    log(f"deepseek: max |device - cpu| logits = {diff:.2e}, cached - uncached = {cache_diff:.2e}, greedy tokens "
        f"{'equal' if same_tokens else 'DIFFER'} (tolerance {tol:.0e}): {'PASS' if ok else 'FAIL'}")
    # Latent attention's kernel: 128 heads of q/k 192 and v 128 (DeepSeek-V3), bf16, forward + backward.
    batch, length, heads = (1, 256, 4) if dry_run else (1, 4096, 128)
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (batch, length, heads, 192), jnp.bfloat16)
    k = jax.random.normal(keys[1], (batch, length, heads, 192), jnp.bfloat16)
    v = jax.random.normal(keys[2], (batch, length, heads, 128), jnp.bfloat16)
    kernels = [AttentionKernel.BLOCKWISE, AttentionKernel.XLA if dry_run else AttentionKernel.CUDNN]
    timings = {}
    for kernel in kernels:
        spec = AttentionSpec(kernel, 0, 512)
        loss = lambda q, k, v, spec=spec: jnp.sum(attend(q, k, v, None, spec).astype(jnp.float32))
        try:
            timings[kernel.value] = _time(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), q, k, v) * 1e3
        except (jax.errors.JaxRuntimeError, ValueError, NotImplementedError) as err:  # e.g. cuDNN refusing
            log(f"deepseek attention {kernel.value}: {type(err).__name__}: {str(err)[:200]}")
    log("deepseek latent attention fwd+bwd (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in timings.items()))
    return {"max_abs_diff": diff, "cache_max_abs_diff": cache_diff, "greedy_tokens_equal": same_tokens,
            "tolerance": tol, "passed": ok, "attention_ms": timings, "attention_shape": [batch, length, heads]}


# The pipeline schedules against the sequential model, in a CPU subprocess with 8 simulated devices:
# tests/test_pipeline.py's property on this machine's jax (the tests' small Llama, 8 layers).
PIPELINE_EQUIVALENCE = """
import math
import jax, numpy as np
from flax import nnx
from meshtrain.data import DataConfig, global_batch, make_dataset
from meshtrain.mesh import MeshConfig, make_mesh
from meshtrain.optim import OptimizerConfig
from meshtrain.parallel.layout import Layout
from meshtrain.parallel.pipeline import PipelineConfig, Schedule
from meshtrain.parallel.rules import Preset
from meshtrain.train_config import TrainConfig
from meshtrain.trainer import Trainer
from models.llama import LlamaConfig
model = LlamaConfig(vocab_size=96, embed_dim=40, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=6, mlp_dim=72,
                    seq_len=32)
train = TrainConfig(steps=1, batch_size=16)
data = make_dataset(DataConfig(), vocab_size=model.vocab_size, seq_len=model.seq_len)
def run(shape, pipeline=PipelineConfig()):
    mesh = make_mesh(MeshConfig(*shape), jax.devices()[:math.prod(shape)])
    layout = Layout.of(model, mesh.shape, Preset.FSDP_TP.rules, train, pipeline)
    trainer = Trainer(layout, mesh, OptimizerConfig(learning_rate=3e-3, warmup_steps=0, eps=1e-6))
    batch = global_batch(data, 0, train.batch_size, trainer.batch_sharding)
    loss, grads, _, _ = jax.jit(trainer.gradients)(trainer.init_state(seed=0), batch)
    grads = nnx.to_flat_state(trainer.layer_order.to_logical(grads))
    return float(loss), {path: np.asarray(value.get_value()) for path, value in grads}
ref_loss, ref = run((1, 1, 1, 1))
worst = 0.0
for schedule, virtual in ((Schedule.ZB_H1, 1), (Schedule.INTERLEAVED, 2)):
    loss, grads = run((1, 1, 1, 4), PipelineConfig(4, schedule, virtual))
    worst = max([worst, abs(loss - ref_loss) / ref_loss]
                + [float(np.linalg.norm(grads[k] - ref[k]) / np.linalg.norm(ref[k])) for k in ref])
print(f"worst {worst:.2e}")
"""


def pipeline_check(dry_run: bool, tol: float) -> dict:
    """The ZB-H1 backward split on the device (values and FLOPs of the two parts against the whole
    backward of a Llama chunk in bf16, and their times), and, in a CPU subprocess of this machine's
    jax with 8 simulated devices, ZB-H1 and interleaved 1F1B against the sequential model (fp32)."""
    import subprocess
    import sys

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from meshtrain.measure.flops import count_flops
    from meshtrain.parallel.backward_split import split_backward
    from models.llama import FAMILY, LlamaConfig

    width, layers, length = (64, 2, 64) if dry_run else (2048, 4, 2048)
    cfg = LlamaConfig(vocab_size=256, embed_dim=width, num_layers=layers, num_heads=max(1, width // 128),
                      num_kv_heads=max(1, width // 512), head_dim=min(128, width), mlp_dim=4 * width, seq_len=length)
    graphdef, params = nnx.split(FAMILY.build(cfg))
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    stage = lambda p, x: nnx.merge(graphdef, p).run_layers(x)[0]
    x = jax.random.normal(jax.random.key(0), (2, length, width), jnp.bfloat16)
    y, closure = jax.vjp(stage, params, x)
    residuals, treedef = jax.tree.flatten(closure)
    backward = lambda res, ct: jax.tree.unflatten(treedef, res)(ct)
    split = split_backward(backward, residuals, y)
    whole = jax.jit(backward)(residuals, y)
    d_x, cut = jax.jit(split.input_grad)(residuals, y)
    d_params = jax.jit(split.weight_grad)(residuals, cut)
    diff = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
                     / (float(jnp.max(jnp.abs(b.astype(jnp.float32)))) + 1e-30))
               for a, b in zip(jax.tree.leaves((d_params, d_x)), jax.tree.leaves(whole)))
    flops = [count_flops(f, *args).flops for f, args in ((backward, (residuals, y)), (split.input_grad, (residuals, y)),
                                                          (split.weight_grad, (residuals, cut)))]
    times = [_time(jax.jit(backward), residuals, y), _time(jax.jit(split.input_grad), residuals, y),
             _time(jax.jit(split.weight_grad), residuals, cut)]
    split_ok = diff <= 2 ** -6 and flops[0] == flops[1] + flops[2]
    log(f"pipeline: split backward, max rel diff {diff:.2e}, FLOPs whole {flops[0]:.3g} = input {flops[1]:.3g} + "
        f"weight {flops[2]:.3g}: {'PASS' if split_ok else 'FAIL'}; ms whole {times[0] * 1e3:.2f}, input "
        f"{times[1] * 1e3:.2f}, weight {times[2] * 1e3:.2f}")
    worst, equal = None, True  # the dry run leaves the schedules to the test suite (same jax)
    if not dry_run:
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
        proc = subprocess.run([sys.executable, "-c", PIPELINE_EQUIVALENCE], env=env, capture_output=True,
                              text=True, timeout=400)
        ran = proc.returncode == 0 and "worst" in proc.stdout
        worst = float(proc.stdout.split("worst")[-1]) if ran else float("nan")
        equal = worst <= tol
        log(f"pipeline: zb_h1 and interleaved 1F1B vs sequential on jax {jax.__version__} CPU x 8, worst rel "
            f"{worst:.2e}: {'PASS' if equal else 'FAIL ' + proc.stderr[-500:]}")
    return {"passed": split_ok and equal, "split_max_rel_diff": diff, "split_flops": flops,
            "split_ms": [t * 1e3 for t in times], "schedules_worst_rel": worst,
            "shape": {"embed": width, "layers": layers, "length": length}}


def fits(compiled, limit: int | None) -> tuple[bool, int]:
    from meshtrain.measure.hlo import footprint_bytes, memory_of

    need = footprint_bytes(memory_of(compiled))
    return (limit is None or need <= limit), need


def planner_estimate(cfg, xla_temp: int) -> dict:
    """``meshtrain.plan``'s temp estimate of ``cfg``'s one-device layout beside ``xla_temp``, the
    compiled step's (on a GPU: whether XLA:GPU updates in place as XLA:CPU does)."""
    import jax

    from meshtrain import plan as planner
    from meshtrain.planner.constants import Compiler
    from meshtrain.planner.roofline import Hardware

    # The fitted constants of the compiler that built the step: XLA:GPU's on a GPU, XLA:CPU's in a dry run.
    compiler = Compiler.of_platform(jax.devices()[0].platform)
    plan = planner.make_plan(cfg, 1, float(1 << 50), meshes=[(1, 1, 1, 1)], zero_stages=[cfg.zero.stage],
                             remats=[cfg.model.remat], hardware=Hardware(compiler=compiler))
    (est,) = plan.estimates
    out = {"estimate_temp_bytes": est.temp_bytes, "estimate_update_bytes": est.update,
           "estimate_backward_bytes": est.backward_bytes, "xla_temp_bytes": xla_temp,
           "error": (est.temp_bytes - xla_temp) / xla_temp if xla_temp else None, "reasons": est.reasons}
    log(f"planner: temp {est.temp_bytes / 2**30:.3g} GiB estimated (update phase {est.update / 2**30:.3g}, "
        f"backward {out['estimate_backward_bytes'] / 2**30:.3g}) against {xla_temp / 2**30:.3g} GiB compiled"
        + (f" ({out['error']:+.1%})" if out["error"] is not None else ""))
    return out


def throughput(load_config, benchmark, args, limit: int | None, attention: str) -> dict:
    """The ~1B model on one device: first fitting (remat, batch), then timed steps."""
    import jax

    base = ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "mesh.stage=1", "train.precision=bf16",
            "model.seq_len=2048" if not args.dry_run else "model.seq_len=64", f"model.attention={attention}",
            *args.dry_overrides]
    candidates = [(args.remat, args.batch)] if args.remat else (DRY_CANDIDATES if args.dry_run else CANDIDATES)
    device = jax.devices()[:1]
    for remat, batch in candidates:
        cfg = load_config("configs/llama_1b.yaml", [*base, f"model.remat={remat}", f"train.batch_size={batch}"])
        prepared = benchmark.prepare(cfg, device)
        ok, need = fits(prepared[1], limit)
        log(f"candidate remat={remat} batch={batch}: compiled in {prepared[2]:.1f} s, needs "
            f"{need / 2**30:.2f} GiB of {'?' if limit is None else f'{limit / 2**30:.1f}'} GiB: "
            f"{'fits' if ok else 'too big'}")
        if ok:
            result = benchmark.run(cfg, steps=args.steps, prepared=prepared)
            result.update(remat=remat, batch_size=batch)
            result["planner"] = planner_estimate(cfg, result["memory_per_device"]["temp_bytes"])
            mfu = result["mfu"]
            log(f"1B: {result['parameters'] / 1e9:.2f}B params, remat={remat}, batch {batch} x "
                f"{cfg.model.seq_len}: step {result['step_time_s_median'] * 1e3:.1f} ms, "
                f"{result['tokens_per_sec']:,.0f} tokens/s, {result['tflops_per_device']:.1f} TFLOP/s, "
                f"MFU {'null' if mfu is None else f'{mfu:.1%}'}, compile {result['compile_s']:.1f} s")
            return result
        del prepared
    raise SystemExit("error: no (remat, batch) candidate fits this device")


def compile_parity(args, bf16: dict, device_kind: str) -> dict:
    """The throughput phase's 1B step compiled on this GPU and by XLA:GPU without it for the same card
    (scripts/gpu_compile_parity.py, one process per compile): memory_analysis side by side, the deviceless
    compile again with this GPU's autotune results loaded, the deviceless executable run on this GPU."""
    import subprocess

    from meshtrain.xla_flags import cuda_plugin_installed

    target = next((name for name in ("h100", "h200", "b200") if name in device_kind.lower()), None)
    if target is None or not cuda_plugin_installed():
        return {"skipped": f"no compile-only target for {device_kind!r} (h100, h200, b200 with the CUDA plugin)"}
    out = pathlib.Path(os.environ.get("GPU_CHECK_OUT", "gpu_check_out")) / "compile_parity"
    overrides = ["model.seq_len=2048", f"model.remat={bf16['remat']}", f"train.batch_size={bf16['batch_size']}"]

    def run(*extra: str, deviceless: bool) -> dict:
        env = {**os.environ, "JAX_PLATFORMS": "cpu"} if deviceless else dict(os.environ)
        proc = subprocess.run([sys.executable, "scripts/gpu_compile_parity.py", *extra, "--out", str(out), *overrides],
                              env=env, capture_output=True, text=True, timeout=300, check=False)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("json: ")]
        if proc.returncode or not lines:
            raise RuntimeError(f"{extra[0]} exit {proc.returncode}: {proc.stderr[-400:]}")
        return json.loads(lines[-1][len("json: "):])

    deviceless = run("deviceless", "--target", target, deviceless=True)
    on_device = run("device", deviceless=False)
    autotune = out / "autotune_results.txt"
    tuned = run("deviceless", "--target", target, "--autotune", str(autotune), deviceless=True) \
        if autotune.exists() else {"skipped": "no autotune results were dumped"}
    ratio = lambda a, key: a[key] / on_device[key] if key in a and on_device[key] else None
    result = {"target": target, "device": on_device, "deviceless": deviceless, "deviceless_autotuned": tuned,
              "temp_ratio": ratio(deviceless, "temp_bytes"), "temp_ratio_autotuned": ratio(tuned, "temp_bytes"),
              "argument_ratio": ratio(deviceless, "argument_bytes"), "files": str(out)}
    log(f"compile parity ({target}): temp deviceless / device = {result['temp_ratio']}, with this GPU's autotune "
        f"results {result['temp_ratio_autotuned']}; arguments {result['argument_ratio']}; the deviceless executable "
        f"ran here: loss {on_device.get('deviceless_loss')} vs {on_device.get('device_loss')}; target config "
        f"{on_device.get('target_config')}")
    return result


def xla_flag_arms(load_config, benchmark, args, bf16: dict, cap: float) -> dict:
    """Phase 3: the 1B step of the throughput phase (its remat, batch and attention) compiled and timed
    under each arm of meshtrain/xla_flags.py: ``fixed`` (the flags before issue 37), ``derived`` (the
    recommended set for this layout) and ``o1`` (derived at ``jax_optimization_level=O1``). The
    process keeps its XLA_FLAGS; an arm sets per compile the flags that differ between arms
    (``xla_flags.arm_setting``). An arm starts only while ``cap`` holds one more arm as long as the
    mean so far. On one device there are no collectives: the arms differ in command buffers and O1."""
    import jax

    from meshtrain import xla_flags
    from meshtrain.mesh import make_mesh
    from meshtrain.trainer import Trainer

    cfg = load_config("configs/llama_1b.yaml", [
        "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "mesh.stage=1", "train.precision=bf16",
        "model.seq_len=2048" if not args.dry_run else "model.seq_len=64", *args.dry_overrides,
        f"model.attention={bf16['attention']}", f"model.remat={bf16['remat']}",
        f"train.batch_size={bf16['batch_size']}"])
    mesh = make_mesh(cfg.mesh, jax.devices()[:1])
    trainer = Trainer(cfg.layout(mesh.shape), mesh, cfg.optimizer)
    lower = lambda: trainer.train_step.lower(trainer.abstract_state(), trainer.abstract_batch())
    started, arms, timed = time.perf_counter(), {}, []
    for arm in xla_flags.Arm:
        spent = time.perf_counter() - started
        if timed and spent / len(timed) > cap - spent:
            arms[arm.value] = {"skipped": f"cap: {cap - spent:.0f} s left, an arm takes {spent / len(timed):.0f} s"}
            log(f"xla flag arm {arm.value}: skipped ({arms[arm.value]['skipped']})")
            continue
        setting = xla_flags.arm_setting(arm, trainer.layout)
        start = time.perf_counter()
        compiled = xla_flags.compile_arm(lower, setting)
        result = benchmark.run(cfg, steps=args.steps, prepared=(trainer, compiled, time.perf_counter() - start))
        arms[arm.value] = {key: result[key] for key in ("step_time_s_median", "tokens_per_sec", "tflops_per_device",
                                                        "mfu", "compile_s")}
        arms[arm.value].update(options=setting.options, optimization_level=setting.optimization_level)
        timed.append(arm.value)
        log(f"xla flag arm {arm.value}: step {result['step_time_s_median'] * 1e3:.1f} ms, compile "
            f"{result['compile_s']:.1f} s")
        del compiled
    log(f"xla flag arms, 1B remat={bf16['remat']} batch {bf16['batch_size']} ({jax.devices()[0].device_kind}):")
    log(f"  {'arm':<8} {'step ms':>9} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'compile s':>9}")
    for name in timed:
        row = arms[name]
        mfu = "-" if row["mfu"] is None else f"{row['mfu']:.1%}"
        log(f"  {name:<8} {row['step_time_s_median'] * 1e3:>9.1f} {row['tokens_per_sec']:>10,.0f} "
            f"{row['tflops_per_device']:>8.1f} {mfu:>6} {row['compile_s']:>9.1f}")
    fastest = min(timed, key=lambda name: arms[name]["step_time_s_median"])
    ratio = {name: arms[name]["step_time_s_median"] / arms[timed[0]]["step_time_s_median"] for name in timed}
    log(f"xla flag arms: fastest {fastest}; step time against {timed[0]}: "
        + ", ".join(f"{name} {value:.3f}" for name, value in ratio.items()))
    return {"arms": arms, "fastest": fastest, "step_time_ratio": ratio, "remat": bf16["remat"],
            "batch_size": bf16["batch_size"]}


def fp8_check(load_config, benchmark, args, bf16: dict) -> dict:
    """Step 2b: the 1B model in fp8 against the throughput phase's bf16 step, then the tiny
    config's fp8 loss against bf16's after ``--fp8-steps`` steps on the device."""
    import pathlib
    import tempfile

    import jax
    from bench_fp8 import run_arm

    cfg = load_config("configs/llama_1b.yaml", [
        "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "mesh.stage=1", "train.precision=fp8",
        "model.seq_len=2048" if not args.dry_run else "model.seq_len=64", *args.dry_overrides,
        f"model.attention={bf16['attention']}", f"model.remat={bf16['remat']}",
        f"train.batch_size={bf16['batch_size']}"])
    result = benchmark.run(cfg, steps=args.steps, devices=jax.devices()[:1])
    speedup = bf16["step_time_s_median"] / result["step_time_s_median"]
    log(f"fp8 1B: step {result['step_time_s_median'] * 1e3:.1f} ms against bf16's "
        f"{bf16['step_time_s_median'] * 1e3:.1f} ms: {speedup:.2f}x, {result['tflops_per_device']:.1f} TFLOP/s")
    device = ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "mesh.stage=1"]
    with tempfile.TemporaryDirectory() as tmp:
        arms = {name: run_arm("configs/tiny.yaml", device, [f"train.precision={name}"], args.fp8_steps,
                              max(1, args.fp8_steps // 20), pathlib.Path(tmp), name)
                for name in ("bf16", "fp8")}
    final = {name: sum(list(arm["losses"].values())[-5:]) / len(list(arm["losses"].values())[-5:])
             for name, arm in arms.items()}
    ratio = final["fp8"] / final["bf16"]
    ok = abs(ratio - 1) <= args.fp8_tol and arms["fp8"]["skipped_steps"] == 0
    log(f"fp8 tiny, {args.fp8_steps} steps: final loss fp8 {final['fp8']:.4f}, bf16 {final['bf16']:.4f}: ratio "
        f"{ratio:.4f} (tolerance {args.fp8_tol:.1%}): {'PASS' if ok else 'FAIL'}")
    return {"step_time_s_median": result["step_time_s_median"], "bf16_step_time_s_median": bf16["step_time_s_median"],
            "speedup": speedup, "tflops_per_device": result["tflops_per_device"], "final_loss": final,
            "loss_ratio": ratio, "tolerance": args.fp8_tol, "passed": ok}


def offload(load_config, benchmark, args, batch: int) -> dict:
    """The same model with optimizer-state and activation offload to pinned host memory."""
    import jax

    cfg = load_config("configs/llama_1b.yaml", [
        "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "mesh.stage=1", "train.precision=bf16",
        "model.seq_len=2048" if not args.dry_run else "model.seq_len=64", *args.dry_overrides,
        "offload.optimizer=true", "model.remat=offload", f"train.batch_size={batch}"])
    result = benchmark.run(cfg, steps=max(2, args.steps // 3), devices=jax.devices()[:1])
    memory = result["memory_per_device"]
    log("offload (optimizer + remat=offload), memory_analysis: "
        + ", ".join(f"{k} {v / 2**30:.3f} GiB" for k, v in memory.items() if v is not None))
    log(f"offload: batch {batch}, step {result['step_time_s_median'] * 1e3:.1f} ms, "
        f"{result['tflops_per_device']:.1f} TFLOP/s")
    return result


def overhead_check(load_config, benchmark, args) -> dict:
    """Step 9: meshtrain against the plain and the guarded hand-written step on one device."""
    import dataclasses

    import jax
    from bench_maxtext import SHAPES
    from bench_vs_maxtext import maxtext_overrides

    shape = dataclasses.replace(SHAPES["issue"], fsdp=1, tensor=1)
    cfg = load_config("configs/tiny.yaml", [*maxtext_overrides(shape), *args.dry_overrides])
    result = benchmark.run(cfg, steps=2 if args.dry_run else 30, vs_baseline=True, devices=jax.devices()[:1])
    keys = ("overhead_ratio", "guarded_overhead_ratio", "guard_ratio")
    log(f"overhead: meshtrain {result['step_time_s_median'] * 1e3:.2f} ms, baseline "
        f"{result['baseline']['step_time_s_median'] * 1e3:.2f} ms, guarded "
        f"{result['baseline_guarded']['step_time_s_median'] * 1e3:.2f} ms; "
        + ", ".join(f"{key} {result[key]:.3f}" for key in keys)
        + (f"; guard adds {result['guard_bytes'] / 1e6:.1f} MB accessed" if result["guard_bytes"] is not None else ""))
    return {"step_time_s_median": result["step_time_s_median"],
            "baseline_s": result["baseline"]["step_time_s_median"],
            "baseline_guarded_s": result["baseline_guarded"]["step_time_s_median"],
            "bytes_accessed": result["bytes_accessed"], "guard_bytes": result["guard_bytes"],
            "baseline_bytes_accessed": result["baseline"]["bytes_accessed"],
            "baseline_guarded_bytes_accessed": result["baseline_guarded"]["bytes_accessed"],
            **{key: result[key] for key in keys}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", default=os.environ.get("GPU_CHECK_DRY_RUN") == "1",
                        help="CPU, tiny shapes (also GPU_CHECK_DRY_RUN=1)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps of the 1B model")
    parser.add_argument("--remat", help="skip the search: this remat policy ...")
    parser.add_argument("--batch", type=int, default=16, help="... with this global batch")
    parser.add_argument("--loss-tol", type=float, default=2e-4)
    parser.add_argument("--packing-tol", type=float, default=1e-4)
    parser.add_argument("--moe-tol", type=float, default=1e-4)
    parser.add_argument("--pipeline-tol", type=float, default=1e-5)
    parser.add_argument("--attention-tol", type=float, default=2e-5)
    parser.add_argument("--fp8-steps", type=int, default=200, help="tiny steps of the fp8 loss check")
    parser.add_argument("--fp8-tol", type=float, default=0.015, help="fp8 final loss within this share of bf16's")
    parser.add_argument("--skip-offload", action="store_true")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for the whole check (default 450 on a device, unlimited in a dry run): a "
                             "phase starts only while what is left holds its cap")
    args = parser.parse_args(argv)
    args.dry_overrides = TINY_1B if args.dry_run else []
    if args.budget is None:
        args.budget = float("inf") if args.dry_run else 450.0
    started = time.perf_counter()

    from meshtrain import xla_flags
    from meshtrain.cli import use_host_devices
    from meshtrain.config import load_config

    if args.dry_run:
        use_host_devices(1)
        args.steps = min(args.steps, 2)
        args.fp8_steps = min(args.fp8_steps, 10)
    else:  # the set of the 1B model's one-device layout (the layout builds no backend)
        one = {"data": 1, "fsdp": 1, "tensor": 1, "stage": 1}
        layout = load_config("configs/llama_1b.yaml", [f"mesh.{axis}=1" for axis in one]).layout(one)
        added = xla_flags.apply_recommended(layout)
        log(f"XLA_FLAGS += {' '.join(added) or '(nothing: not a CUDA run, or already set)'}")
    import jax

    from meshtrain.measure import benchmark

    device = jax.devices()[0]
    log(f"jax {jax.__version__}, {len(jax.devices())} x {device.device_kind} ({device.platform})"
        f"{', DRY RUN' if args.dry_run else ''}")
    if not args.dry_run and device.platform != "gpu":
        log(f"warning: no GPU found (platform {device.platform}); use --dry-run for a CPU check")
    stats = device.memory_stats() or {}
    limit = int(0.9 * stats["bytes_limit"]) if "bytes_limit" in stats else None
    report = {"device_kind": device.device_kind, "platform": device.platform, "jax": jax.__version__,
              "dry_run": args.dry_run, "xla_flags": os.environ.get("XLA_FLAGS", "")}

    def run_throughput() -> dict:
        try:
            result = throughput(load_config, benchmark, args, limit, report["attention"])
        except Exception as err:
            if report["attention"] != "cudnn":
                raise
            log(f"cuDNN attention failed ({type(err).__name__}: {str(err)[:300]}); retrying with XLA attention")
            report["attention"] = "xla (cudnn failed)"
            result = throughput(load_config, benchmark, args, limit, "xla")
        return {**result, "attention": report["attention"].split(" ")[0]}

    report["attention"] = "cudnn" if device.platform == "gpu" else "xla"
    # In order of value, each with the seconds it is expected to need on one H100/H200 (its cap: a
    # phase starts only while the budget left holds its cap) and the phase whose result it needs.
    phases = [
        ("loss_check", 60, None, lambda: loss_check(load_config, benchmark, 3, args.loss_tol, args.dry_run)),
        ("throughput", 150, None, run_throughput),
        ("xla_flag_arms", ARMS_CAP, "throughput",
         lambda: xla_flag_arms(load_config, benchmark, args, report["throughput"], ARMS_CAP)),
        ("fp8", 90, "throughput", lambda: fp8_check(load_config, benchmark, args, report["throughput"])),
        ("compile_parity", 90, "throughput",
         lambda: compile_parity(args, report["throughput"], device.device_kind)),
        ("checkpoint", 20, None, lambda: checkpoint_check(load_config, benchmark)),
        ("packing", 20, None, lambda: packing_check(load_config, args.packing_tol)),
        ("moe", 60, None, lambda: moe_check(args.moe_tol, args.dry_run)),
        ("deepseek", 60, None, lambda: deepseek_check(args.moe_tol, args.dry_run)),
        ("attention_kernels", 60, None, lambda: attention_check(args.dry_run, args.attention_tol)),
        ("pipeline", 60, None, lambda: pipeline_check(args.dry_run, args.pipeline_tol)),
        ("offload", 60, "throughput", lambda: offload(load_config, benchmark, args,
                                                      max(1, report["throughput"]["batch_size"] // 2))),
        ("overhead", 40, None, lambda: overhead_check(load_config, benchmark, args)),
    ]
    if args.skip_offload:
        phases = [phase for phase in phases if phase[0] != "offload"]
    rows = []
    for name, cap, needs, run in phases:
        left = args.budget - (time.perf_counter() - started)
        if needs is not None and ({"error", "skipped"} & set(report.get(needs, {"skipped": "not run"}))):
            report[name] = {"skipped": f"needs {needs}"}
        elif cap > left:
            report[name] = {"skipped": f"budget: {left:.0f} s left, cap {cap} s"}
        else:
            phase = time.perf_counter()
            try:
                report[name] = run()
            except (Exception, SystemExit) as err:  # noqa: BLE001 - one phase's failure must not cost the others
                report[name] = {"error": f"{type(err).__name__}: {str(err)[:500]}", "passed": False}
            report[name]["wall_s"] = time.perf_counter() - phase
        result = report[name]
        status = ("skipped: " + result["skipped"] if "skipped" in result else "ERROR " + result["error"]
                  if "error" in result else {True: "PASS", False: "FAIL"}.get(result.get("passed"), "done"))
        rows.append((name, status, result.get("wall_s"), cap))
        log(f"phase {name}: {status}" + (f" ({result['wall_s']:.1f} s, cap {cap} s)" if "wall_s" in result else ""))
    report["wall_s"] = time.perf_counter() - started
    log(f"gpu_check done in {report['wall_s']:.1f} s (budget {args.budget:.0f} s)")
    log(f"{'phase':<18} {'seconds':>8} {'cap':>5}  result")
    for name, status, wall, cap in rows:
        log(f"{name:<18} {'-' if wall is None else f'{wall:.1f}':>8} {cap:>5}  {status[:100]}")
    print("json: " + json.dumps(report), flush=True)
    checked = ("loss_check", "fp8", "checkpoint", "packing", "moe", "deepseek", "pipeline", "attention_kernels")
    passed = all(report[name].get("passed", True) for name in checked if name in report)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark meshtrain's train step: step time, tokens/s, TFLOP/s per device, MFU, compile time, memory.

    python scripts/bench.py --config configs/tiny.yaml --host-devices 8 [--steps 10] [--vs-baseline]
        [--attention auto|xla|cudnn] [--json FILE] [section.field=value ...]
    python scripts/bench.py --sweep layouts --host-devices 8 [--out docs/img/layout_bench.png]
    python scripts/bench.py --sweep depth --host-devices 8
    python scripts/bench.py --sweep context --host-devices 8 [--seqs 1024 ... 32768] [--schemes ring]
        [--host-budget GB] [--out PNG]
    python scripts/bench.py --sweep experts --host-devices 8 --config configs/moe_tiny.yaml [--out PNG]
    python scripts/bench.py --vs-maxtext [--shape issue|large] [--steps 20] [--rounds 2]
        [--dtype bfloat16 float32] [--vs-baseline]

Batches are random tokens of the config's shape (no data file is read). After one warm-up step,
``--steps`` steps are timed one by one (each waits for its result); the median is reported.

``--vs-baseline`` builds, in the same process and on the same mesh, a minimal hand-written train step
of the same model: plain ``jax.jit`` of value_and_grad + the same optax AdamW over the same parameter
pytree, with the same parameter, optimizer-state, batch and activation shardings, the same loss and the
same compute dtype. A second hand-written step, ``baseline_guarded``, adds what meshtrain's step does
beyond that: the gradient and update norms, and the update kept only where loss and both norms are
finite. Their steps are interleaved with meshtrain's (order reversed every step), so machine noise
hits all three; printed: ``overhead_ratio`` = median meshtrain / median baseline,
``guarded_overhead_ratio`` = median meshtrain / median baseline_guarded (the trainer against a
hand-written step of the same work) and ``guard_ratio`` = median baseline_guarded / median baseline
(what the non-finite guard costs by itself). Each of the three also reports ``bytes_accessed``, XLA's
``cost_analysis()`` count of the bytes its compiled step reads and writes per device: a scan's body
is counted once, so the figure is not the step's traffic, but the layers' scan is the same in all
three and the optimizer update runs outside any loop, so differences between them are the extra
passes over parameter-sized buffers (``guard_bytes`` = guarded - plain baseline), free of timing noise.

``--vs-maxtext`` times MaxText (``scripts/bench_maxtext.py``, in its own venv made by
``scripts/install_maxtext.sh``) and meshtrain on one ``--shape`` (model, global batch, mesh fsdp x tensor,
bf16 compute, full remat), ``--rounds`` runs of ``--steps`` steps each, alternating which goes first
(ABBA): each run's median, each framework's pooled median and spread, and ratio = meshtrain / MaxText.
``--vs-baseline`` adds both hand-written steps to meshtrain's runs (interleaved with it) and prints
their medians and the three ratios; ``--dtype bfloat16 float32`` runs the whole comparison in each compute
dtype in turn and prints each one's bf16-over-fp32 speedup (fp32 median / bf16 median).
Without MaxText installed it prints one line and exits 0.

``--sweep experts`` runs a mixture-of-experts config (a family with expert axes) under expert
parallelism of 1 (experts replicated), 4 and 8 ways (``EXPERT_LAYOUTS``).

Every result is printed as ``name: value`` lines and, last, one ``json: {...}`` line.
MFU is ``null`` when the device's peak is unknown (CPU). FLOPs are the family's
``flops_per_token`` (for a mixture of experts: the active parameters, ``top_k`` experts).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")


def collective_counts(hlo_text: str) -> dict[str, int]:
    """Collective ops (``-start`` forms included) in optimized HLO text."""
    counts = dict.fromkeys(COLLECTIVES, 0)
    for line in hlo_text.splitlines():
        for op in COLLECTIVES:
            if f" {op}(" in line or f" {op}-start(" in line:
                counts[op] += 1
    return counts


def random_batch(trainer, seed: int = 0):
    """A global batch of uniform random tokens in the trainer's batch sharding."""
    import jax
    import jax.numpy as jnp

    shape = (trainer.layout.train.batch_size, trainer.layout.model.seq_len)
    vocab = trainer.layout.model.vocab_size
    sharding = trainer.batch_sharding

    def make():
        tokens = jax.random.randint(jax.random.key(seed), (shape[0], shape[1] + 1), 0, vocab, jnp.int32)
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": jnp.ones(shape, jnp.float32)}

    return jax.jit(make, out_shardings={"inputs": sharding, "targets": sharding, "mask": sharding})()


def memory_of(compiled) -> dict[str, int | None]:
    """Per-device bytes from XLA's ``memory_analysis()`` (None where this backend gives none)."""
    analysis = compiled.memory_analysis()
    names = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
             "alias_size_in_bytes", "generated_code_size_in_bytes", "host_argument_size_in_bytes",
             "host_output_size_in_bytes", "host_temp_size_in_bytes", "peak_memory_in_bytes")
    if analysis is None:
        return dict.fromkeys(names)
    return {name.replace("_size_in_bytes", "_bytes").replace("_in_bytes", "_bytes"): getattr(analysis, name, None)
            for name in names}


def baseline_step(trainer, guarded: bool = False):
    """The hand-written reference: jit(value_and_grad + optax update) with the trainer's shardings;
    ``guarded``: meshtrain's guard written by hand: the update applied (``lax.cond``) only where the
    loss and the gradient norm are finite, then every new parameter and moment checked (the loss is
    returned as NaN when one is not)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from meshtrain.parallel.sharding import activation_sharding
    from meshtrain.precision import cast_floating
    from meshtrain.trainer import all_finite, cross_entropy_sum
    from models.api import forward

    if trainer.mesh.shape["stage"] > 1 or trainer.layout.train.grad_accum > 1 or trainer.plan.offload.optimizer:
        raise SystemExit("error: --vs-baseline needs mesh.stage=1, train.grad_accum=1 and "
                         "offload.optimizer=false (the baseline is a plain step)")
    graphdef, tx = trainer.graphdef, trainer.tx
    dtype = trainer.layout.train.precision.compute_dtype
    shard = activation_sharding(trainer.rules, trainer.mesh)

    def loss_fn(params, batch):
        model = nnx.merge(graphdef, cast_floating(params, dtype))
        logits = forward(model, batch["inputs"], shard)
        count = jnp.maximum(jnp.sum(batch["mask"]), 1.0)
        return cross_entropy_sum(logits, batch["targets"], batch["mask"]) / count

    def apply_update(grads, params, opt_state):
        updates, new_opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_opt_state

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        if not guarded:
            return (*apply_update(grads, params, opt_state), loss)
        finite = jnp.isfinite(loss) & jnp.isfinite(optax.tree.norm(grads))
        params, opt_state = jax.lax.cond(finite, functools.partial(apply_update, grads), lambda *old: old,
                                         params, opt_state)
        return params, opt_state, jnp.where(all_finite((params, opt_state)), loss, jnp.nan)

    replicated = trainer.metrics_sharding
    shardings = (trainer.param_shardings, trainer.optimizer_compute_shardings)
    return jax.jit(step, in_shardings=(*shardings, trainer.batch_sharding),
                   out_shardings=(*shardings, replicated), donate_argnums=(0, 1))


def _timed(fn):
    import jax

    start = time.perf_counter()
    out = fn()
    jax.block_until_ready(out)
    return time.perf_counter() - start, out


def prepare(cfg, devices=None):
    """``(trainer, compiled train step, compile seconds)`` for ``cfg`` on ``devices`` (default: all)."""
    from meshtrain.mesh import make_mesh
    from meshtrain.trainer import Trainer

    mesh = make_mesh(cfg.mesh, devices)
    trainer = Trainer(cfg.layout(mesh.shape), mesh, cfg.optimizer)
    start = time.perf_counter()
    compiled = trainer.train_step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile()
    return trainer, compiled, time.perf_counter() - start


def run(cfg, *, steps: int = 10, vs_baseline: bool = False, devices=None, prepared=None,
        keep_times: bool = False) -> dict:
    """Compile (unless ``prepared`` by :func:`prepare`), warm up and time ``cfg``'s train step
    (``keep_times``: the result also lists every timed step's seconds, ``step_times_s``)."""
    import jax

    from meshtrain.mesh import mesh_shape
    from meshtrain.metrics import mfu, peak_bf16_tflops
    from models.api import family_of

    trainer, compiled, compile_s = prepared or prepare(cfg, devices)
    mesh = trainer.mesh
    state = trainer.init_state(seed=cfg.train.seed)
    batch = random_batch(trainer)
    state, metrics = compiled(state, batch)  # warm-up
    first_loss = float(metrics["loss"])

    baselines = {}  # name -> {"compiled", "params", "opt_state", "times", ...}
    if vs_baseline:
        for name, guarded in (("baseline", False), ("baseline_guarded", True)):
            fresh = trainer.init_state(seed=cfg.train.seed)
            params = fresh.params
            opt_state = jax.device_put(fresh.opt_state, trainer.optimizer_compute_shardings)
            start = time.perf_counter()
            base_compiled = baseline_step(trainer, guarded).lower(params, opt_state, batch).compile()
            base = {"compile_s": time.perf_counter() - start, "times": [], "memory": memory_of(base_compiled),
                    "bytes_accessed": bytes_accessed(base_compiled),
                    "collectives": collective_counts(base_compiled.as_text()), "compiled": base_compiled}
            base["params"], base["opt_state"], base_loss = base_compiled(params, opt_state, batch)  # warm-up
            base["first_loss"] = float(base_loss)
            baselines[name] = base

    def ours():
        nonlocal state, metrics
        elapsed, (state, metrics) = _timed(lambda: compiled(state, batch))
        times.append(elapsed)

    def theirs(base):
        elapsed, (base["params"], base["opt_state"], _) = _timed(
            lambda: base["compiled"](base["params"], base["opt_state"], batch))
        base["times"].append(elapsed)

    contenders = [ours, *(functools.partial(theirs, base) for base in baselines.values())]
    times = []
    for i in range(steps):
        for fn in contenders if i % 2 == 0 else contenders[::-1]:
            fn()

    num_devices = mesh.devices.size
    tokens = cfg.train.batch_size * cfg.model.seq_len
    flops = tokens * family_of(cfg.model).flops_per_token(cfg.model)
    median = statistics.median(times)
    tflops = flops / median / num_devices / 1e12
    device_kind = mesh.devices.flat[0].device_kind
    peak = peak_bf16_tflops(device_kind)
    result = {
        "device_kind": device_kind, "platform": mesh.devices.flat[0].platform, "devices": num_devices,
        "mesh": dict(zip(("data", "fsdp", "tensor", "stage"), mesh_shape(mesh))),
        "rules": cfg.sharding.preset.value if hasattr(cfg.sharding.preset, "value") else str(cfg.sharding.preset),
        "parameters": cfg.model.num_params, "flops_per_token": flops / tokens, "tokens_per_step": tokens,
        "steps_timed": steps,
        "compile_s": compile_s, "step_time_s_median": median, "step_time_s_min": min(times),
        "tokens_per_sec": tokens / median, "tflops_per_device": tflops, "mfu": mfu(tflops, peak),
        "loss_first": first_loss, "loss_last": float(metrics["loss"]),
        "memory_per_device": memory_of(compiled), "bytes_accessed": bytes_accessed(compiled),
        "collectives": collective_counts(compiled.as_text()),
    }
    if keep_times:
        result["step_times_s"] = times
    for name, base in baselines.items():
        result[name] = {"compile_s": base["compile_s"], "step_time_s_median": statistics.median(base["times"]),
                        "loss_first": base["first_loss"], "memory_per_device": base["memory"],
                        "bytes_accessed": base["bytes_accessed"],
                        "collectives": base["collectives"]}
        if keep_times:
            result[name]["step_times_s"] = base["times"]
    if baselines:
        result.update(_baseline_ratios(median, result["baseline"]["step_time_s_median"],
                                       result["baseline_guarded"]["step_time_s_median"]))
        plain_bytes, guarded_bytes = (result[name]["bytes_accessed"] for name in ("baseline", "baseline_guarded"))
        result["guard_bytes"] = None if None in (plain_bytes, guarded_bytes) else guarded_bytes - plain_bytes
    return result


def bytes_accessed(compiled) -> float | None:
    """XLA's ``cost_analysis()`` bytes read and written per device (loop bodies counted once)."""
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
    return None if not analysis or "bytes accessed" not in analysis else float(analysis["bytes accessed"])


def _baseline_ratios(ours: float, plain: float, guarded: float) -> dict[str, float]:
    """Medians' ratios: meshtrain over the plain and the guarded baseline, guarded over plain."""
    return {"overhead_ratio": ours / plain, "guarded_overhead_ratio": ours / guarded, "guard_ratio": guarded / plain}


def print_result(result: dict, out=None) -> None:
    out = out or sys.stdout
    for key, value in result.items():
        if isinstance(value, dict):
            value = json.dumps(value)
        elif value is None:
            value = "null"
        elif isinstance(value, float):
            value = f"{value:.6g}"
        print(f"{key}: {value}", file=out)
    print("json: " + json.dumps(result), file=out, flush=True)


# Layouts of the sweep on 8 devices: (name, mesh (data, fsdp, tensor, stage), preset, extra overrides).
LAYOUTS = (
    ("DP 8", (8, 1, 1, 1), "dp", []),
    ("FSDP 8", (1, 8, 1, 1), "fsdp", []),
    ("TP 8", (1, 1, 8, 1), "tp", []),
    ("FSDP 4 x TP 2", (1, 4, 2, 1), "fsdp_tp", []),
    ("DP 2 x FSDP 2 x TP 2", (2, 2, 2, 1), "fsdp_tp", []),
    ("PP 4 (1f1b, M=8) x FSDP 2", (1, 2, 1, 4), "fsdp_tp",
     ["pipeline.microbatches=8", "pipeline.schedule=1f1b"]),
)
# The sweep model: tiny's shape, 8 heads and 4 layers so that every layout divides it.
SWEEP_MODEL = ["model.num_layers=4", "model.num_heads=8", "model.num_kv_heads=8", "model.head_dim=16",
               "model.embed_dim=128", "model.mlp_dim=512", "model.seq_len=128", "model.vocab_size=256",
               "train.batch_size=32", "train.precision=fp32"]


def sweep_layouts(config: str, overrides: list[str], steps: int, out: str | None, layouts=LAYOUTS,
                  model: list[str] = SWEEP_MODEL) -> list[dict]:
    """Step time, memory and collectives of ``config`` (with ``model``'s overrides) in each layout."""
    from meshtrain.config import load_config

    rows = []
    for name, mesh, preset, extra in layouts:
        cfg = load_config(config, [*model, *overrides, *_layout_overrides(mesh, preset), *extra])
        result = run(cfg, steps=steps)
        rows.append({"layout": name, **result})
        mem = result["memory_per_device"]
        print(f"{name:<28} step {result['step_time_s_median'] * 1e3:8.1f} ms  {result['tokens_per_sec']:9,.0f} "
              f"tokens/s  args {mem['argument_bytes'] / 1e6:6.2f} MB  temp {mem['temp_bytes'] / 1e6:6.2f} MB  "
              f"compile {result['compile_s']:5.1f} s  {json.dumps(result['collectives'])}", flush=True)
    return _plotted(rows, out, _plot_layouts)


# Expert-parallel layouts of --sweep experts on 8 devices (the experts split over data x fsdp).
REPLICATED_EXPERTS = "sharding.rules.experts={params: null, activations: null}"
EXPERT_LAYOUTS = (
    ("EP 1 (replicated), DP 4 x TP 2", (4, 1, 2, 1), "fsdp_tp", [REPLICATED_EXPERTS]),
    ("EP 4 = DP 2 x FSDP 2, TP 2", (2, 2, 2, 1), "fsdp_tp", []),
    ("EP 4 = FSDP 4, TP 2", (1, 4, 2, 1), "fsdp_tp", []),
    ("EP 8 = FSDP 8", (1, 8, 1, 1), "fsdp_tp", []),
    ("EP 8 = DP 8", (8, 1, 1, 1), "dp", []),
)


def sweep_experts(config: str, overrides: list[str], steps: int, out: str | None) -> list[dict]:
    """``config``'s own model (a family with expert axes) in each of ``EXPERT_LAYOUTS``."""
    from meshtrain.config import load_config
    from models.api import AxisRole, family_of

    family = family_of(load_config(config, overrides).model)
    if AxisRole.EXPERT not in family.axis_roles.values():
        raise SystemExit(f"error: --sweep experts: family {family.name!r} of {config} has no expert axes; "
                         "give a mixture-of-experts config (e.g. --config configs/moe_tiny.yaml)")
    return sweep_layouts(config, overrides, steps, out, EXPERT_LAYOUTS, model=[])


def _layout_overrides(mesh: tuple[int, int, int, int], preset: str) -> list[str]:
    return [*(f"mesh.{axis}={size}" for axis, size in zip(("data", "fsdp", "tensor", "stage"), mesh)),
            f"sharding.preset={preset}"]


def _plotted(rows: list[dict], out: str | None, plot) -> list[dict]:
    if out:
        plot(rows, out)
        print(f"plot: {out}")
    return rows


# Long-sequence schemes of --sweep context on 8 devices: (name, mesh, preset). Equal batch (2 rows).
CONTEXT_LAYOUTS = (
    ("FSDP 2 x TP 4", (1, 2, 4, 1), "fsdp_tp"),
    ("FSDP 2 x TP 4 + SP", (1, 2, 4, 1), "fsdp_tp_sp"),
    ("CP 8 (all-gather)", (1, 8, 1, 1), "fsdp_cp"),
    ("CP 2 x TP 4", (1, 2, 4, 1), "fsdp_tp_cp"),
    ("CP 8 (ring, balanced)", (1, 8, 1, 1), "fsdp_cp_ring"),
)
CONTEXT_MODEL = ["model.num_layers=2", "model.num_heads=8", "model.num_kv_heads=4", "model.head_dim=16",
                 "model.embed_dim=128", "model.mlp_dim=512", "model.vocab_size=256", "train.batch_size=2",
                 "train.precision=fp32", "model.remat=full", "model.attention=xla"]


def host_bytes_needed(memory: dict, devices: int) -> int:
    """This host's memory for one step of a compiled program on ``devices`` simulated devices:
    arguments + outputs - aliased + temporaries, per device (``memory_of``), times the devices."""
    per_device = (memory["argument_bytes"] + memory["output_bytes"] - memory["alias_bytes"]
                  + memory["temp_bytes"])
    return per_device * devices


def sweep_context(config: str, overrides: list[str], seqs: list[int], steps: int, out: str | None,
                  host_budget_gb: float, only: str | None = None) -> list[dict]:
    """Per-device memory and tokens/s of each long-sequence scheme at each sequence length. A scheme
    whose compiled step needs more than ``host_budget_gb`` of this host's memory (all simulated
    devices together) is compiled and its memory reported, but not run (``tokens_per_sec`` None).
    ``only``: the schemes whose name contains it (e.g. ``ring``)."""
    from meshtrain.config import load_config

    rows = []
    for seq in seqs:
        for name, mesh, preset in CONTEXT_LAYOUTS:
            if only and only not in name:
                continue
            cfg = load_config(config, [*CONTEXT_MODEL, *overrides, f"model.seq_len={seq}",
                                       *_layout_overrides(mesh, preset)])
            prepared = prepare(cfg)
            memory = memory_of(prepared[1])
            needed = host_bytes_needed(memory, prepared[0].mesh.devices.size)
            if needed <= host_budget_gb * 1e9:
                result = run(cfg, steps=steps, prepared=prepared)
                speed = f"{result['tokens_per_sec']:9,.0f} tokens/s"
            else:
                result = {"memory_per_device": memory, "compile_s": prepared[2], "tokens_per_sec": None,
                          "collectives": collective_counts(prepared[1].as_text())}
                speed = f"not run: needs {needed / 1e9:.1f} GB of this host (--host-budget {host_budget_gb:g})"
            rows.append({"layout": name, "seq_len": seq, "host_bytes_needed": needed, **result})
            print(f"seq {seq:>6}  {name:<22} temp {memory['temp_bytes'] / 1e6:9.1f} MB  args "
                  f"{memory['argument_bytes'] / 1e6:6.2f} MB  {speed}  {json.dumps(result['collectives'])}", flush=True)
            del prepared
    return _plotted(rows, out, _plot_context)


def _plot_context(rows, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem_ax, speed_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in dict.fromkeys(row["layout"] for row in rows):
        mine = [row for row in rows if row["layout"] == name]
        seqs = [row["seq_len"] for row in mine]
        mem_ax.plot(seqs, [row["memory_per_device"]["temp_bytes"] / 1e6 for row in mine], marker="o", label=name)
        ran = [row for row in mine if row["tokens_per_sec"] is not None]
        speed_ax.plot([row["seq_len"] for row in ran], [row["tokens_per_sec"] for row in ran], marker="o", label=name)
    mem_ax.set_ylabel("temporaries per device, MB (memory_analysis)")
    mem_ax.set_yscale("log")
    speed_ax.set_ylabel("tokens/s (8 simulated CPU devices, 2 cores)")
    speed_ax.set_title("run where the step fits --host-budget", fontsize=9)
    for ax in (mem_ax, speed_ax):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)


def sweep_depth(config: str, overrides: list[str], depths: list[int]) -> list[dict]:
    """Compile time of the scanned model's train step vs number of layers (no steps run)."""
    from meshtrain.config import load_config
    from meshtrain.mesh import make_mesh
    from meshtrain.trainer import Trainer

    rows = []
    for depth in depths:
        cfg = load_config(config, [*overrides, f"model.num_layers={depth}"])
        mesh = make_mesh(cfg.mesh)
        trainer = Trainer(cfg.layout(mesh.shape), mesh, cfg.optimizer)
        start = time.perf_counter()
        lowered = trainer.train_step.lower(trainer.abstract_state(), trainer.abstract_batch())
        lower_s = time.perf_counter() - start
        lowered.compile()
        total = time.perf_counter() - start
        rows.append({"layers": depth, "lower_s": lower_s, "compile_s": total - lower_s, "total_s": total,
                     "parameters": cfg.model.num_params})
        print(f"layers {depth:>3}: trace+lower {lower_s:6.2f} s, compile {total - lower_s:6.2f} s, "
              f"total {total:6.2f} s", flush=True)
    print(f"ratio {depths[-1]} vs {depths[0]} layers (total): {rows[-1]['total_s'] / rows[0]['total_s']:.2f}")
    return rows


def maxtext_overrides(shape) -> list[str]:
    """meshtrain overrides for a ``bench_maxtext.Shape``: its model, batch, mesh, precision and remat."""
    precision = {"bfloat16": "bf16", "float32": "fp32"}[shape.dtype]
    return [f"model.embed_dim={shape.embed}", f"model.num_layers={shape.layers}", f"model.mlp_dim={shape.mlp}",
            f"model.num_heads={shape.heads}", f"model.num_kv_heads={shape.num_kv_heads}",
            f"model.head_dim={shape.head_dim}", f"model.vocab_size={shape.vocab}", f"model.seq_len={shape.seq}",
            f"model.remat={shape.remat}", "model.attention=xla", f"train.batch_size={shape.batch}",
            "train.grad_accum=1", f"train.precision={precision}",
            *_layout_overrides((1, shape.fsdp, shape.tensor, 1), "fsdp_tp")]


def _runs_summary(runs: list[dict]) -> dict:
    """Pooled median and mean, each run's median and their spread ((max - min) / min) of one framework."""
    medians, pooled = [r["step_time_s_median"] for r in runs], [t for r in runs for t in r["step_times_s"]]
    return {"step_time_s_median": statistics.median(pooled), "step_time_s_mean": statistics.fmean(pooled),
            "run_medians_s": medians, "spread": max(medians) / min(medians) - 1}


def vs_maxtext(config: str, overrides: list[str], shape_name: str, steps: int, rounds: int = 2,
               dtype: str = "bfloat16", vs_baseline: bool = False) -> dict:
    """meshtrain and MaxText (``bench_maxtext``) on one shape in compute ``dtype``, ``rounds`` times
    each in ABBA order (``vs_baseline``: meshtrain's runs also time the hand-written step,
    interleaved with meshtrain's)."""
    import bench_maxtext
    import jax

    from meshtrain.config import load_config

    shape = dataclasses.replace(bench_maxtext.SHAPES[shape_name], dtype=dtype)
    cfg = load_config(config, [*maxtext_overrides(shape), *overrides])
    prepared = prepare(cfg)
    runs = {"meshtrain": [], "maxtext": []}
    order = []
    for i in range(rounds):
        for name in ("meshtrain", "maxtext") if i % 2 == 0 else ("maxtext", "meshtrain"):
            if name == "meshtrain":
                result = run(cfg, steps=steps, prepared=prepared, keep_times=True, vs_baseline=vs_baseline)
            else:
                result = bench_maxtext.run_maxtext(shape, steps=steps)
            runs[name].append(result)
            order.append(name)
            print(f"run {len(order)}: {name:<9} median {result['step_time_s_median']:.3f} s, mean "
                  f"{statistics.fmean(result['step_times_s']):.3f} s, min {result['step_time_s_min']:.3f} s "
                  f"({steps} steps)", flush=True)
    mesh, theirs = _runs_summary(runs["meshtrain"]), _runs_summary(runs["maxtext"])
    rounds_ratio = [a["step_time_s_median"] / b["step_time_s_median"]
                    for a, b in zip(runs["meshtrain"], runs["maxtext"])]
    summary = {
        "shape": shape_name, "shape_fields": dataclasses.asdict(shape),
        "parameters": cfg.model.num_params, "steps_per_run": steps, "order": order,
        "meshtrain": {**mesh, "compile_s": prepared[2], "jax": jax.__version__,
                      "loss_first": runs["meshtrain"][0]["loss_first"]},
        "maxtext": {**theirs, "warmup_steps": runs["maxtext"][0]["warmup_steps"], "jax": runs["maxtext"][0]["jax"],
                    "loss_first": runs["maxtext"][0]["loss_first"]},
        "ratio": mesh["step_time_s_median"] / theirs["step_time_s_median"], "round_ratios": rounds_ratio,
    }
    if vs_baseline:
        for name in ("baseline", "baseline_guarded"):
            base_times = [t for r in runs["meshtrain"] for t in r[name]["step_times_s"]]
            summary[name] = {"step_time_s_median": statistics.median(base_times),
                             "run_medians_s": [r[name]["step_time_s_median"] for r in runs["meshtrain"]]}
        summary.update(_baseline_ratios(mesh["step_time_s_median"], summary["baseline"]["step_time_s_median"],
                                        summary["baseline_guarded"]["step_time_s_median"]))
    for name, part in (("meshtrain", mesh), ("maxtext", theirs)):
        print(f"{name}: median {part['step_time_s_median']:.3f} s per step (mean {part['step_time_s_mean']:.3f} s); "
              f"runs {', '.join(f'{m:.3f}' for m in part['run_medians_s'])} s (spread {part['spread']:.1%})")
    print(f"ratio meshtrain/maxtext: {summary['ratio']:.3f} (rounds {', '.join(f'{r:.3f}' for r in rounds_ratio)})",
          flush=True)
    if vs_baseline:
        print(f"baseline: median {summary['baseline']['step_time_s_median']:.3f} s per step, guarded "
              f"{summary['baseline_guarded']['step_time_s_median']:.3f} s; overhead_ratio meshtrain/baseline: "
              f"{summary['overhead_ratio']:.3f}, meshtrain/guarded: {summary['guarded_overhead_ratio']:.3f}, "
              f"guard_ratio guarded/baseline: {summary['guard_ratio']:.3f}", flush=True)
    return summary


def precision_speedups(by_dtype: dict[str, dict]) -> dict[str, float]:
    """Per framework (and the baseline where timed): fp32 median step / bf16 median step."""
    fp32, bf16 = by_dtype["float32"], by_dtype["bfloat16"]
    names = [name for name in ("meshtrain", "maxtext", "baseline") if name in fp32 and name in bf16]
    return {name: fp32[name]["step_time_s_median"] / bf16[name]["step_time_s_median"] for name in names}


def _plot_layouts(rows, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [row["layout"] for row in rows]
    fig, (time_ax, mem_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    time_ax.barh(names, [row["step_time_s_median"] * 1e3 for row in rows])
    time_ax.set_xlabel("median step time, ms (8 simulated CPU devices)")
    args = [row["memory_per_device"]["argument_bytes"] / 1e6 for row in rows]
    temp = [row["memory_per_device"]["temp_bytes"] / 1e6 for row in rows]
    mem_ax.barh(names, args, label="arguments")
    mem_ax.barh(names, temp, left=args, label="temporaries")
    mem_ax.set_xlabel("per-device memory, MB (XLA memory_analysis)")
    mem_ax.legend()
    mem_ax.set_yticklabels([])
    for ax in (time_ax, mem_ax):
        ax.invert_yaxis()
        ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    import bench_maxtext

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (after one warm-up)")
    parser.add_argument("--host-devices", type=int, metavar="N", help="simulate N CPU devices")
    parser.add_argument("--vs-baseline", action="store_true",
                        help="also time a hand-written jax.jit step, interleaved, and print the ratio")
    parser.add_argument("--vs-maxtext", action="store_true",
                        help="time MaxText (scripts/install_maxtext.sh) and meshtrain on --shape, in ABBA order")
    parser.add_argument("--shape", choices=sorted(bench_maxtext.SHAPES), default="issue",
                        help="--vs-maxtext: issue #13's 20.6M Llama, or 8 layers of embed 512 (bench_maxtext.SHAPES)")
    parser.add_argument("--rounds", type=int, default=2, help="--vs-maxtext: runs of each framework")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), nargs="+", default=["bfloat16"],
                        help="--vs-maxtext: compute dtype(s) of both (master weights fp32 in both); both "
                             "dtypes: each is run in turn and the bf16-over-fp32 speedups are printed")
    parser.add_argument("--attention", choices=("auto", "xla", "cudnn"), default="auto",
                        help="model.attention: jax.nn.dot_product_attention's implementation (cudnn: GPU only)")
    parser.add_argument("--sweep", choices=("layouts", "depth", "context", "experts"),
                        help="run a sweep instead of one config")
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768],
                        help="sequence lengths of --sweep context")
    parser.add_argument("--schemes", metavar="TEXT", help="--sweep context: only the schemes whose name contains TEXT")
    parser.add_argument("--host-budget", type=float, default=12.0, metavar="GB",
                        help="--sweep context: run a scheme only if its step needs at most this much host memory")
    parser.add_argument("--depths", type=int, nargs="+", default=[2, 32], help="layer counts of --sweep depth")
    parser.add_argument("--out", help="--sweep layouts / context / experts: PNG plot path")
    parser.add_argument("--json", dest="json_path", help="also write the result(s) as JSON to this file")
    parser.add_argument("overrides", nargs="*", metavar="section.field=value")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")

    from meshtrain import xla_flags
    from meshtrain.cli import use_host_devices

    if args.vs_maxtext:
        if bench_maxtext.installation() is None:
            print(bench_maxtext.NOT_INSTALLED)
            return 0
        args.host_devices = args.host_devices or bench_maxtext.SHAPES[args.shape].devices
    if args.host_devices is not None:
        use_host_devices(args.host_devices)
    else:
        added = xla_flags.apply_recommended()
        if added:
            print(f"xla_flags_added: {' '.join(added)}", flush=True)
    import jax

    from meshtrain.config import load_config

    header = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "jax": jax.__version__, "command": " ".join(["python scripts/bench.py", *(argv or sys.argv[1:])])}
    if args.vs_maxtext:
        by_dtype = {}
        for dtype in dict.fromkeys(args.dtype):
            print(f"dtype: {dtype}", flush=True)
            by_dtype[dtype] = vs_maxtext(args.config, args.overrides, args.shape, args.steps, args.rounds, dtype,
                                         args.vs_baseline)
        results = {**header, **by_dtype[args.dtype[0]]} if len(by_dtype) == 1 else {**header, "by_dtype": by_dtype}
        if len(by_dtype) == 2:
            results["bf16_over_fp32"] = precision_speedups(by_dtype)
            print("bf16 over fp32 (fp32 median / bf16 median): " + ", ".join(
                f"{name} {x:.2f}x" for name, x in results["bf16_over_fp32"].items()), flush=True)
        print_result(results)
    elif args.sweep == "layouts":
        results = sweep_layouts(args.config, args.overrides, args.steps, args.out)
    elif args.sweep == "depth":
        results = sweep_depth(args.config, args.overrides, args.depths)
    elif args.sweep == "context":
        results = sweep_context(args.config, args.overrides, args.seqs, args.steps, args.out, args.host_budget,
                                args.schemes)
    elif args.sweep == "experts":
        results = sweep_experts(args.config, args.overrides, args.steps, args.out)
    else:
        cfg = load_config(args.config, [*args.overrides, f"model.attention={args.attention}"])
        results = run(cfg, steps=args.steps, vs_baseline=args.vs_baseline)
        results = {**header, "attention": args.attention, **results}
        print_result(results)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({**header, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

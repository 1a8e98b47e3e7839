"""Timing a config's train step, and the hand-written step it is measured against.

:func:`run` compiles (:func:`prepare`), warms up and times the trainer's step on random batches
(:func:`random_batch`): step time, tokens/s, TFLOP/s per device, MFU, compile time, XLA's memory and
byte counts and the collectives (``meshtrain.measure.hlo``). With ``vs_baseline`` it also times, interleaved,
:func:`baseline_step`: a minimal hand-written train step of the same model (plain ``jax.jit`` of
value_and_grad + the same optax update, the trainer's shardings, loss and compute dtype), plain and
with meshtrain's non-finite guard written by hand. ``scripts/bench*.py`` and ``scripts/gpu_check.py``
print these results; the tests compare the trainer against the hand-written step.
"""

from __future__ import annotations

import functools
import statistics
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from meshtrain.loss import cross_entropy_sum
from meshtrain.measure.hlo import bytes_accessed, collective_counts, memory_of
from meshtrain.mesh import make_mesh, mesh_shape
from meshtrain.metrics import mfu, peak_bf16_tflops
from meshtrain.parallel.activations import activation_sharding
from meshtrain.precision import cast_floating
from meshtrain.trainer import Trainer, all_finite
from models.api import family_of, forward


def random_batch(trainer: Trainer, seed: int = 0) -> dict:
    """A global batch of uniform random tokens in the trainer's batch sharding."""
    shape = (trainer.layout.train.batch_size, trainer.layout.model.seq_len)
    vocab = trainer.layout.model.vocab_size
    sharding = trainer.batch_sharding

    def make():
        tokens = jax.random.randint(jax.random.key(seed), (shape[0], shape[1] + 1), 0, vocab, jnp.int32)
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": jnp.ones(shape, jnp.float32)}

    return jax.jit(make, out_shardings={"inputs": sharding, "targets": sharding, "mask": sharding})()


def baseline_step(trainer: Trainer, guarded: bool = False):
    """The hand-written reference: jit(value_and_grad + optax update) with the trainer's shardings;
    ``guarded``: meshtrain's guard written by hand: the update applied (``lax.cond``) only where the
    loss and the gradient norm are finite, then every new parameter and moment checked (the loss is
    returned as NaN when one is not)."""
    if trainer.mesh.shape["stage"] > 1 or trainer.layout.train.grad_accum > 1 or trainer.layout.offload.optimizer:
        raise SystemExit("error: --vs-baseline needs mesh.stage=1, train.grad_accum=1 and "
                         "offload.optimizer=false (the baseline is a plain step)")
    graphdef, tx = trainer.graphdef, trainer.tx
    dtype = trainer.layout.train.compute_dtype
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


def baseline_ratios(ours: float, plain: float, guarded: float) -> dict[str, float]:
    """Medians' ratios: meshtrain over the plain and the guarded baseline, guarded over plain."""
    return {"overhead_ratio": ours / plain, "guarded_overhead_ratio": ours / guarded, "guard_ratio": guarded / plain}


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    jax.block_until_ready(out)
    return time.perf_counter() - start, out


def prepare(cfg, devices=None):
    """``(trainer, compiled train step, compile seconds)`` for ``cfg`` on ``devices`` (default: all)."""
    mesh = make_mesh(cfg.mesh, devices)
    trainer = Trainer(cfg.layout(mesh.shape), mesh, cfg.optimizer)
    start = time.perf_counter()
    compiled = trainer.train_step.lower(trainer.abstract_state(), trainer.abstract_batch()).compile()
    return trainer, compiled, time.perf_counter() - start


def run(cfg, *, steps: int = 10, vs_baseline: bool = False, devices=None, prepared=None,
        keep_times: bool = False) -> dict:
    """Compile (unless ``prepared`` by :func:`prepare`), warm up and time ``cfg``'s train step: one
    warm-up step, then ``steps`` steps timed one by one (each waits for its result), the median
    reported (``keep_times``: the result also lists every timed step's seconds, ``step_times_s``).
    ``vs_baseline``: both hand-written steps too, interleaved with meshtrain's (order reversed every
    step), with ``overhead_ratio``, ``guarded_overhead_ratio``, ``guard_ratio`` and ``guard_bytes``."""
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
    flops = tokens * family_of(cfg.model).costs(cfg.model).flops_per_token()
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
        result.update(baseline_ratios(median, result["baseline"]["step_time_s_median"],
                                      result["baseline_guarded"]["step_time_s_median"]))
        plain_bytes, guarded_bytes = (result[name]["bytes_accessed"] for name in ("baseline", "baseline_guarded"))
        result["guard_bytes"] = None if None in (plain_bytes, guarded_bytes) else guarded_bytes - plain_bytes
    return result


def compare(configs: dict, *, steps: int = 10, devices=None) -> dict:
    """Each of ``configs``' train steps (name -> config) compiled, warmed up and timed with the others'
    interleaved (order reversed every step, so machine noise hits them all): per name, its median
    step seconds, tokens/s, first and last loss, compile seconds, memory per device, and
    ``vs_first``: its median over the first config's."""
    arms = {}
    for name, cfg in configs.items():
        trainer, compiled, compile_s = prepare(cfg, devices)
        state, batch = trainer.init_state(seed=cfg.train.seed), random_batch(trainer)
        state, metrics = compiled(state, batch)  # warm-up
        arms[name] = {"compiled": compiled, "state": state, "batch": batch, "times": [], "compile_s": compile_s,
                      "loss_first": float(metrics["loss"]), "tokens": cfg.train.batch_size * cfg.model.seq_len}

    def step(arm):
        elapsed, (arm["state"], arm["metrics"]) = _timed(lambda: arm["compiled"](arm["state"], arm["batch"]))
        arm["times"].append(elapsed)

    names = list(arms)
    for i in range(steps):
        for name in names if i % 2 == 0 else names[::-1]:
            step(arms[name])
    first = statistics.median(arms[names[0]]["times"])
    return {name: {"step_time_s_median": statistics.median(arm["times"]),
                   "tokens_per_sec": arm["tokens"] / statistics.median(arm["times"]),
                   "vs_first": statistics.median(arm["times"]) / first, "compile_s": arm["compile_s"],
                   "loss_first": arm["loss_first"], "loss_last": float(arm["metrics"]["loss"]),
                   "memory_per_device": memory_of(arm["compiled"])}
            for name, arm in arms.items()}

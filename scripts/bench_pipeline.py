"""Pipeline schedules side by side: step time, bubble, per-device FLOPs against theory, temp memory.

Each schedule is a table (``meshtrain.parallel.schedules``); the bubble and the peak of in-flight
chunk activations are read from it (F = 1, B = 2, I = W = 1).

    python scripts/bench_pipeline.py [--stages 4] [--microbatches 4 8 16 32] [--steps 3]
        [--out runs/bench_pipeline.png]

The plot goes to ``--out`` (default ``runs/bench_pipeline.png``, an ignored directory); the figure in
docs/pipeline.md is refreshed by naming it: ``--out docs/img/pipeline_bench.png``.

Every run uses the same model and the same microbatch size (``--rows`` sequences), so the global
batch grows with M. "none" is the same model and batch without a pipeline on one device. On
simulated CPU devices the stages share the host's cores: step times show the schedule's total work
and overhead, not a multi-device speed-up; the memory column is XLA's own per-device analysis. The
FLOPs column is what each device executes (``meshtrain.measure.flops``: the traced step with scan trip counts),
as a multiple of the ideal ``(single-device FLOPs / S) / (1 - bubble)``.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--rows", type=int, default=2, help="sequences per microbatch")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    parser.add_argument("--out", default="runs/bench_pipeline.png",
                        help="PNG plot path (default: runs/bench_pipeline.png; docs/pipeline.md's figure is "
                             "docs/img/pipeline_bench.png)")
    args = parser.parse_args()

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", max(8, args.stages))
    from meshtrain.data import DataConfig, global_batch, make_dataset
    from meshtrain.measure.flops import count_flops
    from meshtrain.mesh import MeshConfig, make_mesh
    from meshtrain.optim import OptimizerConfig
    from meshtrain.parallel.layout import Layout
    from meshtrain.parallel.pipeline import PipelineConfig, Schedule
    from meshtrain.parallel.rules import Preset
    from meshtrain.train_config import TrainConfig
    from meshtrain.trainer import Trainer
    from models.llama import LlamaConfig

    model = LlamaConfig(vocab_size=2048, embed_dim=64, num_layers=8, num_heads=4, num_kv_heads=4,
                        head_dim=16, mlp_dim=256, seq_len=64)
    schedules = {"gpipe": (Schedule.GPIPE, 1), "1f1b": (Schedule.ONE_F_ONE_B, 1),
                 "interleaved": (Schedule.INTERLEAVED, 2), "zb_h1": (Schedule.ZB_H1, 1)}
    dataset = make_dataset(DataConfig(), vocab_size=model.vocab_size, seq_len=model.seq_len)

    def measure(mesh_shape, pipeline, batch_size):
        mesh = make_mesh(MeshConfig(*mesh_shape), jax.devices()[: math.prod(mesh_shape)])
        layout = Layout.of(model, mesh.shape, Preset.FSDP_TP.rules, TrainConfig(steps=100, batch_size=batch_size),
                           pipeline)
        trainer = Trainer(layout, mesh, OptimizerConfig())
        state = trainer.init_state(seed=0)
        batch = global_batch(dataset, 0, batch_size, trainer.batch_sharding)
        flops = count_flops(trainer.step, trainer.abstract_state(), trainer.abstract_batch()).flops
        step = trainer.train_step.lower(state, batch).compile()
        state, metrics = step(state, batch)  # warm-up
        jax.block_until_ready(metrics)
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - start)
        return statistics.median(times), step.memory_analysis().temp_size_in_bytes, flops

    rows = []
    header = (f"{'M':>3} {'schedule':<12} {'step s':>8} {'vs none':>8} {'bubble':>7} {'GFLOP/dev':>10} "
              f"{'vs ideal':>8} {'in flight':>9} {'temp MB':>9}")
    print(f"S={args.stages}, {args.rows} sequences x {model.seq_len} tokens per microbatch, "
          f"{model.num_params:,} parameters, {jax.devices()[0].device_kind}")
    print(header)
    for micro in args.microbatches:
        batch_size = micro * args.rows
        none_time, none_temp, none_flops = measure((1, 1, 1, 1), PipelineConfig(), batch_size)
        rows.append((micro, "none", none_time, 1.0, 0.0, none_temp))
        print(f"{micro:>3} {'none':<12} {none_time:>8.3f} {1.0:>8.2f} {0.0:>7.1%} {none_flops / 1e9:>10.3f} "
              f"{1.0:>8.2f} {'':>9} {none_temp / 1e6:>9.2f}", flush=True)
        for name, (schedule, virtual) in schedules.items():
            pipeline = PipelineConfig(micro, schedule, virtual)
            step_time, temp, flops = measure((1, 1, 1, args.stages), pipeline, batch_size)
            table = pipeline.schedule_table(args.stages)
            bubble = table.bubble()
            ideal = none_flops / args.stages / (1 - bubble)
            rows.append((micro, name, step_time, step_time / none_time, bubble, temp))
            print(f"{micro:>3} {name:<12} {step_time:>8.3f} {step_time / none_time:>8.2f} {bubble:>7.1%} "
                  f"{flops / 1e9:>10.3f} {flops / ideal:>8.2f} {table.peak_in_flight:>9} {temp / 1e6:>9.2f}",
                  flush=True)
    _plot(rows, args.out, args.stages)
    print(f"plot: {args.out}")


def _plot(rows, path, stages) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (time_ax, memory_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for name in dict.fromkeys(row[1] for row in rows):
        series = [row for row in rows if row[1] == name]
        micro = [row[0] for row in series]
        time_ax.plot(micro, [row[2] for row in series], marker="o", label=name)
        memory_ax.plot(micro, [row[5] / 1e6 for row in series], marker="o", label=name)
    for ax, title, unit in ((time_ax, "step time", "s"), (memory_ax, "temp memory per device", "MB")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("microbatches M (fixed microbatch size)")
        ax.set_ylabel(unit)
        ax.set_title(f"{title}, S={stages}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()

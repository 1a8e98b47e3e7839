"""The parallel layouts side by side on 8 devices: step time, per-device memory and collectives.

    python scripts/bench_layouts.py --host-devices 8 [--config configs/tiny.yaml] [--steps 10]
        [--out docs/img/layout_bench.png] [--json FILE] [section.field=value ...]

Each layout of ``LAYOUTS`` runs the config with the sweep model's overrides (``SWEEP_MODEL``: tiny's
shape with 8 heads and 4 layers, so that every layout divides it), timed as ``scripts/bench.py`` times
one config (``meshtrain.measure.benchmark.run``).
"""

from __future__ import annotations

import argparse
import json
import sys

import bench_common

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
    from meshtrain.measure import benchmark
    from meshtrain.config import load_config

    rows = []
    for name, mesh, preset, extra in layouts:
        cfg = load_config(config, [*model, *overrides, *bench_common.layout_overrides(mesh, preset), *extra])
        result = benchmark.run(cfg, steps=steps)
        rows.append({"layout": name, **result})
        mem = result["memory_per_device"]
        print(f"{name:<28} step {result['step_time_s_median'] * 1e3:8.1f} ms  {result['tokens_per_sec']:9,.0f} "
              f"tokens/s  args {mem['argument_bytes'] / 1e6:6.2f} MB  temp {mem['temp_bytes'] / 1e6:6.2f} MB  "
              f"compile {result['compile_s']:5.1f} s  {json.dumps(result['collectives'])}", flush=True)
    return bench_common.plotted(rows, out, plot_layouts)


def plot_layouts(rows, path) -> None:
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
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    bench_common.add_arguments(parser)
    parser.add_argument("--out", help="PNG plot path")
    args = parser.parse_args(argv)
    header = bench_common.start(parser, args, "bench_layouts.py", argv)
    results = sweep_layouts(args.config, args.overrides, args.steps, args.out)
    bench_common.write_json(args.json_path, header, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

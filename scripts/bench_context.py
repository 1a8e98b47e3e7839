"""Long-sequence schemes against sequence length on 8 devices: per-device memory and tokens/s.

    python scripts/bench_context.py --host-devices 8 [--seqs 1024 ... 32768] [--schemes ring]
        [--host-budget GB] [--steps 10] [--out PNG] [--json FILE] [section.field=value ...]

Each scheme of ``CONTEXT_LAYOUTS`` (tensor, sequence and context parallelism; equal batch, 2 rows) at
each sequence length, on ``CONTEXT_MODEL``'s shape. A scheme whose compiled step needs more than
``--host-budget`` of this host's memory (all simulated devices together) is compiled and its memory
reported, but not run (``tokens_per_sec`` null).
"""

from __future__ import annotations

import argparse
import json
import sys

import bench_common

# Long-sequence schemes on 8 devices: (name, mesh, preset). Equal batch (2 rows).
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


def sweep_context(config: str, overrides: list[str], seqs: list[int], steps: int, out: str | None,
                  host_budget_gb: float, only: str | None = None) -> list[dict]:
    """Per-device memory and tokens/s of each long-sequence scheme at each sequence length (``only``:
    the schemes whose name contains it, e.g. ``ring``)."""
    from meshtrain.measure import benchmark
    from meshtrain.config import load_config
    from meshtrain.measure.hlo import collective_counts, footprint_bytes, memory_of

    rows = []
    for seq in seqs:
        for name, mesh, preset in CONTEXT_LAYOUTS:
            if only and only not in name:
                continue
            cfg = load_config(config, [*CONTEXT_MODEL, *overrides, f"model.seq_len={seq}",
                                       *bench_common.layout_overrides(mesh, preset)])
            prepared = benchmark.prepare(cfg)
            memory = memory_of(prepared[1])
            needed = footprint_bytes(memory) * prepared[0].mesh.devices.size  # all simulated devices
            if needed <= host_budget_gb * 1e9:
                result = benchmark.run(cfg, steps=steps, prepared=prepared)
                speed = f"{result['tokens_per_sec']:9,.0f} tokens/s"
            else:
                result = {"memory_per_device": memory, "compile_s": prepared[2], "tokens_per_sec": None,
                          "collectives": collective_counts(prepared[1].as_text())}
                speed = f"not run: needs {needed / 1e9:.1f} GB of this host (--host-budget {host_budget_gb:g})"
            rows.append({"layout": name, "seq_len": seq, "host_bytes_needed": needed, **result})
            print(f"seq {seq:>6}  {name:<22} temp {memory['temp_bytes'] / 1e6:9.1f} MB  args "
                  f"{memory['argument_bytes'] / 1e6:6.2f} MB  {speed}  {json.dumps(result['collectives'])}", flush=True)
            del prepared
    return bench_common.plotted(rows, out, plot_context)


def plot_context(rows, path) -> None:
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
        bench_common.sequence_axis(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    bench_common.add_arguments(parser)
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768],
                        help="sequence lengths")
    parser.add_argument("--schemes", metavar="TEXT", help="only the schemes whose name contains TEXT")
    parser.add_argument("--host-budget", type=float, default=12.0, metavar="GB",
                        help="run a scheme only if its step needs at most this much host memory")
    parser.add_argument("--out", help="PNG plot path")
    args = parser.parse_args(argv)
    header = bench_common.start(parser, args, "bench_context.py", argv)
    results = sweep_context(args.config, args.overrides, args.seqs, args.steps, args.out, args.host_budget,
                            args.schemes)
    bench_common.write_json(args.json_path, header, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

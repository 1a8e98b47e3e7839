"""Attention kernels against sequence length: per-device temporaries of the compiled train step.

    python scripts/bench_attention.py --host-devices 8 [--seqs 2048 8192 32768] [--cp 2 4 8]
        [--ring-seq 8192] [--steps 0] [--json FILE] [--out PNG] [section.field=value ...]

One device, ``--config`` (default configs/tiny.yaml) with batch 1 in fp32: the train step compiled from
abstract shapes (no parameters allocated) with the dense kernel (``model.attention=xla``, the
``[heads, queries, keys]`` score block) and the blockwise one, on rows of one sequence and on rows
packed from documents (``data.packing: documents``: segment ids, the document mask). Printed side by
side with the ratio of each length's temporaries to the previous one's. Then ring attention
(``fsdp_cp_ring``) over CP devices at ``--ring-seq`` tokens, and the CP 8 / CP 2 ratio. ``--steps N``
also times N steps of the blockwise kernel at each length (after one warm-up).
"""

from __future__ import annotations

import argparse
import sys

import bench_common

KERNELS = ("xla", "blockwise")


def compiled_temp_bytes(config: str, overrides: list[str], devices: int, packed: bool):
    """(trainer, compiled step, temporaries in bytes) of ``config`` with ``overrides`` on ``devices``."""
    import jax

    from meshtrain.config import load_config
    from meshtrain.mesh import make_mesh
    from meshtrain.trainer import Trainer

    cfg = load_config(config, overrides)
    mesh = make_mesh(cfg.mesh, jax.devices()[:devices])
    trainer = Trainer(cfg.layout(mesh.shape), mesh, cfg.optimizer)
    compiled = trainer.train_step.lower(trainer.abstract_state(), trainer.abstract_batch(documents=packed)).compile()
    return trainer, compiled, compiled.memory_analysis().temp_size_in_bytes


def sweep(config: str, overrides: list[str], seqs: list[int], steps: int) -> list[dict]:
    """Temporaries of each kernel on unpacked and packed rows at each sequence length, one device."""
    from meshtrain.measure import benchmark

    one_device = ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "mesh.stage=1", "train.batch_size=1",
                  "train.precision=fp32"]
    rows = []
    for packed in (False, True):
        for kernel in KERNELS:
            previous = None
            for index, seq in enumerate(seqs):
                trainer, compiled, temp = compiled_temp_bytes(
                    config, [*one_device, *overrides, f"model.seq_len={seq}", f"model.attention={kernel}"], 1, packed)
                row = {"kernel": kernel, "packed": packed, "seq_len": seq, "temp_bytes": temp,
                       "ratio_to_previous": None if previous is None else temp / previous}
                if steps and kernel == "blockwise" and not packed:
                    row["step_s"] = _time_steps(benchmark, trainer, compiled, steps)
                rows.append(row)
                growth = "" if previous is None else f"  x{temp / previous:5.2f} for x{seq // seqs[index - 1]}"
                timing = f"  {row['step_s']:.2f} s/step" if "step_s" in row else ""
                print(f"{'packed' if packed else 'rows  '}  {kernel:<9}  seq {seq:>6}  temp {temp / 1e6:10.1f} MB"
                      f"{growth}{timing}", flush=True)
                previous = temp
    return rows


def _time_steps(benchmark, trainer, compiled, steps: int) -> float:
    import statistics
    import time

    import jax

    state, batch = trainer.init_state(seed=0), benchmark.random_batch(trainer)
    state, _ = compiled(state, batch)  # warm-up
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def ring_sweep(config: str, overrides: list[str], seq: int, sizes: list[int]) -> list[dict]:
    """Per-device temporaries of ring attention over CP devices at ``seq`` tokens, batch 1."""
    rows = []
    for cp in sizes:
        _, _, temp = compiled_temp_bytes(config, [
            "mesh.data=1", f"mesh.fsdp={cp}", "mesh.tensor=1", "mesh.stage=1", "sharding.preset=fsdp_cp_ring",
            "train.batch_size=1", "train.precision=fp32", *overrides, f"model.seq_len={seq}"], cp, False)
        rows.append({"scheme": "fsdp_cp_ring", "cp": cp, "seq_len": seq, "temp_bytes": temp})
        print(f"ring  CP {cp}  seq {seq:>6}  temp per device {temp / 1e6:9.1f} MB  "
              f"(x{temp / rows[0]['temp_bytes']:.2f} of CP {sizes[0]})", flush=True)
    return rows


def plot(rows, path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kernel in KERNELS:
        for packed in (False, True):
            mine = [row for row in rows if row.get("kernel") == kernel and row.get("packed") is packed]
            ax.plot([row["seq_len"] for row in mine], [row["temp_bytes"] / 1e6 for row in mine], marker="o",
                    label=f"{kernel}{', packed documents' if packed else ''}")
    ax.set_yscale("log")
    ax.set_ylabel("temporaries per device, MB (memory_analysis)")
    bench_common.sequence_axis(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    bench_common.add_arguments(parser, steps=0)
    parser.add_argument("--seqs", type=int, nargs="+", default=[2048, 8192, 32768], help="sequence lengths")
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8], help="ring sizes")
    parser.add_argument("--ring-seq", type=int, default=8192, help="tokens of the ring sweep")
    parser.add_argument("--out", help="PNG plot path")
    args = parser.parse_args(argv)
    if args.steps < 0:
        parser.error("--steps must be >= 0")
    header = bench_common.start(parser, argparse.Namespace(**{**vars(args), "steps": max(args.steps, 1)}),
                                "bench_attention.py", argv)
    rows = sweep(args.config, args.overrides, args.seqs, args.steps)
    rows += ring_sweep(args.config, args.overrides, args.ring_seq, args.cp)
    bench_common.plotted(rows, args.out, plot)
    bench_common.write_json(args.json_path, header, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

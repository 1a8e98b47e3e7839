"""Compile time of the scanned model's train step against its number of layers (no step is run).

    python scripts/bench_depth.py --host-devices 8 [--config configs/tiny.yaml] [--depths 2 32]
        [--json FILE] [section.field=value ...]

For each depth: trace + lower seconds, compile seconds and their total; last, the total of the last
depth over the first's.
"""

from __future__ import annotations

import argparse
import sys
import time

import bench_common


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    bench_common.add_arguments(parser)
    parser.add_argument("--depths", type=int, nargs="+", default=[2, 32], help="layer counts")
    args = parser.parse_args(argv)
    header = bench_common.start(parser, args, "bench_depth.py", argv)
    bench_common.write_json(args.json_path, header, sweep_depth(args.config, args.overrides, args.depths))
    return 0


if __name__ == "__main__":
    sys.exit(main())

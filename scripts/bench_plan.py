"""How long ``meshtrain.plan`` takes to answer: each config on each device count, side by side.

    python scripts/bench_plan.py [--devices 8 64 512 1024] [--device-memory 141GB] [--json FILE]
        [--configs configs/llama_8b.yaml ...]

Runs ``make_plan`` in this process (no compilation: the analytic estimates only) for every config
and device count, over the sharding presets the CLI searches by default (``search_presets``), and
prints the wall time, the layouts enumerated and how many fit, in one table.
Issue 34's bound is 10 s per answer on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import time

from meshtrain.config import load_config
from meshtrain.plan import parse_bytes
from meshtrain.planner.search import make_plan, search_presets

CONFIGS = ("configs/llama_8b.yaml", "configs/llama_70b.yaml", "configs/mixtral_8x7b.yaml",
           "configs/qwen3_moe_30b_a3b.yaml", "configs/deepseek_v3_671b.yaml")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    parser.add_argument("--devices", nargs="+", type=int, default=[8, 64, 512, 1024])
    parser.add_argument("--device-memory", default="141GB")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args(argv)
    memory = parse_bytes(args.device_memory, "--device-memory")
    rows = []
    print(f"{'config':<32} {'devices':>7} {'seconds':>8} {'layouts':>8} {'fit':>6}", flush=True)
    for path in args.configs:
        cfg = load_config(path)
        for devices in args.devices:
            started = time.perf_counter()
            plan = make_plan(cfg, devices, memory, presets=search_presets(cfg))
            seconds = time.perf_counter() - started
            fit = sum(1 for est in plan.estimates if plan.fits(est))
            rows.append({"config": path, "devices": devices, "seconds": seconds,
                         "layouts": len(plan.estimates), "fit": fit})
            print(f"{path:<32} {devices:>7} {seconds:>8.2f} {len(plan.estimates):>8} {fit:>6}", flush=True)
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as file:
            json.dump(rows, file, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

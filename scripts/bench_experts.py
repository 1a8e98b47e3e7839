"""A mixture-of-experts config under expert parallelism of 1 (experts replicated), 4 and 8 ways.

    python scripts/bench_experts.py --host-devices 8 --config configs/moe_tiny.yaml [--steps 10]
        [--out docs/img/moe_ep_bench.png] [--json FILE] [section.field=value ...]

The config's own model (a family with expert axes) in each of ``EXPERT_LAYOUTS`` on 8 devices (the
experts split over data x fsdp), timed as ``scripts/bench_layouts.py`` times a layout. FLOPs per token
are the family's, of the active parameters (``top_k`` experts).
"""

from __future__ import annotations

import argparse
import sys

import bench_common
from bench_layouts import sweep_layouts

# Expert-parallel layouts on 8 devices (the experts split over data x fsdp).
REPLICATED_EXPERTS = "sharding.rules.experts={params: null, activations: null}"
EXPERT_LAYOUTS = (
    ("EP 1 (replicated), DP 4 x TP 2", (4, 1, 2, 1), "fsdp_tp", [REPLICATED_EXPERTS]),
    ("EP 4 = DP 2 x FSDP 2, TP 2", (2, 2, 2, 1), "fsdp_tp", []),
    ("EP 4 = FSDP 4, TP 2", (1, 4, 2, 1), "fsdp_tp", []),
    ("EP 8 = FSDP 8", (1, 8, 1, 1), "fsdp_tp", []),
    ("EP 8 = DP 8", (8, 1, 1, 1), "dp", []),
)


def sweep_experts(config: str, overrides: list[str], steps: int, out: str | None,
                  layouts=EXPERT_LAYOUTS) -> list[dict]:
    """``config``'s own model (a family with expert axes) in each of ``layouts``."""
    from meshtrain.config import load_config
    from models.api import AxisRole, family_of

    family = family_of(load_config(config, overrides).model)
    if AxisRole.EXPERT not in family.axis_roles.values():
        raise SystemExit(f"error: family {family.name!r} of {config} has no expert axes; "
                         "give a mixture-of-experts config (e.g. --config configs/moe_tiny.yaml)")
    return sweep_layouts(config, overrides, steps, out, layouts, model=[])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    bench_common.add_arguments(parser)
    parser.add_argument("--layouts", type=int, metavar="N", help="only the first N of EXPERT_LAYOUTS")
    parser.add_argument("--out", help="PNG plot path")
    args = parser.parse_args(argv)
    header = bench_common.start(parser, args, "bench_experts.py", argv)
    results = sweep_experts(args.config, args.overrides, args.steps, args.out, EXPERT_LAYOUTS[:args.layouts])
    bench_common.write_json(args.json_path, header, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""meshtrain against MaxText on one Llama or Mixtral shape: ABBA rounds, each framework's median and the ratio.

    python scripts/bench_vs_maxtext.py [--shape issue|large|tiny|moe|moe_tiny] [--steps 20] [--rounds 2]
        [--dtype bfloat16 float32] [--vs-baseline] [--json FILE] [section.field=value ...]

Times MaxText (``scripts/bench_maxtext.py``, in its own venv made by ``scripts/install_maxtext.sh``)
and meshtrain on one ``--shape`` (model, global batch, mesh fsdp x tensor, bf16 compute, full remat;
``meshtrain.measure.maxtext.SHAPES``; without ``--config``, a dense shape starts from ``configs/tiny.yaml`` and a
shape with experts from ``configs/moe_tiny.yaml``, every field the shape names overridden: the MoE
dropless, its tokens sorted by expert, as MaxText's sparse path), ``--rounds`` runs of ``--steps``
steps each, alternating which goes first (ABBA): each run's median, each framework's pooled median
and spread, and ratio = meshtrain / MaxText.
``--vs-baseline`` adds both hand-written steps (``scripts/bench.py --vs-baseline``) to meshtrain's runs
(interleaved with it) and prints their medians and the three ratios; ``--dtype bfloat16 float32`` runs
the whole comparison in each compute dtype in turn and prints each one's bf16-over-fp32 speedup (fp32
median / bf16 median). Without MaxText installed it prints one line and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys

import bench_common
import bench_maxtext

from meshtrain.measure.maxtext import SHAPES, default_config, maxtext_overrides


def runs_summary(runs: list[dict]) -> dict:
    """Pooled median and mean, each run's median and their spread ((max - min) / min) of one framework."""
    medians, pooled = [r["step_time_s_median"] for r in runs], [t for r in runs for t in r["step_times_s"]]
    return {"step_time_s_median": statistics.median(pooled), "step_time_s_mean": statistics.fmean(pooled),
            "run_medians_s": medians, "spread": max(medians) / min(medians) - 1}


def vs_maxtext(config: str, overrides: list[str], shape_name: str, steps: int, rounds: int = 2,
               dtype: str = "bfloat16", vs_baseline: bool = False) -> dict:
    """meshtrain and MaxText (``bench_maxtext``) on one shape in compute ``dtype``, ``rounds`` times
    each in ABBA order (``vs_baseline``: meshtrain's runs also time the hand-written step,
    interleaved with meshtrain's)."""
    import jax

    from meshtrain.measure import benchmark
    from meshtrain.config import load_config

    shape = dataclasses.replace(SHAPES[shape_name], dtype=dtype)
    cfg = load_config(config, [*maxtext_overrides(shape), *overrides])
    prepared = benchmark.prepare(cfg)
    runs = {"meshtrain": [], "maxtext": []}
    order = []
    for i in range(rounds):
        for name in ("meshtrain", "maxtext") if i % 2 == 0 else ("maxtext", "meshtrain"):
            if name == "meshtrain":
                result = benchmark.run(cfg, steps=steps, prepared=prepared, keep_times=True, vs_baseline=vs_baseline)
            else:
                result = bench_maxtext.run_maxtext(shape, steps=steps)
            runs[name].append(result)
            order.append(name)
            print(f"run {len(order)}: {name:<9} median {result['step_time_s_median']:.3f} s, mean "
                  f"{statistics.fmean(result['step_times_s']):.3f} s, min {result['step_time_s_min']:.3f} s "
                  f"({steps} steps)", flush=True)
    mesh, theirs = runs_summary(runs["meshtrain"]), runs_summary(runs["maxtext"])
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
        summary.update(benchmark.baseline_ratios(mesh["step_time_s_median"],
                                                 summary["baseline"]["step_time_s_median"],
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    bench_common.add_arguments(parser, steps=20)
    parser.set_defaults(config=None)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="issue",
                        help="issue #13's 20.6M Llama, 8 layers of embed 512, issue #32's Mixtral-like MoE, "
                             "or a smoke-test shape (SHAPES)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each framework")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), nargs="+", default=["bfloat16"],
                        help="compute dtype(s) of both (master weights fp32 in both); both dtypes: each is run "
                             "in turn and the bf16-over-fp32 speedups are printed")
    parser.add_argument("--vs-baseline", action="store_true",
                        help="also time the hand-written jax.jit steps with meshtrain's, interleaved")
    args = parser.parse_args(argv)
    if bench_maxtext.installation() is None:
        print(bench_maxtext.NOT_INSTALLED)
        return 0
    args.host_devices = args.host_devices or SHAPES[args.shape].devices
    args.config = args.config or default_config(SHAPES[args.shape])
    header = bench_common.start(parser, args, "bench_vs_maxtext.py", argv)
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
    bench_common.print_result(results)
    bench_common.write_json(args.json_path, header, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

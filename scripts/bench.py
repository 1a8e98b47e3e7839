"""Benchmark meshtrain's train step: step time, tokens/s, TFLOP/s per device, MFU, compile time, memory.

    python scripts/bench.py --config configs/tiny.yaml --host-devices 8 [--steps 10] [--vs-baseline]
        [--vs-precision fp32|bf16|fp16|fp8] [--attention auto|xla|cudnn] [--json FILE] [section.field=value ...]

The other benchmarks, one script each (same ``--config``, ``--steps``, ``--host-devices``, ``--json``):
``bench_layouts.py`` (the parallel layouts side by side), ``bench_experts.py`` (expert parallelism),
``bench_context.py`` (long-sequence schemes against sequence length), ``bench_depth.py`` (compile time
against depth), ``bench_vs_maxtext.py`` (against MaxText), ``bench_pipeline.py`` (pipeline schedules),
``bench_checkpoint.py`` and ``bench_prepare.py``.

Batches are random tokens of the config's shape (no data file is read). After one warm-up step,
``--steps`` steps are timed one by one (each waits for its result); the median is reported
(``meshtrain.measure.benchmark.run``).

``--vs-baseline`` builds, in the same process and on the same mesh, a minimal hand-written train step
of the same model (``meshtrain.measure.benchmark.baseline_step``): plain ``jax.jit`` of value_and_grad + the
same optax AdamW over the same parameter pytree, with the same parameter, optimizer-state, batch and
activation shardings, the same loss and the same compute dtype. A second hand-written step,
``baseline_guarded``, adds what meshtrain's step does beyond that: the gradient and update norms, and
the update kept only where loss and both norms are finite. Their steps are interleaved with
meshtrain's (order reversed every step), so machine noise hits all three; printed: ``overhead_ratio``
= median meshtrain / median baseline, ``guarded_overhead_ratio`` = median meshtrain / median
baseline_guarded (the trainer against a hand-written step of the same work) and ``guard_ratio`` =
median baseline_guarded / median baseline (what the non-finite guard costs by itself). Each of the
three also reports ``bytes_accessed``, XLA's ``cost_analysis()`` count of the bytes its compiled step
reads and writes per device: a scan's body is counted once, so the figure is not the step's traffic,
but the layers' scan is the same in all three and the optimizer update runs outside any loop, so
differences between them are the extra passes over parameter-sized buffers (``guard_bytes`` = guarded
- plain baseline), free of timing noise.

``--vs-precision P`` times the config as given and the same config with ``train.precision=P``
(e.g. ``fp8`` against the config's ``bf16``), steps interleaved (``meshtrain.measure.benchmark.compare``), and
prints ``precision_ratio`` = median step with P / median step as given, with each arm's figures.

Every result is printed as ``name: value`` lines and, last, one ``json: {...}`` line.
MFU is ``null`` when the device's peak is unknown (CPU). FLOPs are the family's
``flops_per_token`` (for a mixture of experts: the active parameters, ``top_k`` experts).
"""

from __future__ import annotations

import argparse
import sys

import bench_common


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    bench_common.add_arguments(parser)
    parser.add_argument("--vs-baseline", action="store_true",
                        help="also time a hand-written jax.jit step, interleaved, and print the ratio")
    parser.add_argument("--vs-precision", choices=("fp32", "bf16", "fp16", "fp8"),
                        help="also time the config with train.precision set to this, interleaved, and print the ratio")
    parser.add_argument("--attention", choices=("auto", "xla", "cudnn"), default="auto",
                        help="model.attention: jax.nn.dot_product_attention's implementation (cudnn: GPU only)")
    args = parser.parse_args(argv)
    header = bench_common.start(parser, args, "bench.py", argv)
    from meshtrain.measure import benchmark
    from meshtrain.config import load_config

    overrides = [*args.overrides, f"model.attention={args.attention}"]
    cfg = load_config(args.config, overrides)
    if args.vs_precision == cfg.train.precision.value:
        parser.error(f"--vs-precision {args.vs_precision} is the config's own train.precision")
    if args.vs_precision:
        other = load_config(args.config, [*overrides, f"train.precision={args.vs_precision}"])
        arms = benchmark.compare({cfg.train.precision.value: cfg, args.vs_precision: other}, steps=args.steps)
        results = {**header, "attention": args.attention, **{f"{name}_{key}": value for name, arm in arms.items()
                                                            for key, value in arm.items() if key != "vs_first"},
                   "precision_ratio": arms[args.vs_precision]["vs_first"]}
    else:
        results = {**header, "attention": args.attention, **benchmark.run(cfg, steps=args.steps,
                                                                          vs_baseline=args.vs_baseline)}
    bench_common.print_result(results)
    bench_common.write_json(args.json_path, header, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

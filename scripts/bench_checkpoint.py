"""Orbax's save overhead per step: the training loop with a checkpoint every step against none.

    python scripts/bench_checkpoint.py [--config configs/tiny.yaml] [--steps 60] [--warmup 10]
        [--host-devices 8] [section.field=value ...]

Runs ``meshtrain.loop.train`` on the same config in one process: without checkpoints, then with a
save after every step and after every 10th, each asynchronous and synchronous. Each run logs every
step; the step time is the mean of ``step_time_s`` in metrics.jsonl after ``--warmup`` steps (the
first save also compiles orbax's slicing of replicated arrays), i.e. the amortised cost per step.
The overhead is that mean minus the mean without checkpoints. ``--steps`` - ``--warmup`` should be a
multiple of 10. Run directories go to a temporary directory that is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import tempfile

MODES = {"none": ["checkpoint.enabled=false"],
         "async, every step": ["checkpoint.every=1", "checkpoint.async_save=true"],
         "sync, every step": ["checkpoint.every=1", "checkpoint.async_save=false"],
         "async, every 10": ["checkpoint.every=10", "checkpoint.async_save=true"],
         "sync, every 10": ["checkpoint.every=10", "checkpoint.async_save=false"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10, help="leading steps left out of the median")
    parser.add_argument("--host-devices", type=int, default=8, help="simulated CPU devices (0: real devices)")
    parser.add_argument("overrides", nargs="*", metavar="section.field=value")
    args = parser.parse_args()

    if args.host_devices:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    if args.host_devices:
        jax.config.update("jax_num_cpu_devices", args.host_devices)
    from meshtrain.config import load_config
    from meshtrain.loop import train

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_checkpoint_") as tmp:
        for name, extra in MODES.items():
            run_dir = pathlib.Path(tmp) / name.replace(" ", "_").replace(",", "")
            cfg = load_config(args.config, [*args.overrides, f"train.steps={args.steps}", "train.log_every=1",
                                            "run.loggers=[]", f"run.dir={run_dir}", "checkpoint.keep=2",
                                            *extra])
            summary = train(cfg)
            records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            times = [r["step_time_s"] for r in records if r["step"] > args.warmup]
            size = sum(p.stat().st_size for p in (run_dir / "checkpoints" / str(args.steps)).rglob("*")
                       if p.is_file()) if name != "none" else 0
            rows.append((name, statistics.mean(times), size, summary["parameters"]))
    base = rows[0][1]
    print(f"\n{rows[0][3]:,} parameters, {len(jax.devices())} x {jax.devices()[0].device_kind}, "
          f"mean over steps {args.warmup + 1}..{args.steps}")
    print(f"{'checkpointing':<20} {'step time':>12} {'overhead/step':>14} {'checkpoint size':>16}")
    for name, mean, size, _ in rows:
        size_text = f"{size / 1e6:.2f} MB" if size else "-"
        print(f"{name:<20} {mean * 1e3:>9.1f} ms {(mean - base) * 1e3:>11.1f} ms {size_text:>16}")


if __name__ == "__main__":
    main()

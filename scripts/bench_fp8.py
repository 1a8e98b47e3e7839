"""FP8 against bf16 on one config, in one run: the loss curves of bf16, FP8 with current scaling and
FP8 with delayed scaling (``train.precision: fp8``), each arm's final loss beside bf16's, and the
seconds per step.

    python scripts/bench_fp8.py --host-devices 8 --steps 500 --out docs/img/fp8_convergence.png

Every arm trains the same config from the same seed on the same batches (``--steps`` train steps,
logged every ``--log-every``); "final" is the mean loss of the last ``--tail`` logged steps, less
noisy than one step's; a config with ``eval`` also reports each arm's last held-out loss. On a CPU
an FP8 matmul converts its operands to fp32 inside (no FP8 units), so the step times there say
nothing of a GPU's; on an H100/H200 XLA runs FP8 GEMMs.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile

import bench_common

ARMS = {"bf16": ["train.precision=bf16"],
        "fp8-current": ["train.precision=fp8", "train.fp8.scaling=current"],
        "fp8-delayed": ["train.precision=fp8", "train.fp8.scaling=delayed"]}


def _losses(run_dir: pathlib.Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r and "step_time_s" in r}


def _step_times(run_dir: pathlib.Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step_time_s"] for r in records if "step_time_s" in r]


def run_arm(config: str, overrides: list[str], arm: list[str], steps: int, log_every: int, root: pathlib.Path,
            name: str) -> dict:
    from meshtrain.config import load_config
    from meshtrain.loop import train

    run_dir = root / name
    cfg = load_config(config, [*overrides, *arm, f"train.steps={steps}", f"train.log_every={log_every}",
                               f"run.dir={run_dir}", "run.loggers=[]", "checkpoint.every=0"])
    summary = train(cfg)
    times = _step_times(run_dir)
    return {"losses": _losses(run_dir), "skipped_steps": summary["skipped_steps"],
            "step_s": sorted(times)[len(times) // 2] if times else None, "eval_loss": summary.get("eval_loss")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_common.add_arguments(parser, steps=500)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--tail", type=int, default=5, help="logged steps averaged into the final loss")
    parser.add_argument("--out", help="write the loss curves as a PNG here")
    args = parser.parse_args(argv)
    header = bench_common.start(parser, args, "bench_fp8.py", argv)
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: run_arm(args.config, args.overrides, arm, args.steps, args.log_every, pathlib.Path(tmp), name)
                for name, arm in ARMS.items()}
    final = {name: sum(list(run["losses"].values())[-args.tail:]) / args.tail for name, run in runs.items()}
    result = {**header, "config": args.config, "steps": args.steps}
    for name, run in runs.items():
        result[f"{name}_final_loss"] = final[name]
        result[f"{name}_vs_bf16"] = final[name] / final["bf16"]
        result[f"{name}_skipped_steps"] = run["skipped_steps"]
        if run["eval_loss"] is not None:  # the config evaluates on held-out data
            result[f"{name}_eval_loss"] = run["eval_loss"]
        result[f"{name}_step_s"] = run["step_s"]
    bench_common.print_result(result)
    bench_common.write_json(args.json_path, header, result)
    bench_common.plotted(list(runs.items()), args.out, lambda rows, out: _plot(rows, out, args.config))


def _plot(rows: list, out: str, config: str) -> None:
    """Left: every arm's loss by step; right: each FP8 arm's loss over bf16's at the same step."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 4))
    curves, ratios = figure.subplots(1, 2)
    runs = dict(rows)
    for name, run in rows:
        steps, losses = list(run["losses"]), list(run["losses"].values())
        curves.plot(steps, losses, label=name, linewidth=1)
        if name != "bf16":
            ratios.plot(steps, [loss / runs["bf16"]["losses"][step] for step, loss in zip(steps, losses)],
                        label=f"{name} / bf16", linewidth=1)
    curves.set(xlabel="step", ylabel="train loss", title=f"FP8 against bf16: {config}")
    ratios.axhline(1.0, color="gray", linewidth=0.8)
    ratios.set(xlabel="step", ylabel="loss ratio", title="FP8 loss over bf16 loss, step by step")
    for ax in (curves, ratios):
        ax.grid(alpha=0.3)
        ax.legend()
    figure.savefig(out, dpi=120, bbox_inches="tight")


if __name__ == "__main__":
    main()

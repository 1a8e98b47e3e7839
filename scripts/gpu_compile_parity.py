"""One train step compiled twice for the same card, on it and without it: ``scripts/gpu_check.py``'s
``compile_parity`` phase runs this in two processes (XLA flags are read once per process).

    python scripts/gpu_compile_parity.py deviceless --target h100|h200|b200 --out DIR [--autotune FILE] [overrides]
    python scripts/gpu_compile_parity.py device --out DIR [overrides]

``deviceless`` (any machine with the CUDA plugin; ``jax_platforms=cpu``): ``meshtrain.gpu_compile`` compiles
``configs/llama_1b.yaml`` with the overrides for one compile-only GPU of the target (with ``--autotune``,
the GEMM choices a GPU dumped: ``--xla_gpu_load_autotune_results_from``), writes the executable
serialized (``DIR/deviceless.pkl``: ``jax.experimental.serialize_executable``) and prints its memory.
``device`` (on the GPU): the same step compiled by the card's own XLA, dumping its autotune results
(``DIR/autotune_results.txt``) and its target config (``DIR/xla/*gpu_target_config.pbtxt``); then the
deviceless executable loaded and run on this GPU beside the device-compiled one, from the same state and
batch. Each mode prints one ``json: {...}`` line.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import pickle
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIG = "configs/llama_1b.yaml"
ONE_DEVICE = ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "mesh.stage=1"]


def _memory(compiled) -> dict:
    from meshtrain.measure.hlo import memory_of

    memory = memory_of(compiled)
    return {key: memory[key] for key in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes")}


def deviceless(args: argparse.Namespace, overrides: list[str]) -> dict:
    from meshtrain.gpu_compile import Target, compile_step, start_compile_only, topology
    from meshtrain.xla_flags import apply_recommended, merge_flags

    start_compile_only()
    apply_recommended(force=True)
    if args.autotune:
        os.environ["XLA_FLAGS"] = merge_flags(os.environ.get("XLA_FLAGS", ""),
                                              [f"--xla_gpu_load_autotune_results_from={args.autotune}"])
    from jax.experimental.serialize_executable import serialize

    from meshtrain.config import load_config

    target = Target(args.target)
    step = compile_step(load_config(str(REPO / CONFIG), ONE_DEVICE + overrides), topology(target, 1, 1), target)
    (args.out / "deviceless.pkl").write_bytes(pickle.dumps(serialize(step.compiled)))
    return {"mode": "deviceless", "target": target.value, "autotune": args.autotune, **_memory(step.compiled),
            "compile_seconds": step.report.compile_seconds}


def device(args: argparse.Namespace, overrides: list[str]) -> dict:
    from meshtrain.xla_flags import apply_recommended, merge_flags

    apply_recommended()
    os.environ["XLA_FLAGS"] = merge_flags(os.environ.get("XLA_FLAGS", ""), [
        f"--xla_gpu_dump_autotune_results_to={args.out / 'autotune_results.txt'}",
        f"--xla_dump_to={args.out / 'xla'}", "--xla_dump_hlo_module_re=jit_step"])
    import jax
    import numpy as np
    from jax.experimental.serialize_executable import deserialize_and_load

    from meshtrain.measure import benchmark
    from meshtrain.config import load_config

    cfg = load_config(str(REPO / CONFIG), ONE_DEVICE + overrides)
    trainer, compiled, seconds = benchmark.prepare(cfg, jax.devices()[:1])
    result = {"mode": "device", "device_kind": jax.devices()[0].device_kind, **_memory(compiled),
              "compile_seconds": seconds,
              "target_config": sorted(str(p.name) for p in (args.out / "xla").glob("*gpu_target_config.pbtxt"))}
    serialized = args.out / "deviceless.pkl"
    if serialized.exists():
        loaded = deserialize_and_load(*pickle.loads(serialized.read_bytes()))
        batch = benchmark.random_batch(trainer)
        losses = [float(step(trainer.init_state(seed=0), batch)[1]["loss"]) for step in (compiled, loaded)]
        result.update(device_loss=losses[0], deviceless_loss=losses[1],
                      deviceless_runs=bool(np.isfinite(losses[1])), loss_diff=abs(losses[0] - losses[1]))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=("deviceless", "device"))
    parser.add_argument("--target", default="h100")
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--autotune", help="autotune results a GPU dumped (deviceless mode)")
    args, overrides = parser.parse_known_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    result = (deviceless if args.mode == "deviceless" else device)(args, overrides)
    print("json: " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m meshtrain.train --config configs/tiny.yaml [section.field=value ...]``

Flags: ``--host-devices N`` simulates N CPU devices; ``--print-config`` prints the resolved config;
``--print-sharding`` prints the per-parameter sharding table. Both print flags exit without training.
Bad input prints one ``error: field: what is wrong`` line and exits 2.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import jax
import yaml

from meshtrain.config import Config, load_config, to_dict
from meshtrain.data import global_batch, make_dataset
from meshtrain.errors import ConfigError
from meshtrain.mesh import make_mesh, mesh_shape
from meshtrain.metrics import (MetricsLogger, format_bytes, mfu, peak_bf16_tflops,
                               train_flops_per_token)
from meshtrain.parallel.sharding import parameter_table, replicated_parameters
from meshtrain.trainer import Trainer


class _ArgumentParser(argparse.ArgumentParser):
    """Reports bad arguments as a ``ConfigError`` (one line, exit 2) instead of usage + exit."""

    def error(self, message: str):
        raise ConfigError("arguments", message)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _ArgumentParser(prog="python -m meshtrain.train", description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="YAML config file (default: the dataclass defaults of every section)")
    parser.add_argument("--host-devices", type=int, metavar="N",
                        help="simulate N CPU devices (must be given before JAX starts)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--print-sharding", action="store_true",
                        help="print the per-parameter sharding table and exit")
    parser.add_argument("overrides", nargs="*", metavar="section.field=value")
    return parser.parse_args(argv)


def use_host_devices(count: int) -> None:
    """Run on ``count`` simulated CPU devices; only possible before JAX's backends start."""
    if count < 1:
        raise ConfigError("--host-devices", f"must be a positive integer, got {count}")
    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError as err:
        raise ConfigError("--host-devices", f"JAX already started its backends: {err}") from None


def _log(message: str) -> None:
    if jax.process_index() == 0:
        print(message, file=sys.stderr, flush=True)


class _StepReporter:
    """Reads a step's metrics when it is due for logging and adds time, tokens/s, TFLOP/s, MFU."""

    def __init__(self, cfg: Config, logger: MetricsLogger, num_devices: int, peak_tflops: float | None):
        self.steps, self.log_every, self.logger = cfg.train.steps, cfg.train.log_every, logger
        self.tokens_per_step = cfg.train.batch_size * cfg.model.seq_len
        self.flops_per_step = self.tokens_per_step * train_flops_per_token(
            matmul_params=cfg.model.matmul_params, num_layers=cfg.model.num_layers,
            seq_len=cfg.model.seq_len, attention_dim=cfg.model.attention_dim)
        self.num_devices, self.peak_tflops = num_devices, peak_tflops
        self.last_time, self.last_done = time.perf_counter(), 0
        self.final_metrics: dict[str, float] = {}  # the last logged values (the last step's)

    def report(self, step: int, metrics: dict[str, jax.Array]) -> None:
        done = step + 1  # steps completed
        if not (step == 0 or done % self.log_every == 0 or done == self.steps):
            return
        values = {key: float(value) for key, value in jax.device_get(metrics).items()}
        now = time.perf_counter()
        step_time = (now - self.last_time) / (done - self.last_done)
        self.last_time, self.last_done = now, done
        tflops = self.flops_per_step / step_time / self.num_devices / 1e12
        self.logger.log(done, {**values, "tokens_per_sec": self.tokens_per_step / step_time,
                               "step_time_s": step_time, "tflops_per_device": tflops,
                               "mfu": mfu(tflops, self.peak_tflops)})
        self.final_metrics = values


def train(cfg: Config, *, print_sharding: bool = False) -> dict[str, object]:
    """Runs ``cfg`` to completion; returns the end-of-run summary."""
    mesh = make_mesh(cfg.mesh)
    rules = cfg.sharding.resolve()
    trainer = Trainer(cfg.model, cfg.train, cfg.optimizer, rules, mesh)
    if print_sharding:
        print(parameter_table(trainer.abstract_params, rules, mesh))
        return {}
    for name in replicated_parameters(trainer.abstract_params, rules, mesh,
                                      cfg.sharding.replicated_warning_bytes):
        _log(f"warning: {name} stays fully replicated on mesh {dict(mesh.shape)} under rules {rules.name}")
    dataset = make_dataset(cfg.data, vocab_size=cfg.model.vocab_size, seq_len=cfg.model.seq_len)
    devices = jax.devices()
    _log(f"meshtrain: process {jax.process_index()}/{jax.process_count()}, {len(devices)} x "
         f"{devices[0].device_kind}, mesh (data, fsdp, tensor, stage) = {mesh_shape(mesh)}, rules "
         f"{rules.name}, {cfg.model.num_params:,} parameters, precision {cfg.train.precision.value}")
    _log(dataset.describe())

    run_dir = pathlib.Path(cfg.run.dir)
    if jax.process_index() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))

    steps, batch_size = cfg.train.steps, cfg.train.batch_size
    state = trainer.init_state(cfg.train.seed)
    batch = global_batch(dataset, 0, batch_size, trainer.batch_sharding)
    compile_start = time.perf_counter()
    train_step = trainer.train_step.lower(state, batch).compile()
    compile_s = time.perf_counter() - compile_start
    memory = train_step.memory_analysis()
    _log(f"compiled in {compile_s:.1f} s; per device: arguments {format_bytes(memory.argument_size_in_bytes)}, "
         f"temporaries {format_bytes(memory.temp_size_in_bytes)}")

    logger = MetricsLogger(run_dir, steps, is_primary=jax.process_index() == 0,
                           tensorboard=cfg.run.tensorboard)
    reporter = _StepReporter(cfg, logger, num_devices=len(devices),
                             peak_tflops=peak_bf16_tflops(devices[0].device_kind))
    previous = None
    for step in range(steps):
        if step:
            batch = global_batch(dataset, step, batch_size, trainer.batch_sharding)
        state, metrics = train_step(state, batch)  # dispatched asynchronously
        if previous is not None:
            reporter.report(*previous)  # reads step N-1 while step N runs
        previous = (step, metrics)
    reporter.report(*previous)

    final = reporter.final_metrics
    summary = {"final_loss": final["loss"], "entropy_floor": dataset.entropy_floor,
               "skipped_steps": int(final["skipped_steps"]), "compile_s": round(compile_s, 2),
               "mesh": dict(mesh.shape), "rules": rules.name, "parameters": cfg.model.num_params,
               "argument_bytes_per_device": memory.argument_size_in_bytes,
               "temp_bytes_per_device": memory.temp_size_in_bytes}
    logger.close(summary)
    return summary


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parse_args(argv)
        if args.host_devices is not None:
            use_host_devices(args.host_devices)
        cfg = load_config(args.config, args.overrides)
        if args.print_config:
            print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
            return 0
        train(cfg, print_sharding=args.print_sharding)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

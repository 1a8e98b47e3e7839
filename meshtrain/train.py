"""``python -m meshtrain.train --config configs/tiny.yaml [section.field=value ...]``: the command line.

Flags: ``--host-devices N`` simulates N CPU devices; ``--print-config`` prints the resolved config
(the ``base:`` chain and the overrides applied), each value with a ``# from FILE``, ``# from the command
line`` or ``# default`` comment; ``--print-sharding`` prints the per-parameter sharding table. Both print
flags exit without training.
``--fresh`` refuses to resume from checkpoints already in ``run.dir``.
Bad input prints one ``error: field: what is wrong`` line and exits 2.

The run itself is ``meshtrain.loop.train``: it resumes from the latest complete checkpoint in
``run.dir/checkpoints``; SIGTERM/SIGINT finish the current step, save, and exit 0 with one line saying
how to resume. With ``train.on_nonfinite=stop`` a non-finite loss or gradient norm saves the last good
state and exits 3; a step that leaves non-finite parameters or moments exits 3 under either policy,
its state not saved.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys

from meshtrain import distributed
from meshtrain.checkpoint import SaveFailed
from meshtrain.cli import EXIT_USER_ERROR, ArgumentParser, run, use_host_devices
from meshtrain.config import annotated_yaml, resolve_config
from meshtrain.errors import ConfigError
from meshtrain.loop import train
from meshtrain.policies import NonFiniteStop
from meshtrain.xla_flags import apply_recommended

EXIT_NONFINITE = 3


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(prog="python -m meshtrain.train", description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="YAML config file (default: the dataclass defaults of every section)")
    parser.add_argument("--host-devices", type=int, metavar="N",
                        help="simulate N CPU devices (must be given before JAX starts)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config, where each value came from as a comment, and exit")
    parser.add_argument("--print-sharding", action="store_true",
                        help="print the per-parameter sharding table and exit")
    parser.add_argument("--fresh", action="store_true",
                        help="refuse to resume: fail if run.dir already holds checkpoints")
    multi = parser.add_argument_group("multi-process (see docs/multihost.md; the distributed section)")
    multi.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's coordinator address")
    multi.add_argument("--num-processes", type=int, metavar="N", help="number of processes of the run")
    multi.add_argument("--process-id", type=int, metavar="I", help="this process's rank, 0..N-1")
    multi.add_argument("--local-device-ids", metavar="I,J,...",
                       help="local accelerators this process uses (among the visible ones)")
    return parser.parse_args(argv)


def _distributed_flags(args: argparse.Namespace, cfg: distributed.DistributedConfig) -> distributed.DistributedConfig:
    """The ``distributed`` section with the multi-process flags applied. The flags stay out of the
    run's config (and so out of the ``config.yaml`` a resume reads): they differ per process."""
    flags = {"coordinator": args.coordinator, "num_processes": args.num_processes, "process_id": args.process_id}
    if args.local_device_ids is not None:
        if not re.fullmatch(r"\d+(,\d+)*", args.local_device_ids):
            raise ConfigError("--local-device-ids", f"must be comma-separated integers, got {args.local_device_ids!r}")
        flags["local_device_ids"] = tuple(int(i) for i in args.local_device_ids.split(","))
    try:
        return dataclasses.replace(cfg, **{key: value for key, value in flags.items() if value is not None})
    except ConfigError as err:
        raise ConfigError("--" + err.field.replace("_", "-"), err.message) from None


def _main(argv: list[str] | None) -> int:
    """The command; ``cli.run`` turns a ConfigError or MemoryError into one line and exit 2."""
    try:
        args = _parse_args(argv)
        command = "python -m meshtrain.train"
        if args.host_devices is not None:
            use_host_devices(args.host_devices)
            command += f" --host-devices {args.host_devices}"
        else:  # GPU runs: the recommended XLA flags (meshtrain/xla_flags.py), before backends start
            apply_recommended()
        cfg, sources = resolve_config(args.config, args.overrides)
        if args.print_config:
            print(annotated_yaml(cfg, sources), end="")
        else:
            distributed.initialize(_distributed_flags(args, cfg.distributed))  # before JAX's backends start
            train(cfg, print_sharding=args.print_sharding, fresh=args.fresh, command=command)
        sys.stdout.flush()  # a closed pipe fails here, inside the handler below, not at exit
    except SaveFailed as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        if err.background:  # orbax's writer threads still fail: leave before they print at shutdown
            sys.stdout.flush()
            os._exit(EXIT_USER_ERROR)
        return EXIT_USER_ERROR
    except NonFiniteStop as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_NONFINITE
    except BrokenPipeError:  # --print-config / --print-sharding piped into `head`: the reader is done
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

"""What the benchmark scripts (``scripts/bench*.py``) share: their common arguments, the devices,
the result header, ``name: value`` printing, the JSON file, mesh overrides and plots."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys


def add_arguments(parser: argparse.ArgumentParser, *, steps: int = 10) -> None:
    """``--config``, ``--steps``, ``--host-devices``, ``--json`` and the ``section.field=value`` overrides."""
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--steps", type=int, default=steps, help="timed steps (after one warm-up)")
    parser.add_argument("--host-devices", type=int, metavar="N", help="simulate N CPU devices")
    parser.add_argument("--json", dest="json_path", help="also write the result(s) as JSON to this file")
    parser.add_argument("overrides", nargs="*", metavar="section.field=value")


def start(parser: argparse.ArgumentParser, args: argparse.Namespace, script: str, argv: list[str] | None) -> dict:
    """Check ``--steps``, start ``--host-devices`` simulated CPU devices (else add the recommended XLA
    flags of a GPU run) and return the header of the result: date, jax version and the command."""
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    from meshtrain import xla_flags
    from meshtrain.cli import use_host_devices

    if args.host_devices is not None:
        use_host_devices(args.host_devices)
    else:
        added = xla_flags.apply_recommended()
        if added:
            print(f"xla_flags_added: {' '.join(added)}", flush=True)
    import jax

    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "jax": jax.__version__, "command": " ".join([f"python scripts/{script}", *(argv or sys.argv[1:])])}


def print_result(result: dict, out=None) -> None:
    """Each field as a ``name: value`` line, then the whole result as one ``json: {...}`` line."""
    out = out or sys.stdout
    for key, value in result.items():
        if isinstance(value, dict):
            value = json.dumps(value)
        elif value is None:
            value = "null"
        elif isinstance(value, float):
            value = f"{value:.6g}"
        print(f"{key}: {value}", file=out)
    print("json: " + json.dumps(result), file=out, flush=True)


def write_json(path: str | None, header: dict, results) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({**header, "results": results}, f, indent=1)


def layout_overrides(mesh: tuple[int, int, int, int], preset: str) -> list[str]:
    """Config overrides of a mesh (data, fsdp, tensor, stage) and a sharding preset."""
    return [*(f"mesh.{axis}={size}" for axis, size in zip(("data", "fsdp", "tensor", "stage"), mesh)),
            f"sharding.preset={preset}"]


def sequence_axis(ax) -> None:
    """A plot axis against sequence length: log2 x, grid, legend."""
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length")
    ax.grid(alpha=0.3)
    ax.legend()


def plotted(rows: list[dict], out: str | None, plot) -> list[dict]:
    """``rows``, after ``plot(rows, out)`` wrote the PNG ``out`` (when given)."""
    if out:
        import matplotlib

        matplotlib.use("Agg")
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        plot(rows, out)
        print(f"plot: {out}")
    return rows

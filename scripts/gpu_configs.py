"""What XLA:GPU says of every shipped GPU config at its documented layout (its ``# gpu layout:`` line):
``python -m meshtrain.compile --json`` run on each, one table (memory per device, kernels, compile time).

    .venv-gpu/bin/python scripts/gpu_configs.py [--write-docs]

``--write-docs`` puts the table, dated and with the jax version, into docs/gpu.md between its
``<!-- gpu-configs -->`` markers. Needs the CUDA plugin (``make setup-gpu-compile``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
START, END = "<!-- gpu-configs:start -->", "<!-- gpu-configs:end -->"

from meshtrain.gpu_compile import documented_gpu_layout


def compile_config(config: pathlib.Path) -> tuple[list[str], dict | str]:
    layout = documented_gpu_layout(config)
    proc = subprocess.run([sys.executable, "-m", "meshtrain.compile", "--config", str(config.relative_to(REPO)),
                           "--json", *layout], cwd=REPO, capture_output=True, text=True, check=False)
    if proc.returncode:
        return layout, proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
    return layout, json.loads(proc.stdout.strip().splitlines()[-1])


def row(config: pathlib.Path, layout: list[str], report: dict | str) -> str:
    name = f"`{config.name}`"
    if isinstance(report, str):
        return f"| {name} | `{' '.join(layout)}` | - | - | - | - | - | {report} |"
    gib = lambda n: f"{n / 2 ** 30:.2f}"
    mesh = ",".join(str(report["mesh"][axis]) for axis in ("data", "fsdp", "tensor", "stage"))
    attention = next(line for line in report["kernels"] if line.startswith("attention: "))
    kernels = attention.removeprefix("attention: ").split(",")[0]
    f8 = f", FP8 GEMMs {report['fp8_gemms']}" if report["fp8_gemms"] else ""
    exchange = ", ragged all-to-all" if report["collectives"].get("ragged-all-to-all") else ""
    return (f"| {name} | `{' '.join(layout)}` | {report['devices']} ({mesh}) | {gib(report['argument_bytes'])} | "
            f"{gib(report['temp_bytes'])} | {gib(report['peak_bytes'])} / {gib(report['usable_memory_bytes'])} | "
            f"{kernels}{f8}{exchange} | {report['compile_seconds']:.1f} s |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write-docs", action="store_true", help="write the table into docs/gpu.md")
    args = parser.parse_args(argv)
    rows, versions, failed = [], set(), 0
    for config in sorted(path for path in (REPO / "configs").glob("*.yaml") if documented_gpu_layout(path)):
        layout, report = compile_config(config)
        rows.append(row(config, layout, report))
        if isinstance(report, dict):
            versions.add(f"jax {report['jax']}, jaxlib {report['jaxlib']}")
        failed += not isinstance(report, dict) or not report["fits"]
        print(rows[-1], flush=True)
    header = ["| config | documented layout | devices (d,f,t,s) | arguments GiB | temp GiB | peak / usable GiB | "
              "attention | compile |", "|---|---|---|---|---|---|---|---|"]
    table = "\n".join([f"Measured {datetime.date.today().isoformat()} with {', '.join(sorted(versions))} "
                       "(`scripts/gpu_configs.py --write-docs`), 2 CPU cores, per device:", "", *header, *rows])
    if args.write_docs:
        path = REPO / "docs" / "gpu.md"
        text = path.read_text()
        before, rest = text.split(START, 1)
        path.write_text(f"{before}{START}\n{table}\n{END}{rest.split(END, 1)[1]}")
    print(table)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# Download, here (where the package registries are reachable), the wheels that the bare, offline GPU
# machine lacks to import meshtrain: its python3 is CPython 3.12 with jax 0.11.2 (+ CUDA plugin), flax,
# optax, orbax-checkpoint, chex, safetensors, tokenizers, rich and matplotlib preinstalled (GPU_PREINSTALLED
# below), so it needs meshtrain's other runtime dependencies (pyproject.toml) and their dependencies
# that the preinstalled set does not pull in either: dacite, grain, tensorboardX, jinja2 and a few more.
#
#   scripts/gpu_wheels.sh .gpu_wheels       # then carry .gpu_wheels to the machine (the run tool's `carry`)
#
# The list is pip's own resolution, for CPython 3.12 manylinux x86_64, at the versions pyproject.toml
# allows: the preinstalled set alone, then that set with meshtrain's dependencies; the wheels are what
# the second adds (never jax/jaxlib or anything the first holds), downloaded --no-deps. DIR also gets
# requirements.txt (those pins), preinstalled.txt (the machine's set as requirements), a pip wheel (the machine's python3 may have no pip: it runs from the
# wheel, `python3 pip-*.whl/pip`) and INSTALL, the exact line scripts/gpu_check.sh runs with them.
# PYTHON (default: .venv/bin/python, else python3; Python >= 3.11 with pip >= 22.2) runs pip here.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ $# -ne 1 ]]; then
  echo "usage: scripts/gpu_wheels.sh DIR   (e.g. .gpu_wheels; DIR is emptied first)" >&2
  exit 2
fi
dir=$1
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
# The GPU machine's packages (issue 37); jax and jaxlib at its version, the rest as pyproject.toml allows.
GPU_JAX=0.11.2
GPU_PREINSTALLED=(flax optax orbax-checkpoint chex safetensors tokenizers rich matplotlib)
# manylinux_2_28: grain's wheels carry no older tag (the machine's Ubuntu 24.04 glibc is 2.39).
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64
        --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# meshtrain's requirements, and the preinstalled packages with pyproject.toml's bounds where it has them.
"$PYTHON" - "$work" "$GPU_JAX" "${GPU_PREINSTALLED[@]}" <<'EOF'
import re, sys, tomllib
work, jax_version, *preinstalled = sys.argv[1:]
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
name = lambda spec: re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0].lower()
bounds = {name(d): d for d in deps}
base = [f"jax=={jax_version}", f"jaxlib=={jax_version}"] + [bounds.get(p, p) for p in preinstalled]
open(f"{work}/base.txt", "w").write("\n".join(base) + "\n")
open(f"{work}/all.txt", "w").write("\n".join(base + [d for d in deps if name(d) not in ("jax", "jaxlib")]) + "\n")
EOF
for set in base all; do
  "$PYTHON" -m pip install --quiet --dry-run --ignore-installed --target "$work/target" "${TARGET[@]}" \
    --report "$work/$set.json" -r "$work/$set.txt" 2> >(grep -v "is ignored: it is neither" >&2)
done
"$PYTHON" - "$work" <<'EOF' > "$work/requirements.txt"
import json, sys
work = sys.argv[1]
key = lambda item: item["metadata"]["name"].lower().replace("_", "-")
have = {key(i) for i in json.load(open(f"{work}/base.json"))["install"]}
add = sorted((key(i), i["metadata"]["version"]) for i in json.load(open(f"{work}/all.json"))["install"] if key(i) not in have)
assert add and not {"jax", "jaxlib"} & {n for n, _ in add}, add
print("\n".join(f"{n}=={v}" for n, v in add))
EOF

rm -rf "$dir"
mkdir -p "$dir"
cp "$work/requirements.txt" "$dir/requirements.txt"
cp "$work/base.txt" "$dir/preinstalled.txt"  # the machine's set as resolved here (scripts/gpu_rehearsal.sh builds it)
"$PYTHON" -m pip download --quiet --no-deps "${TARGET[@]}" -d "$dir" -r "$dir/requirements.txt" "pip>=24" \
  2> >(grep -v "is ignored: it is neither" >&2)
pip_wheel=$(cd "$dir" && ls pip-*-py3-none-any.whl | tail -1)
# The line scripts/gpu_check.sh runs (GPU_WHEELS=DIR; .gpu_site is the target inside the repo).
echo "env PIP_CONFIG_FILE=/dev/null \$PYTHON $dir/$pip_wheel/pip --isolated install --quiet --no-cache-dir" \
     "--root-user-action=ignore --no-index --find-links $dir --no-deps --target .gpu_site -r $dir/requirements.txt" \
     > "$dir/INSTALL"
count=$(wc -l < "$dir/requirements.txt")
echo "gpu_wheels: $count wheels + $pip_wheel in $dir ($(du -sh "$dir" | cut -f1)): $(tr '\n' ' ' < "$dir/requirements.txt")"
echo "install line ($dir/INSTALL): $(cat "$dir/INSTALL")"

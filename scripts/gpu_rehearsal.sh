#!/usr/bin/env bash
# Rehearse the GPU machine on this CPU machine (make gpu-rehearsal; .ci/run): a Python 3.12 venv with only
# that machine's packages (jax 0.11.2, CPU build here, flax, optax, orbax-checkpoint, chex, safetensors,
# tokenizers, rich, matplotlib and what they pull in; then pip itself is uninstalled, as on a bare python3),
# scripts/gpu_wheels.sh into a fresh directory, and `scripts/gpu_check.sh --dry-run` with that directory as
# GPU_WHEELS: it must install the wheels into .gpu_site and pass end to end, its report as tests/test_bench.py's
# test marked rehearsal checks it (run with .venv's pytest, TEST_PYTHON for another). Non-zero exit on any failure.
#
#   scripts/gpu_rehearsal.sh [PYTHON3.12]     # default: python3.12
set -euo pipefail
cd "$(dirname "$0")/.."
python312=${1:-python3.12}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
start=$SECONDS
clock() { echo "gpu_rehearsal: $1 in $((SECONDS - start)) s"; start=$SECONDS; }

PYTHON="$python312" scripts/gpu_wheels.sh "$work/wheels"  # its pip resolves and downloads
clock "wheels downloaded"

"$python312" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$work/wheels/preinstalled.txt" \
  2> >(grep -v "is ignored: it is neither" >&2)
"$work/venv/bin/python" -m pip uninstall --quiet --yes pip
clock "venv built ($("$work/venv/bin/python" -c 'import jax; print("jax", jax.__version__)'), no pip)"
if "$work/venv/bin/python" -c 'import dacite' 2>/dev/null || "$work/venv/bin/python" -c 'import grain' 2>/dev/null \
   || "$work/venv/bin/python" -c 'import tensorboardX' 2>/dev/null; then
  echo "gpu_rehearsal: the venv already has dacite, grain or tensorboardX: not the GPU machine's set" >&2
  exit 1
fi

PYTHON="$work/venv/bin/python" GPU_WHEELS="$work/wheels" GPU_CHECK_TIMEOUT="${GPU_CHECK_TIMEOUT:-900}" \
  scripts/gpu_check.sh --dry-run | tee "$work/check.log"
grep -q "^gpu_check.sh: installed .*dacite" "$work/check.log" || { echo "gpu_rehearsal: gpu_check.sh installed no wheels" >&2; exit 1; }
rm -rf .gpu_site
clock "gpu_check.sh --dry-run passed"

# Its report checked field by field (tests/test_bench.py's test marked rehearsal), in this checkout's .venv.
GPU_CHECK_LOG="$work/check.log" "${TEST_PYTHON:-.venv/bin/python}" -m pytest -q -p no:cacheprovider \
  tests/test_bench.py -m rehearsal
clock "its report checked"

#!/usr/bin/env bash
# One prepared GPU check for meshtrain: loss of the tiny model on the GPU vs the CPU reference, then
# TFLOP/s and MFU of a ~1B Llama (bf16, seq 2048, cuDNN attention, recommended XLA flags), that step
# timed under each XLA flag arm (the flags before issue 37, the derived set, O1), the same model in
# FP8 (step time against bf16's) and the tiny model's 200-step FP8 loss against bf16's, then
# optimizer + activation offload with memory_analysis, a checkpoint round trip, document-packed
# logits vs each document alone, MoE logits and the experts timed under each dispatch (one-hot,
# capacity, sorted with the blocked and the ragged_dot kernel) with whether ragged_dot is a grouped
# GEMM on this GPU, DeepSeek-V3 (tiny: logits vs CPU, the compressed-cache generation, latent
# attention's kernels timed at V3's head shape), and ZB-H1's split backward
# on the device plus the pipeline schedules on the machine's jax (CPU devices), the attention kernels
# (blockwise vs cuDNN vs dense at 8k and 32k), and meshtrain's step against a hand-written one with and without the non-finite guard (issue 13's
# 20.6M Llama). Aim: < 8 minutes on one H100/H200.
#
#   scripts/gpu_check.sh              # on the GPU machine (python3 with jax[cuda] installed)
#   scripts/gpu_check.sh --dry-run    # anywhere: CPU, tiny shapes (also GPU_CHECK_DRY_RUN=1)
#
# Runs from the source tree (PYTHONPATH=repo root); PYTHON selects the interpreter (default: the
# repo's .venv if present, else python3). GPU_CHECK_TIMEOUT (seconds, default 470) bounds the run.
# On the bare GPU machine (jax, flax, optax, orbax, chex, ... but no dacite, grain, tensorboardX): when
# PYTHON cannot import those and GPU_WHEELS (default .gpu_wheels, made here by scripts/gpu_wheels.sh and
# carried there) holds the wheels, they are installed --no-index --no-deps into .gpu_site (inside the
# repo; never the interpreter's site-packages), which goes first on PYTHONPATH. scripts/gpu_rehearsal.sh
# rehearses that on a CPU machine (make gpu-rehearsal).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if ! "$PYTHON" -c 'import dacite, grain, tensorboardX' >/dev/null 2>&1; then
  wheels=${GPU_WHEELS:-.gpu_wheels}
  pip_wheel=$(ls "$wheels"/pip-*-py3-none-any.whl 2>/dev/null | tail -1 || true)
  if [[ ! -f "$wheels/requirements.txt" || -z "$pip_wheel" ]]; then
    echo "gpu_check.sh: $PYTHON cannot import dacite, grain, tensorboardX and $wheels holds no wheels:" \
         "run scripts/gpu_wheels.sh $wheels where PyPI is reachable and carry $wheels to this machine" >&2
    exit 2
  fi
  rm -rf .gpu_site
  # The line scripts/gpu_wheels.sh writes to $wheels/INSTALL: pip runs from its wheel (python3 may have none),
  # isolated from pip's configuration and environment variables.
  install=(env PIP_CONFIG_FILE=/dev/null "$PYTHON" "$pip_wheel/pip" --isolated install --quiet --no-cache-dir
           --root-user-action=ignore --no-index --find-links "$wheels" --no-deps --target .gpu_site
           -r "$wheels/requirements.txt")
  "${install[@]}"
  export PYTHONPATH="$PWD/.gpu_site:$PYTHONPATH"
  if ! "$PYTHON" -c 'import dacite, grain, tensorboardX'; then
    echo "gpu_check.sh: dacite, grain, tensorboardX still fail to import after installing $wheels into .gpu_site" >&2
    exit 2
  fi
  echo "gpu_check.sh: installed $(tr '\n' ' ' < "$wheels/requirements.txt")into .gpu_site: ${install[*]}"
fi
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader || true
fi
# Files a phase writes (compile_parity: autotune results, the card's target config): the device tool's $OUT
# when there is one, so that they come back.
export GPU_CHECK_OUT="${GPU_CHECK_OUT:-${OUT:-gpu_check_out}}"
exec timeout "${GPU_CHECK_TIMEOUT:-470}" "$PYTHON" scripts/gpu_check.py "$@"

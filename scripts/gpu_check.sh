#!/usr/bin/env bash
# One prepared GPU check for meshtrain: loss of the tiny model on the GPU vs the CPU reference, then
# TFLOP/s and MFU of a ~1B Llama (bf16, seq 2048, cuDNN attention, recommended XLA flags), then
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
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader || true
fi
exec timeout "${GPU_CHECK_TIMEOUT:-470}" "$PYTHON" scripts/gpu_check.py "$@"

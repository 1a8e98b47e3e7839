#!/usr/bin/env bash
# Install MaxText 0.2.5 (CPU) in its own virtual environment for scripts/bench_maxtext.py and
# `scripts/bench_vs_maxtext.py`. Idempotent: a second run with the same package list does nothing.
#
#   scripts/install_maxtext.sh                 # -> .maxtext-venv/ in the repository root (gitignored)
#   MAXTEXT_VENV=DIR MAXTEXT_PYTHON=python3.12 scripts/install_maxtext.sh
#
# MaxText needs Python >= 3.12 and jax >= 0.11.1 (0.2.5 imports jax.experimental.xla_metadata.must_fuse_call,
# which jax 0.10.2 lacks), so it cannot share meshtrain's .venv. Its wheel declares no requirements outside
# its extras, and letting pip resolve the requirements of what it imports pulls in ~125 packages, 1.4 GB
# (Google Cloud clients, scipy, duckdb, ...). Instead every package below is installed with --no-deps at an
# exact version: the distributions whose modules a CPU run of maxtext.trainers.pre_train.train loads with
# DECOUPLE_GCLOUD=TRUE dataset_type=synthetic attention=dot_product (found by running it and recording
# sys.modules), plus safetensors, whose version transformers checks at import; nothing more. flax 0.12.10 is
# the first flax that imports under jax 0.11.2 (0.12.9 uses hijax.HiPrimitive, renamed in 0.11.2).
# Needs only PyPI.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MAXTEXT_VENV:-$ROOT/.maxtext-venv}"
PYTHON=""
for candidate in ${MAXTEXT_PYTHON:-/root/.pyenv/versions/3.12.1/bin/python3 python3.12 python3.13 python3}; do
  if command -v "$candidate" >/dev/null 2>&1 &&
     "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
    PYTHON="$candidate"
    break
  fi
done
if [[ -z "$PYTHON" ]]; then
  echo "install_maxtext: missing Python >= 3.12 (MaxText needs it; set MAXTEXT_PYTHON=/path/to/python3.12)"
  exit 1
fi

PACKAGES="
maxtext==0.2.5
jax==0.11.2 jaxlib==0.11.2 flax==0.12.10 optax==0.2.8 orbax-checkpoint==0.12.8 numpy==2.5.5 ml_dtypes==0.7.0
absl-py==2.5.1 annotated-doc==0.0.7 annotated-types==0.8.0 anyio==4.16.0 aqtp==0.9.0
array_record==0.8.6 attrs==26.1.0 certifi==2026.10.19.post1 charset-normalizer==3.5.3 click==8.5.1
cloudpickle==3.1.3 drjax==0.2.1 einshape==1.0 etils==1.15.0 fastapi==0.165.0 filelock==4.3.1
fire==0.7.1 grain==0.2.18 h11==0.16.0 httpcore2==2.16.2 httpx2==2.16.2
huggingface_hub==2.4.0 humanize==4.17.0 idna==3.20 immutabledict==4.3.1
jaxtyping==0.3.11 Jinja2==3.1.6 MarkupSafe==3.0.4 ml_collections==1.1.0
mpmath==1.3.0 msgpack==1.2.4 omegaconf==2.4.0 opentelemetry-api==1.45.2
opt_einsum==3.4.0 packaging==26.4 pathwaysutils==0.1.13
pillow==13.0.0 portpicker==1.6.0 prometheus_client==0.26.0 protobuf==7.36.2 psutil==7.2.2
pydantic==2.14.4 pydantic_core==2.50.5 Pygments==2.21.0 PyYAML==6.0.4 qwix==0.1.8 regex==2026.11.19
requests==2.34.2 rich==15.0.0 safetensors==0.8.0 sentencepiece==0.2.3 simplejson==4.3.0 six==1.17.0 starlette==1.10.0
sympy==1.14.0 tensorstore==0.1.86 termcolor==3.3.0 tiktoken==0.14.0 tokamax==0.0.15
tokenizers==0.23.3 tqdm==4.70.1 transformers==5.24.0 treescope==0.1.10 truststore==0.10.5 typing-inspection==0.4.5
typing_extensions==4.16.0 urllib3==2.8.0 uvicorn==0.54.0 uvloop==0.23.0 wadler_lindig==0.1.8 xprof==2.24.2
"
STAMP="$VENV/.meshtrain-maxtext-packages"
WANT="$(echo "$PACKAGES" | tr ' ' '\n' | sed '/^$/d' | sort)"

check() {  # the train module imports, offline, on CPU
  DECOUPLE_GCLOUD=TRUE JAX_PLATFORMS=cpu "$VENV/bin/python" -c \
    'import maxtext.trainers.pre_train.train, jax; print("maxtext 0.2.5 ok, jax", jax.__version__)'
}

if [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]] && check >/dev/null 2>&1; then
  echo "install_maxtext: already installed in $VENV"
  exit 0
fi

start=$(date +%s)
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
# shellcheck disable=SC2086
if ! "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps $PACKAGES; then
  echo "install_maxtext: pip could not install the pinned packages above (it needs PyPI)"
  exit 1
fi
if ! out="$(check 2>&1)"; then
  echo "$out" | tail -20
  echo "install_maxtext: MaxText does not import in $VENV (see above)"
  exit 1
fi
echo "$out" | tail -1
echo "$WANT" > "$STAMP"
echo "install_maxtext: installed in $VENV ($(du -sh "$VENV" | cut -f1), $(( $(date +%s) - start )) s)"

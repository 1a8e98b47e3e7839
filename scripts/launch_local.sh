#!/usr/bin/env bash
# Runs N local CPU processes of `python -m meshtrain.train` joined by jax.distributed.
#
#   scripts/launch_local.sh N [--host-devices D] [meshtrain.train arguments ...]
#
# Each process simulates D/N CPU devices (D: --host-devices, default 8; it must divide by N), the
# coordinator listens on 127.0.0.1 at a free port, every output line is prefixed by "[rank]", and
# the exit status is the first non-zero one of any process (0 when all succeed). When one process
# fails, the others are stopped after MESHTRAIN_LAUNCH_GRACE_S seconds (default 150) unless JAX's
# heartbeat timeout has made them exit already. PYTHON overrides the interpreter.
set -u -o pipefail

usage() { echo "usage: $0 N [--host-devices D] [meshtrain.train arguments ...]" >&2; exit 2; }
[[ $# -ge 1 && "$1" =~ ^[1-9][0-9]*$ ]] || usage
nproc=$1; shift

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-}
if [[ -z "$python" ]]; then
  if [[ -x "$repo/.venv/bin/python" ]]; then python="$repo/.venv/bin/python"; else python=python3; fi
fi

devices=8
args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --host-devices) [[ $# -ge 2 ]] || usage; devices=$2; shift 2 ;;
    --host-devices=*) devices=${1#*=}; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
if ! [[ "$devices" =~ ^[1-9][0-9]*$ ]] || (( devices % nproc )); then
  echo "error: --host-devices: $devices devices cannot be divided among $nproc processes" >&2; exit 2
fi
per=$(( devices / nproc ))

port=${MESHTRAIN_COORDINATOR_PORT:-$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
grace=${MESHTRAIN_LAUNCH_GRACE_S:-150}

pids=()
cleanup() { for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null; done; }
trap 'cleanup; exit 130' INT TERM

for (( rank = 0; rank < nproc; rank++ )); do
  # setsid: each rank (python and its prefixing sed) is one process group that cleanup can stop.
  # Gloo's "[Gloo] Rank r is connected to k peer ranks. Expected number of connected peer ranks is :
  # k" lines (one per collective set-up, printed piecewise by C++ threads, so several can interleave
  # into fragments, down to lines of digits) are dropped.
  JAX_PLATFORMS=cpu setsid bash -c 'set -o pipefail; rank=$1; shift
    "$@" 2>&1 | sed -u -e "/\[Gloo\]\|is connected to\|peer ranks/d" -e "/^[0-9][0-9]*$/d" -e "s/^/[$rank] /"' \
    rank "$rank" \
    "$python" -u -m meshtrain.train --host-devices "$per" \
    --coordinator "127.0.0.1:$port" --num-processes "$nproc" --process-id "$rank" "${args[@]}" &
  pids+=($!)
done

status=0
remaining=$nproc
deadline=
declare -A finished=()
while (( remaining > 0 )); do
  for i in "${!pids[@]}"; do
    [[ -n "${finished[$i]:-}" ]] && continue
    if ! kill -0 "${pids[$i]}" 2>/dev/null; then
      wait "${pids[$i]}"; rc=$?
      finished[$i]=1; remaining=$(( remaining - 1 ))
      if (( rc != 0 )); then
        echo "launch_local: rank $i exited with status $rc" >&2
        if (( status == 0 )); then status=$rc; deadline=$(( SECONDS + grace )); fi
      fi
    fi
  done
  if [[ -n "$deadline" ]] && (( SECONDS >= deadline && remaining > 0 )); then
    echo "launch_local: stopping the remaining ranks ${grace} s after the first failure" >&2
    cleanup; deadline=
  fi
  (( remaining > 0 )) && sleep 0.2
done
exit $status

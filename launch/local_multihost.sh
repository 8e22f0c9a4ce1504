#!/usr/bin/env bash
# Run N training processes on this machine, joined by jax.distributed over localhost (CPU, gloo):
#   launch/local_multihost.sh N --config configs/tiny.yaml [key=value ...]
# Each process gets DEVICES_PER_PROCESS forced host devices (default 1); the mesh spans all of
# them (mesh.data=-1). Process 0 prints progress and writes metrics/checkpoint metadata; all
# processes write their checkpoint shards. Output of process i is prefixed with [i]. The Python is
# $PYTHON, else the checkout's .venv (what `make setup` creates), else `python` on PATH.
set -euo pipefail
N=${1:?usage: launch/local_multihost.sh N [--config FILE] [key=value ...]}
shift
PORT=${JTREE_PORT:-$((20000 + RANDOM % 20000))}
VENV_PY="$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python"
if [[ -x "$VENV_PY" ]]; then PY=${PYTHON:-$VENV_PY}; else PY=${PYTHON:-python}; fi
DEVICES=${DEVICES_PER_PROCESS:-1}
pids=()
for ((i = 0; i < N; i++)); do
  JAX_PLATFORMS=cpu XLA_FLAGS="--xla_force_host_platform_device_count=$DEVICES" \
  JTREE_COORDINATOR="localhost:$PORT" JTREE_NUM_PROCESSES="$N" JTREE_PROCESS_ID="$i" \
    "$PY" -m jtree.launch.train "$@" > >(sed -u "s/^/[$i] /") 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
  wait "$pid" || status=$?
done
exit "$status"

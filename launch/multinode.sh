#!/usr/bin/env bash
# Multi-node training with the deepspeed launcher (passwordless ssh to every host in the hostfile, the same
# checkout path and venv on every node, a shared filesystem for run_dir).
#   HOSTFILE=launch/hostfile.example GPUS_PER_NODE=8 launch/multinode.sh model=small run_dir=/shared/runs/k3
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
HOSTFILE="${HOSTFILE:-launch/hostfile.example}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
# MASTER_ADDR defaults to the hostfile's first host, MASTER_PORT to a port free there (training/launch.py)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}" HOSTFILE NUM_RANKS="$GPUS_PER_NODE"
exec "$ROOT/.venv/bin/python" -m training.launch "$@"

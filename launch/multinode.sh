#!/usr/bin/env bash
# Multi-node training with the deepspeed launcher (passwordless ssh to every host in the hostfile, the same
# checkout path and venv on every node, a shared filesystem for run_dir).
#   HOSTFILE=launch/hostfile.example GPUS_PER_NODE=8 launch/multinode.sh model=small run_dir=/shared/runs/k3
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
HOSTFILE="${HOSTFILE:-launch/hostfile.example}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
MASTER_ADDR="${MASTER_ADDR:-$(head -n1 "$HOSTFILE" | awk '{print $1}')}"
MASTER_PORT="${MASTER_PORT:-29500}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
exec "$ROOT/.venv/bin/deepspeed" --no_local_rank --hostfile "$HOSTFILE" --num_gpus "$GPUS_PER_NODE" \
  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" training/train.py "$@"

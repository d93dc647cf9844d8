#!/usr/bin/env bash
# Multi-node training with the deepspeed launcher (pdsh over passwordless ssh to every host in the hostfile, the
# same checkout path and venv on every node, a shared filesystem for run_dir). docs/multinode.md; tested in
# tests/multinode (two network-namespace nodes with their own sshd).
#   HOSTFILE=launch/hostfile.example GPUS_PER_NODE=8 launch/multinode.sh model=small run_dir=/shared/runs/k3
# Every node is checked first (reachable, checkout + venv, slots, master port: one line per problem), and the
# ranks on the other nodes get this shell's DS_ACCELERATOR, OMP_NUM_THREADS, GLOO_*/NCCL_* (e.g.
# GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, the interface the nodes reach each other on), WANDB_*, HF_*, K3_*
# through DeepSpeed's DS_ENV_FILE (training/multinode.py). ssh options for pdsh and the checks: PDSH_SSH_ARGS_APPEND.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
HOSTFILE="${HOSTFILE:-launch/hostfile.example}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
# MASTER_ADDR defaults to the hostfile's first host, MASTER_PORT to a port free there (training/launch.py)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}" HOSTFILE NUM_RANKS="$GPUS_PER_NODE"
exec "$ROOT/.venv/bin/python" -m training.launch "$@"

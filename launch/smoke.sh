#!/usr/bin/env bash
# The README's main job: 2 CPU ranks through the deepspeed launcher, ZeRO-2, the tiny model on the embedded corpus.
# Extra arguments are Hydra overrides, passed through:  launch/smoke.sh train.steps=50 run_dir=runs/try
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
[ -x .venv/bin/python ] || make venv
export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export WANDB_MODE="${WANDB_MODE:-offline}"
export HF_DATASETS_OFFLINE="${HF_DATASETS_OFFLINE:-1}"
export PATH="$ROOT/.venv/bin:$PATH"
NUM_RANKS="${NUM_RANKS:-2}"
# a free port unless one is given (29500, the default, is often taken by another job on a shared machine)
MASTER_PORT="${MASTER_PORT:-$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
exec deepspeed --no_local_rank --num_gpus "$NUM_RANKS" --master_port "$MASTER_PORT" training/train.py experiment=smoke "$@"

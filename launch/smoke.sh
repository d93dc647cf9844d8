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
# NUM_RANKS (default 2) ranks; a free master port unless MASTER_PORT names one (training/launch.py)
exec python -m training.launch experiment=smoke "$@"

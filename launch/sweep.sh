#!/usr/bin/env bash
# A Hydra multirun in which every job is its own deepspeed launch (own process group, own run_dir):
#   launch/sweep.sh experiment=smoke train.steps=100 optim.lr=1e-3,3e-3 train.seed=0,1
# Hydra expands the comma lists (4 jobs here) and runs them one after the other; with launcher.num_gpus > 0 each
# job re-launches `deepspeed --no_local_rank --num_gpus N training/train.py <its overrides>` into its own run dir
# keyed by its overrides, runs/sweep/<name>/<key> (e.g. experiment-smoke__optim.lr-0.001__train.seed-0; with
# run_dir=R: R/<key>), so no job resumes another's checkpoint and a re-run with new values trains in new dirs.
# NUM_RANKS (default 2) ranks per job.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export PATH="$ROOT/.venv/bin:$PATH"
exec python -m training.train --multirun "launcher.num_gpus=${NUM_RANKS:-2}" "$@"

#!/usr/bin/env bash
# One-GPU performance check (H100 or H200, <= 5 min), one table: host syncs per bf16 train step
# (torch.cuda.set_sync_debug_mode, unpacked and packed rows), fla KDA vs the chunked PyTorch path (correctness +
# speed), MLA over packed documents (FlexAttention vs per-document SDPA), the routed experts as grouped_mm vs a GEMM
# loop (model.expert_backend), the small preset's bf16 train-step time and MFU (goal >= 45%), peak memory vs the
# planner. JSON to bench/results/gpu.json (and $OUT/gpu.json when OUT is set). Needs only this repo and a Python
# with a CUDA build of torch
# (+ optionally flash-linear-attention/triton for the fla row):   PYTHON=/path/to/python bench/gpu.sh [--seq 4096]
# Exits 2 at once, with one line, when there is no GPU or no CUDA torch.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
command -v nvidia-smi >/dev/null 2>&1 || {
  echo "error: nvidia-smi not found: bench/gpu.sh needs an NVIDIA GPU machine" >&2; exit 2; }
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for c in .venv/bin/python python3 python; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c "import torch" >/dev/null 2>&1; then PY="$c"; break; fi
  done
fi
[ -n "$PY" ] || {
  echo "error: no Python with torch found; set PYTHON=/path/to/python (CUDA build of torch)" >&2; exit 2; }
"$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)" 2>/dev/null || {
  echo "error: $PY has no usable CUDA torch (torch.cuda.is_available() is False); set PYTHON= to one that has" >&2
  exit 2; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
export DS_ACCELERATOR=cuda PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec timeout "${GPU_BENCH_TIMEOUT:-290}" "$PY" -m bench.gpu_check "$@"

#!/usr/bin/env bash
# The full fault matrix (issues 8, 17): every fault of tests/fault/ incl. the K3_FAULT_FULL-only trials (kills at 5
# steps, launcher kills, every checkpoint phase, world size 2 -> 1, resume twice across a data loop, 2,000-step
# soak, launcher-process kill with 2 ranks, resume on new data with allow_changes=[data]) and the run-identity,
# lock, sweep and retention trials, then a table: fault, trials, survived, data lost.
# Usage: launch/fault_matrix.sh [extra pytest args]
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 WANDB_MODE=offline HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
export K3_FAULT_FULL=1
OUT=${K3_FAULT_OUT:-runs/fault_matrix}
mkdir -p "$OUT"
export K3_FAULT_REPORT="$PWD/$OUT/trials.jsonl"
: > "$K3_FAULT_REPORT"
start=$(date +%s)
"$PY" -m pytest tests/fault -q -p no:randomly -rA "$@" | tee "$OUT/pytest.log"
rc=${PIPESTATUS[0]}
"$PY" - "$K3_FAULT_REPORT" "$OUT/pytest.log" "$(( $(date +%s) - start ))" <<'PYEOF'
import json, re, sys
from collections import OrderedDict

trials = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
# Tests that do not call record(): one trial each, by outcome (PASSED = survived, no data lost).
FAULT = OrderedDict([
    ("test_nonfinite", "NaN/Inf loss or gradient (skip, count, stop)"),
    ("test_untrusted.py::test_damaged", "corrupted/truncated checkpoint file"),
    ("test_untrusted.py::test_truncated", "corrupted/truncated checkpoint file"),
    ("test_untrusted.py::test_fallback", "corrupted checkpoint + fallback"),
    ("test_untrusted.py::test_safe_load", "malicious pickle refused"),
    ("test_untrusted.py::test_resume_refuses", "malicious pickle refused"),
    ("test_untrusted.py::test_wandb", "W&B key never written"),
    ("test_data_faults", "malformed data records"),
    ("test_startup", "unwritable run dir / disk full"),
])
rows = OrderedDict()
for t in trials:
    r = rows.setdefault(t["fault"], [0, 0, 0, []])
    r[0] += 1; r[1] += t["survived"]; r[2] += t["data_lost"]
    if t.get("detail"): r[3].append(t["detail"])
for line in open(sys.argv[2]):
    m = re.match(r"^(PASSED|FAILED|ERROR) (\S+)", line)
    if not m:
        continue
    for key, name in FAULT.items():
        if key in m.group(2):
            r = rows.setdefault(name, [0, 0, 0, []])
            r[0] += 1; r[1] += m.group(1) == "PASSED"; r[2] += m.group(1) != "PASSED"
            break
w = max(len(k) for k in rows) if rows else 10
print(f"\n{'fault':<{w}}  trials  survived  data lost")
for k, (n, ok, lost, det) in rows.items():
    print(f"{k:<{w}}  {n:>6}  {ok:>8}  {lost:>9}" + (f"   ({det[-1]})" if det else ""))
print(f"total wall time: {int(sys.argv[3])} s")
PYEOF
exit $rc

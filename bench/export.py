"""Export memory and time: the consolidated export (model built, then saved) vs the streamed one (issue 37).

    DS_ACCELERATOR=cpu .venv/bin/python -m bench.export                      # small and small-e96 (~2.4 GB fp32)
    DS_ACCELERATOR=cpu .venv/bin/python -m bench.export --cases tiny --procs 2

For each case a ZeRO-0 checkpoint step dir of random weights is written once (the module file the trainer
writes), then every export runs in a fresh child process: `consolidated` (today's path before issue 37:
load_checkpoint_model + save_hf_checkpoint), `streamed` (`--format hf`, 1 process), `streamed xN` (N processes),
`release` (`--format release`: MXFP4 experts, bf16). Reported: the peak RSS of the export (ru_maxrss of the
process; for N processes, of the largest one and the sum of all) minus the RSS after imports, as a fraction of the
model's fp32 bytes (goal for the streamed export: <= 0.25), and the wall time. The peak is VmHWM: Linux's
ru_maxrss carries the parent's RSS over fork + exec, so a child started by a parent holding the model would report
the parent's size. Mapped checkpoint pages count in
RSS (the streamed export unmaps them after each tensor), written pages do not (page cache).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import print_table, write_json

CASES = {
    "tiny": dict(preset="tiny"),
    "small": dict(preset="small"),
    "small-e96": dict(preset="small", num_experts=96),  # experts dominate, as in K3
}


def _status_kib(key: str) -> int:
    with open("/proc/self/status", encoding="utf-8") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def child(mode: str, tag: str, out: str, procs: int) -> None:
    """One export in this process; prints JSON with the RSS after imports, the peak, the time."""
    from model import save_hf_checkpoint
    from training.tools.export import export_checkpoint, load_checkpoint_model

    base = _status_kib("VmRSS")
    t0 = time.perf_counter()
    if mode == "consolidated":
        model, _ = load_checkpoint_model(tag)
        save_hf_checkpoint(model, out)
    else:
        export_checkpoint(tag, out, fmt="release" if mode == "release" else "hf", procs=procs)
    seconds = time.perf_counter() - t0
    own = _status_kib("VmHWM")  # (ru_maxrss keeps the parent's RSS across fork + exec: not this process's peak)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print(json.dumps({"base_kib": base, "peak_kib": own, "children_peak_kib": kids, "seconds": seconds}))


def _checkpoint(root: Path, spec: dict) -> tuple[Path, int]:
    from model import K3Config, K3ForCausalLM

    spec = dict(spec)
    config = K3Config.preset(spec.pop("preset"), vision_config=None, **spec)
    torch.manual_seed(0)
    model = K3ForCausalLM(config)
    tag = root / "checkpoints" / "step_1"
    tag.mkdir(parents=True)
    torch.save({"module": model.state_dict()}, tag / "mp_rank_00_model_states.pt")
    config.save(tag)
    (tag / "COMPLETE").write_text("")
    fp32 = sum(t.numel() * 4 for t in model.state_dict().values())
    del model
    return tag, fp32


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="small,small-e96")
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--child", nargs=4, metavar=("MODE", "TAG", "OUT", "PROCS"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child(a.child[0], a.child[1], a.child[2], int(a.child[3]))
    rows = []
    for name in a.cases.split(","):
        with tempfile.TemporaryDirectory(prefix="k3-bench-export-") as tmp:
            tag, fp32 = _checkpoint(Path(tmp) / "run", CASES[name])
            for mode, procs in (("consolidated", 1), ("streamed", 1), ("streamed", a.procs), ("release", 1)):
                out = Path(tmp) / f"out-{mode}-{procs}"
                cmd = [sys.executable, "-m", "bench.export", "--child", mode, str(tag), str(out), str(procs)]
                env = {**os.environ, "DS_ACCELERATOR": "cpu"}
                p = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
                r = json.loads(p.stdout.strip().splitlines()[-1])
                peak = max(r["peak_kib"], r["children_peak_kib"]) if procs > 1 else r["peak_kib"]
                total = r["peak_kib"] + (procs - 1) * r["children_peak_kib"]  # an upper bound for N at once
                rows.append(
                    {
                        "case": name,
                        "fp32_GB": fp32 / 1e9,
                        "export": mode if procs == 1 else f"{mode} x{procs}",
                        "peak_rss_GB": peak * 1024 / 1e9,
                        "work_over_fp32": (peak - r["base_kib"]) * 1024 / fp32,
                        "all_procs_over_fp32": (total - procs * r["base_kib"]) * 1024 / fp32,
                        "seconds": r["seconds"],
                        "out_GB": sum(f.stat().st_size for f in out.iterdir()) / 1e9,
                    }
                )
                shutil.rmtree(out)
    print_table("export: peak RSS above the post-import baseline / model fp32 bytes, and time", rows)
    write_json("export", {"rows": rows})


if __name__ == "__main__":
    main()

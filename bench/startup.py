"""Start-up cost: time from command to the first optimizer step of the smoke job, split into phases.

    DS_ACCELERATOR=cpu .venv/bin/python -m bench.startup               # cold + cached data, 1-process entry
    DS_ACCELERATOR=cpu .venv/bin/python -m bench.startup --launcher    # + launch/smoke.sh train.steps=1 (2 ranks)

Each measurement is a fresh child process (cold imports, as a user's command). The child runs the trainer's
own pieces in order and stamps each phase: interpreter start, imports (torch, deepspeed, hydra, datasets/wandb,
the project), Hydra compose + validation, data/tokenizer preparation (corpus + sentencepiece training when the
cache is empty: "cold"; loading the cached files: "cached"), Trainer construction (process group, model, the
DeepSpeed engine, loader, logger) and the first `train_step` (forward, backward, optimizer step). The end-to-end
command `python -m training.train experiment=smoke train.steps=1 parallel=dp` is timed
too (its own time_to_first_step_s).
Goal (issue 7): <= 20 s to the first optimizer step with a warm cache.
"""

from __future__ import annotations

import time

T_MODULE = time.time()  # as early as possible in the child

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from training.launch import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OVERRIDES = ["experiment=smoke", "train.steps=1", "logging=disabled", "checkpoint.save_final=false"]
ONE_PROCESS = ["parallel=dp"]  # the smoke job is EP=2 over 2 ranks; one process runs it with EP=1


def child(run_dir: str) -> dict[str, float]:
    """Phase stamps (seconds) of one cold start; printed as JSON on the last stdout line."""
    t = {"interpreter": T_MODULE - float(os.environ["STARTUP_T0"])}
    last = time.time()

    def stamp(name: str) -> None:
        nonlocal last
        now = time.time()
        t[name] = now - last
        last = now

    import torch  # noqa: F401

    stamp("import_torch")
    import deepspeed  # noqa: F401

    stamp("import_deepspeed")
    import datasets  # noqa: F401
    import hydra  # noqa: F401
    import wandb  # noqa: F401

    stamp("import_hydra_datasets_wandb")
    import data  # noqa: F401
    import model  # noqa: F401
    from training import config as tr
    from training.trainer import Trainer

    stamp("import_project")

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(tr.CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=OVERRIDES + ONE_PROCESS + [f"run_dir={run_dir}"])
    mcfg = tr.validate(cfg, 1)
    stamp("compose_validate")
    from data import prepare_tokenizer

    prepare_tokenizer(OmegaConf.to_object(cfg.data))
    stamp("data_tokenizer_prep")
    trainer = Trainer(cfg, mcfg)  # the tokenizer is now cached: this is process group + model + engine + loader
    stamp("trainer_init_engine")
    trainer.train_step()
    stamp("first_step")
    t["total"] = time.time() - float(os.environ["STARTUP_T0"])
    return t


def _env(cache: str) -> dict[str, str]:
    env = dict(
        os.environ,
        DS_ACCELERATOR="cpu",
        K3_CACHE_DIR=cache,
        WANDB_MODE="disabled",
        HF_DATASETS_OFFLINE="1",
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
        MASTER_PORT=os.environ.get("MASTER_PORT") or str(free_port()),
    )
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    return env


def run_phases(cache: str, run_dir: str) -> dict[str, float]:
    env = _env(cache) | {"STARTUP_T0": repr(time.time())}
    p = subprocess.run(
        [sys.executable, "-m", "bench.startup", "--child", run_dir],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if p.returncode != 0:
        raise SystemExit(f"startup child failed ({p.returncode}): {p.stderr.strip().splitlines()[-1:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def run_command(cmd: list[str], cache: str, run_dir: str, extra: list[str]) -> dict[str, float]:
    """Wall time of a whole command and the trainer's own time_to_first_step_s (from its metrics.jsonl)."""
    t0 = time.time()
    p = subprocess.run(
        cmd + OVERRIDES + extra + [f"run_dir={run_dir}"],
        cwd=ROOT,
        env=_env(cache),
        capture_output=True,
        text=True,
        timeout=900,
    )
    wall = time.time() - t0
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip().splitlines()[-3:]}")
    ttfs = None
    mpath = Path(run_dir) / "metrics.jsonl"
    if mpath.is_file():
        for line in mpath.read_text().splitlines():
            rec = json.loads(line)
            if "time_to_first_step_s" in rec:
                ttfs = rec["time_to_first_step_s"]
                break
    return {"wall_s": wall, "time_to_first_step_s": ttfs}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", metavar="RUN_DIR", help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=2, help="cached-start repetitions (median reported)")
    ap.add_argument("--launcher", action="store_true", help="also time launch/smoke.sh (2 ranks) end to end")
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child)))
        return {}
    from bench.common import print_table, write_json

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="k3-startup-") as tmp:
        cache = os.path.join(tmp, "cache")  # empty: the first run builds corpus + tokenizer
        rows.append({"case": "phases, cold data cache", **run_phases(cache, os.path.join(tmp, "r0"))})
        cached = [run_phases(cache, os.path.join(tmp, f"r{i + 1}")) for i in range(args.reps)]
        rows.append(
            {
                "case": f"phases, cached (median of {args.reps})",
                **{k: statistics.median(c[k] for c in cached) for k in cached[0]},
            }
        )
        cmd = run_command([sys.executable, "-m", "training.train"], cache, os.path.join(tmp, "c1"), ONE_PROCESS)
        rows.append(
            {
                "case": "python -m training.train (cached)",
                "total": cmd["wall_s"],
                "to_first_step": cmd["time_to_first_step_s"],
            }
        )
        if args.launcher:
            sm = run_command(["bash", "launch/smoke.sh"], cache, os.path.join(tmp, "c2"), [])
            rows.append(
                {
                    "case": "launch/smoke.sh, 2 ranks (cached)",
                    "total": sm["wall_s"],
                    "to_first_step": sm["time_to_first_step_s"],
                }
            )
    cols = [
        "case",
        "interpreter",
        "import_torch",
        "import_deepspeed",
        "import_hydra_datasets_wandb",
        "import_project",
        "compose_validate",
        "data_tokenizer_prep",
        "trainer_init_engine",
        "first_step",
        "total",
        "to_first_step",
    ]
    print_table("start-up to the first optimizer step, seconds (goal <= 20 s cached)", rows, cols)
    payload = {
        "overrides": OVERRIDES,
        "one_process": ONE_PROCESS,
        "omp_threads": os.environ.get("OMP_NUM_THREADS", "1"),
        "rows": rows,
    }
    print(f"wrote {write_json('startup', payload)}")
    return payload


if __name__ == "__main__":
    main()

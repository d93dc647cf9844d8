"""Training entry point: compose -> validate -> Trainer(cfg).run().

    python -m training.train experiment=smoke train.steps=50            # one process (1-rank gloo group)
    python -m training.launch experiment=smoke                           # 2 ranks, deepspeed launcher, free port
    k3-train experiment=smoke                                            # the console entry point

Every rank composes the same config and writes into the same `run_dir`. A bad config exits with one line on
stderr and status 2 before any process group, run directory or checkpoint is touched. Importing this module has
no side effects; `main` adjusts the process (argv from the launcher, warning filters, accelerator) when it runs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from data.config import digest
from model.config import K3Config
from model.params import count_params
from training import watchdog
from training.checkpoint import CheckpointError, preflight, settle
from training.config import CONF_DIR, TrainConfigError, resolve_run_dir, validate
from training.distributed import env_world, leave, peer_lost
from training.guard import TooManyBadSteps
from training.launch import launch_command
from training.rundir import RunDirError, archive_previous_run, check_run_dir, checkpoint_bytes_estimate, lock_run_dir


def strip_local_rank(argv: list[str]) -> list[str]:
    """The deepspeed launcher appends --local_rank=N (without --no_local_rank); Hydra would reject it."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a.startswith("--local_rank="):
            continue
        elif a == "--local_rank":
            skip = True
        else:
            out.append(a)
    return out


def sweep_job_dir(name: str, overrides: list[str], run_dir: str | None) -> str:
    """The run directory of one sweep job, keyed by its overrides: `runs/sweep/<name>/<key>`, or `<run_dir>/<key>`
    when the sweep was given `run_dir=`. The key is `key-value` items, sorted, joined by `__`, anything but
    [A-Za-z0-9._-] as `_` (a valid unquoted Hydra value and shell word); a long key ends in a digest. Jobs with
    different values never share a directory; re-running the same values continues the same job."""
    items = sorted(o for o in overrides if not o.startswith(("run_dir=", "launcher.", "hydra.")))
    key = "__".join(re.sub(r"[^A-Za-z0-9._-]", "_", o.replace("=", "-", 1)) for o in items) or "base"
    if len(key) > 120:
        key = f"{key[:100]}-{digest(items, 12)}"
    return os.path.join(run_dir or os.path.join("runs", "sweep", name), key)


def sweep_group(job_dir: str) -> str:
    """The W&B group of a sweep's jobs: the sweep's folder (`runs/sweep/<name>`, or the `run_dir=` given), the same
    for every job and for a re-run that continues them, as a plain Hydra value; a long one keeps its last 128
    characters (W&B's limit)."""
    group = re.sub(r"[^A-Za-z0-9._/-]", "_", os.path.normpath(os.path.dirname(job_dir)))
    return group[-128:]


def launch_sweep_job(cfg: DictConfig) -> None:
    """In a Hydra multirun, start this job as its own deepspeed launch into its own run directory
    (`sweep_job_dir`) and wait for it (one process group per job; the sweeping process never joins one)."""
    hc = HydraConfig.get()
    overrides = [o for o in hc.overrides.task if not o.startswith(("launcher.", "hydra."))]
    job_dir = sweep_job_dir(cfg.name, overrides, cfg.run_dir)
    overrides = [o for o in overrides if not o.startswith("run_dir=")] + [f"run_dir={job_dir}"]
    if cfg.logging.group is None:  # one W&B group per sweep: its folder (the same for every job and every re-run)
        overrides.append(f"logging.group={sweep_group(job_dir)}")
    # each job on a master port of its own (training/launch.py): jobs of two sweeps, or a sweep and a test, never meet
    cmd = launch_command(overrides, cfg.launcher.num_gpus, os.path.abspath(__file__), cfg.launcher.hostfile or None)
    print("sweep job:", " ".join(cmd), flush=True)
    rc = subprocess.call(cmd)
    if rc != 0:
        raise SystemExit(f"sweep job {hc.job.num} ({job_dir}) failed with exit status {rc}")


def prepare_run_dir(cfg: DictConfig, mcfg: K3Config, world_size: int, rank: int) -> str:
    """Rank 0, before anything is written: refuse a job that would mix two runs (identity, resume=none), then
    lock the run dir for this job's life and archive (start_over) or settle (fallback) its checkpoints."""
    run_dir = resolve_run_dir(cfg)
    if rank != 0:
        return run_dir
    preflight(cfg, mcfg, world_size, run_dir)
    lock_run_dir(run_dir)
    if cfg.checkpoint.start_over:
        dst = archive_previous_run(run_dir)
        if dst:
            print(f"checkpoint.start_over: archived the previous run to {dst}", flush=True)
    else:
        settle(cfg, run_dir)
    return run_dir


@hydra.main(config_path=CONF_DIR, config_name="train", version_base="1.3")
def hydra_main(cfg: DictConfig) -> None:
    from training.trainer import Trainer  # torch/deepspeed/data set-up: only once the config is known to be good

    info = env_world()
    if cfg.launcher.num_gpus > 0 and "RANK" not in os.environ:
        launch_sweep_job(cfg)
        return
    watchdog.start()  # a rank of the deepspeed launcher never outlives it
    try:
        mcfg = validate(cfg, info.world_size)
        run_dir = prepare_run_dir(cfg, mcfg, info.world_size, info.rank)
        check_run_dir(run_dir, checkpoint_bytes_estimate(count_params(mcfg)[0], int(cfg.checkpoint.keep_last)))
    except (TrainConfigError, ValueError, RunDirError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    try:
        Trainer(cfg, mcfg).run()
    except (CheckpointError, TooManyBadSteps) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(3)
    except TrainConfigError as e:  # found while building (an eval set without rows, a tokenizer mismatch)
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except Exception as e:
        if not peer_lost(e):
            raise
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        print(
            f"error: rank {info.rank}: a collective failed, a peer rank or node is lost ({why}); the job stops, "
            "resume with checkpoint.resume=auto (parallel.timeout_s bounds the wait)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(4)  # not sys.exit: the process group's teardown can block on collectives still queued to the peer


def cpu_threads_per_rank() -> int:
    """Cores this process may use / ranks on this machine: the launchers leave OMP_NUM_THREADS unset, and two
    ranks each using every core run many times slower than with one thread each."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)
    return max(1, cores // max(1, local_ranks))


def main() -> None:
    """Console/launcher entry: strip the launcher's --local_rank, quiet known noise, pick a CPU thread count,
    then run Hydra."""
    sys.argv = strip_local_rank(sys.argv)
    if not torch.cuda.is_available() and not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(cpu_threads_per_rank())
    # DeepSpeed's ZeRO collectives call a torch API deprecated in 2.13; the warning repeats on every rank and step.
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning)
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # silences DeepSpeed's accelerator-detection warning
    try:
        hydra_main()
    except SystemExit as e:  # the error paths above (2, 3); a rank with a process group still leaves below
        if not isinstance(e.code, int | None):
            raise
        sys.exit(leave(e.code or 0))
    sys.exit(leave(0))


if __name__ == "__main__":
    main()

"""Training entry point: compose -> validate -> Trainer(cfg).run().

    python -m training.train experiment=smoke train.steps=50            # one process (1-rank gloo group)
    deepspeed --no_local_rank --num_gpus 2 training/train.py experiment=smoke
    k3-train experiment=smoke                                            # the console entry point

Every rank composes the same config and writes into the same `run_dir`. A bad config exits with one line on
stderr and status 2 before any process group, run directory or checkpoint is touched. Importing this module has
no side effects; `main` adjusts the process (argv from the launcher, warning filters, accelerator) when it runs.
"""
from __future__ import annotations

import os
import subprocess
import sys
import warnings

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from model.params import count_params
from training.checkpoint import CheckpointError
from training.config import CONF_DIR, TrainConfigError, resolve_run_dir, validate
from training.distributed import env_world
from training.guard import TooManyBadSteps
from training.rundir import RunDirError, check_run_dir, checkpoint_bytes_estimate


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


def launch_sweep_job(cfg: DictConfig) -> None:
    """In a Hydra multirun, start this job as its own deepspeed launch and wait for it (one process group per
    job; the sweeping process itself never joins one)."""
    hc = HydraConfig.get()
    overrides = [o for o in hc.overrides.task if not o.startswith(("launcher.", "hydra."))]
    if not any(o.startswith("run_dir=") for o in overrides):
        overrides.append(f"run_dir={os.path.join('runs', 'sweep', cfg.name, str(hc.job.num))}")
    cmd = ["deepspeed", "--no_local_rank", "--num_gpus", str(cfg.launcher.num_gpus)]
    if cfg.launcher.hostfile:
        cmd += ["--hostfile", cfg.launcher.hostfile]
    cmd += [os.path.abspath(__file__), *overrides]
    print("sweep job:", " ".join(cmd), flush=True)
    rc = subprocess.call(cmd)
    if rc != 0:
        raise SystemExit(f"sweep job {hc.job.num} failed with exit status {rc}")


@hydra.main(config_path=CONF_DIR, config_name="train", version_base="1.3")
def hydra_main(cfg: DictConfig) -> None:
    from training.trainer import Trainer  # torch/deepspeed/data set-up: only once the config is known to be good

    info = env_world()
    if cfg.launcher.num_gpus > 0 and "RANK" not in os.environ:
        launch_sweep_job(cfg)
        return
    try:
        mcfg = validate(cfg, info.world_size)
        check_run_dir(resolve_run_dir(cfg), checkpoint_bytes_estimate(count_params(mcfg)[0],
                                                                      int(cfg.checkpoint.keep_last)))
    except (TrainConfigError, ValueError, RunDirError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    try:
        Trainer(cfg, mcfg).run()
    except (CheckpointError, TooManyBadSteps) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(3)


def main() -> None:
    """Console/launcher entry: strip the launcher's --local_rank, quiet known noise, then run Hydra."""
    sys.argv = strip_local_rank(sys.argv)
    # DeepSpeed's ZeRO collectives call a torch API deprecated in 2.13; the warning repeats on every rank and step.
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning)
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # silences DeepSpeed's accelerator-detection warning
    hydra_main()


if __name__ == "__main__":
    main()

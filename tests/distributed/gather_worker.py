"""A training job (training/train.py's Trainer, Hydra overrides on the command line) that, after its last step,
also gathers the full model in-process (`Parallelism.full_state_dict`: ZeRO-3 partitions and every EP rank's
experts) and writes it to <run_dir>/gathered.pt on rank 0: the reference `training.export` must reproduce.
With K3_GATHER_AT_START=1 it also writes the model as built, before step 1, and the bytes each rank read from
model.init_from, to <run_dir>/gathered_start.pt (the sharded start's reference).

    deepspeed --no_local_rank --num_gpus 2 tests/distributed/gather_worker.py <overrides...>
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from training.config import compose, resolve_run_dir, validate  # noqa: E402
from training.distributed import env_world  # noqa: E402
from training.trainer import Trainer  # noqa: E402


def main() -> None:
    cfg = compose(sys.argv[1:])
    trainer = Trainer(cfg, validate(cfg, env_world().world_size))
    if os.environ.get("K3_GATHER_AT_START"):  # the model as built (sharded start), before any step
        state = trainer.ep.full_state_dict(trainer.module)
        sizes = [None] * trainer.world
        torch.distributed.all_gather_object(sizes, trainer.ep.init_bytes_read)
        if trainer.info.is_main:
            torch.save(
                {"state": {k: v.detach().cpu() for k, v in state.items()}, "bytes_read": sizes},
                os.path.join(resolve_run_dir(cfg), "gathered_start.pt"),
            )
    trainer.run()
    state = trainer.ep.full_state_dict(trainer.module)  # collective
    if trainer.info.is_main:
        torch.save({k: v.detach().cpu() for k, v in state.items()}, os.path.join(resolve_run_dir(cfg), "gathered.pt"))


if __name__ == "__main__":
    main()

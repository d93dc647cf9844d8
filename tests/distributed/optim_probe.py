"""Test-only trainer callback: what the optimizer holds right after a resume, before the first step.

At train start rank 0 of a 1-rank, EP=1 ZeRO-1/2 job writes <run_dir>/optim_probe.pt: for every parameter its
full fp32 master and optimizer state (exp_avg, exp_avg_sq), read back through DeepSpeed's public tensor-fragment
API (`safe_get_full_fp32_param`, `safe_get_full_optimizer_state`), plus the Adam step. Plugged in with
`callbacks=[tests.distributed.optim_probe.OptimizerProbe]`; production code never imports it.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from training.callbacks import Callback

PROBE_FILE = "optim_probe.pt"


class OptimizerProbe(Callback):
    def on_train_start(self, trainer: Any) -> None:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        if trainer.world != 1 or trainer.ep.ep_size != 1:
            raise ValueError("OptimizerProbe reads whole tensors on one rank: use it with 1 rank, EP=1")
        opt = trainer.engine.optimizer
        opt._lazy_init_hp_params_optimizer_state()  # DeepSpeed links the moments into the fragments at step 1
        out: dict[str, Any] = {}
        for name, p in trainer.engine.module.named_parameters():
            out[name] = {
                "fp32": safe_get_full_fp32_param(p).clone(),
                **{k: safe_get_full_optimizer_state(p, k).clone() for k in ("exp_avg", "exp_avg_sq")},
            }
        steps = {float(st["step"]) for st in opt.optimizer.state.values()}
        torch.save({"params": out, "steps": sorted(steps)}, os.path.join(trainer.run_dir, PROBE_FILE))

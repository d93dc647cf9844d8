"""ZeRO-3 + expert parallelism (AutoEP placement) + Ulysses sequence parallelism on DeepSpeed 0.19.8.

DeepSpeed's `engine._validate_zero3_moe_compatibility` asserts "AutoEP with ZeRO Stage 3 does not support sequence
parallelism yet". What that guards, and why each holds for K3 (training/parallelize.py, training/parallel/ulysses.py):

  * partition groups: `engine._resolve_zero3_param_placement` partitions replicated (dense) params over
    `seq_data_parallel_group` -- with DeepSpeed's SP mpu (parallel_state_sp) that is every rank, sequence and data
    alike -- and params tagged `ds_zero_placement_family="autoep_expert"` over the expert-data-parallel group of
    their `ds_zero_partition_group_name`. The sharded start (training/parallel/construct.py) converts dense params
    over the world and experts over that same group, which the placement re-checks for experts.
  * expert / expert-data groups: `groups._create_expert_and_data_parallel(P)` (built by `expert_groups` before the
    mpu exists: the legacy path) gives EP groups of P consecutive ranks and strided expert-data groups; the SP-mode
    path AutoEP itself would take (`mp_mode="sp"`, consecutive ordering) builds the very same tables at pipeline
    size 1. K3 needs nothing more of them: every rank routes only its own T/S tokens through the all-to-all over
    its EP group (training/parallel/alltoall.py), whether the EP group spans SP partners or not, so an expert's
    gradient on one rank is the sum over the tokens of its EP group's ranks.
  * gradient averaging: ZeRO-3's reduce-scatter path (`stage3.__avg_scatter_grads`, `reduce_scatter` on, refused
    off by `check_layout`) sums each gradient over its partition group and pre-divides by that group's size
    (`reduce_scatter_coalesced`); for AutoEP experts `_gradient_averaging_world_size` rescales so the divisor is
    the whole `dp_process_group` (= every rank under SP). Dense and expert gradients are therefore both sums over
    every token of the world divided by W, which is what the trainer's loss scale assumes for ZeRO-3
    (`gradient_averaging_ranks` = W; each SP rank's loss covers only its own tokens, so no SP factor is owed).
    ZeRO-3's all-reduce path divides by W / S instead (the SP factor): that path stays refused.
  * gradient norm: each sub-group's squared norm is summed over its partition group and, for experts, over the EP
    group (stage3 `get_grad_norm_direct`) -- every expert element counted once, S or not.

So the only thing to lift is the assertion. `allow_sequence_parallel` does that for one `deepspeed.initialize`
call: the original validator runs with `sequence_parallel_size` read as 1, so every other AutoEP + ZeRO-3 check
(native MoE, qgZ, hpZ, expert TP) still fires. The DeepSpeed sources this reasoning reads are pinned below by
hash; `contract_drift()` names any that changed, `check_layout` refuses the layout then (before any process group),
and tests/training/test_autoep_sp.py fails on an upgrade, so a changed DeepSpeed never trains this layout wrongly.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

DEEPSPEED_VERSION = "0.19.8"
# (module, qualified name) -> sha256[:16] of the source reviewed above (deepspeed 0.19.8)
PINNED_SOURCES: dict[tuple[str, str], str] = {
    ("deepspeed.runtime.engine", "DeepSpeedEngine._validate_zero3_moe_compatibility"): "2a95ade43c86e5bf",
    ("deepspeed.runtime.engine", "DeepSpeedEngine._resolve_zero3_param_placement"): "3bf673f7ae8d81e1",
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3._gradient_averaging_world_size"): (
        "0de1999fb7351386"
    ),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3._autoep_expert_parallel_group"): (
        "b656e1e7598e92b5"
    ),
    (
        "deepspeed.runtime.zero.stage3",
        "DeepSpeedZeroOptimizer_Stage3._DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads",
    ): ("f392cb14952e5019"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3.get_grad_norm_direct"): "5ba2252d5f16b541",
    ("deepspeed.runtime.comm.coalesced_collectives", "reduce_scatter_coalesced"): "d05c7b944514f710",
    ("deepspeed.utils.groups", "_create_expert_and_data_parallel"): "52f333e8eea25829",
    ("deepspeed.utils.groups", "_get_sequence_data_parallel_group"): "3730ce54b2b4b6f4",
}


def _unwrap(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The function under DeepSpeed's `instrument_w_nvtx` / lru-cache style wrappers (closure over `func`)."""
    fn = inspect.unwrap(fn)
    while fn.__name__ == "wrapped_fn" and fn.__closure__:
        inner = [c.cell_contents for c in fn.__closure__ if inspect.isfunction(c.cell_contents)]
        if not inner:
            break
        fn = inner[0]
    return fn


def source_hash(module: str, qualname: str) -> str:
    """sha256[:16] of the installed source of `module.qualname`."""
    import importlib

    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return hashlib.sha256(inspect.getsource(_unwrap(obj)).encode()).hexdigest()[:16]


def contract_drift() -> list[str]:
    """The pinned DeepSpeed pieces whose installed source differs from the reviewed one (empty: all hold)."""
    import deepspeed

    out = [] if deepspeed.__version__ == DEEPSPEED_VERSION else [f"deepspeed=={deepspeed.__version__}"]
    for (module, qualname), want in PINNED_SOURCES.items():
        try:
            got = source_hash(module, qualname)
        except (AttributeError, ImportError, OSError, TypeError):
            got = "missing"
        if got != want:
            out.append(f"{module}.{qualname}")
    return out


@contextmanager
def allow_sequence_parallel() -> Iterator[None]:
    """Within the block, DeepSpeedEngine's ZeRO-3 MoE validator accepts AutoEP layers with sequence parallelism
    (module docstring); every other check it makes is unchanged. Refuses if a pinned contract drifted."""
    drift = contract_drift()
    if drift:
        raise RuntimeError(
            f"ZeRO-3 + EP + SP relies on DeepSpeed {DEEPSPEED_VERSION} internals that changed: {', '.join(drift)}; "
            "re-verify training/parallel/autoep_sp.py against them"
        )
    from deepspeed.runtime.engine import DeepSpeedEngine

    original = DeepSpeedEngine._validate_zero3_moe_compatibility

    def validate(self) -> None:
        sp = self.sequence_parallel_size
        self.sequence_parallel_size = 1  # read only by the SP assertion of the original
        try:
            original(self)
        finally:
            self.sequence_parallel_size = sp

    DeepSpeedEngine._validate_zero3_moe_compatibility = validate
    try:
        yield
    finally:
        DeepSpeedEngine._validate_zero3_moe_compatibility = original

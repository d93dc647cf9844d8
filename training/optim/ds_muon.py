"""DeepSpeed's Muon modules, imported without `torch.compile`: every ZeRO rank imports them, k3-train runs none of
their compiled kernels, and compiling at import costs each rank seconds.

`deepspeed.initialize` imports `deepspeed.runtime.zero.muon.muon_optimizer` on every ZeRO run, Muon or not
(`zero.utils.is_zero_supported_optimizer`, 0.19.8), and its `original_muon` decorates three kernels with
`deepspeed.runtime.compiler.compile()`, i.e. `torch.compile`, which imports torch._dynamo and inductor's whole
lowering stack at decoration time (measured: 4-5 s of CPU per process on the 2-core CI machine, the largest
share of a tiny job's start). k3-train never calls those kernels: `training/optim/muon.py` points
`original_muon.muon_update` (the one name DeepSpeed's ZeRO paths call) at its own fp32 kernel. So this module
imports both modules once, with `compiler.compile` returning the function undecorated for the duration of the
import, and puts it back. Contract relied on (tests/training/test_ds_muon.py): `original_muon` decorates with
`compiler.compile()` at import time and nothing else in that import compiles; if a DeepSpeed upgrade changes
that, the kernels are merely compiled again (slower start, same results).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from deepspeed.runtime import compiler


def _undecorated() -> Callable[[Any], Any]:
    return lambda fn: fn


def _import_uncompiled() -> None:
    if "deepspeed.runtime.zero.muon.original_muon" in sys.modules:
        return  # imported already (compiled or not): nothing to save
    compile_ = compiler.compile
    compiler.compile = _undecorated
    try:
        import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401 - imports original_muon too
    finally:
        compiler.compile = compile_


_import_uncompiled()

from deepspeed.runtime.zero.muon import original_muon  # noqa: E402 - after the uncompiled import above
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam  # noqa: E402

__all__ = ["MuonWithAuxAdam", "original_muon"]

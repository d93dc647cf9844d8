"""training/optim/ds_muon.py: DeepSpeed's Muon modules load without compiling anything (every ZeRO rank imports them
in deepspeed.initialize), and k3-train's own kernel is the one DeepSpeed's ZeRO paths call."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
from deepspeed.runtime import compiler
before = compiler.compile
import training.optim.ds_muon
from deepspeed.runtime.zero.muon import original_muon
from deepspeed.runtime.zero.utils import is_zero_supported_optimizer  # what deepspeed.initialize calls
print(compiler.compile is before)
print("torch._inductor.compile_fx" in sys.modules)
print(hasattr(original_muon.zeropower_via_newtonschulz5, "_torchdynamo_orig_callable"))
"""


def _probe() -> list[str]:
    p = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout.split()


def test_importing_deepspeeds_muon_compiles_nothing_and_restores_the_compiler_hook():
    restored, inductor_loaded, compiled = _probe()
    assert restored == "True"
    assert inductor_loaded == "False"  # torch.compile at decoration time imports inductor's lowering stack
    assert compiled == "False"


def test_deepspeeds_muon_still_decorates_with_the_compiler_hook_this_relies_on():
    """If a DeepSpeed upgrade stops decorating through `compiler.compile()`, the uncompiled import saves nothing."""
    import inspect

    from training.optim.ds_muon import original_muon

    assert inspect.getsource(original_muon).count("@compiler.compile()") >= 2

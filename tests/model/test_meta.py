"""model/meta.py: a model built under `on_meta()` is the model `torch.device("meta")` builds (names, shapes, dtypes),
and building it imports no compiler stack (what a planner or export process would otherwise pay on its start)."""

from __future__ import annotations

import subprocess
import sys

import torch

from model.config import K3Config
from model.k3 import K3ForCausalLM
from model.meta import on_meta
from tests.conftest import REPO_ROOT


def _layout(model: torch.nn.Module) -> dict[str, tuple]:
    return {k: (tuple(v.shape), v.dtype, v.device.type) for k, v in model.state_dict().items()}


def test_on_meta_builds_the_same_tensors_as_the_meta_device():
    cfg = K3Config.preset("tiny")
    with torch.device("meta"):
        want = _layout(K3ForCausalLM(cfg))
    with on_meta():
        got = _layout(K3ForCausalLM(cfg))
    assert got == want and {d for _, _, d in got.values()} == {"meta"}


def test_fills_outside_on_meta_still_run():
    with on_meta():
        pass
    t = torch.zeros(4)
    torch.nn.init.normal_(t)
    assert bool((t != 0).any())


def test_building_k3_on_meta_imports_no_compiler():
    code = (
        "import sys; from model.config import K3Config; from model.params import count_params; "
        "count_params(K3Config.preset('k3')); print('torch._dynamo' in sys.modules)"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "False", p.stderr[-2000:]

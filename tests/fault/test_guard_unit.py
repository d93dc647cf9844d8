"""Unit properties of the step guard (training/guard.py) and the fault hooks (tests/fault/injector.py)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from tests.fault import injector
from training import guard, rundir


def _trained_adamw() -> tuple[torch.nn.Linear, torch.optim.AdamW]:
    lin = torch.nn.Linear(5, 3)
    opt = torch.optim.AdamW(lin.parameters(), lr=0.1, foreach=False)
    lin(torch.randn(7, 5)).sum().backward()
    opt.step()  # optimizer state exists
    return lin, opt


def _snapshot(lin, opt):
    return (
        [p.detach().clone() for p in lin.parameters()],
        [{k: v.clone() for k, v in s.items()} for s in opt.state.values()],
    )


def test_install_skips_a_nonfinite_gradient_without_touching_weights_or_state():
    lin, opt = _trained_adamw()
    assert guard.install(SimpleNamespace(optimizer=opt))
    before = _snapshot(lin, opt)
    opt.zero_grad()
    lin(torch.randn(7, 5)).sum().backward()
    lin.bias.grad[1] = float("inf")
    opt.step()
    after = _snapshot(lin, opt)
    assert opt.overflow is True and all(p.grad is None for p in lin.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
    assert all(torch.equal(a[k], b[k]) for a, b in zip(before[1], after[1]) for k in a)


def test_install_lets_a_finite_step_through():
    lin, opt = _trained_adamw()
    guard.install(SimpleNamespace(optimizer=opt))
    w = lin.weight.detach().clone()
    lin(torch.randn(7, 5)).sum().backward()
    opt.step()
    assert opt.overflow is False and not torch.equal(w, lin.weight)


def test_install_leaves_optimizers_with_their_own_check_alone():
    lin, opt = _trained_adamw()
    opt.overflow = False  # what DeepSpeed's ZeRO optimizers expose
    assert guard.install(SimpleNamespace(optimizer=opt)) is False


def test_guard_counts_skips_and_resets_the_streak_on_a_good_step():
    g = guard.StepGuard(max_bad_steps=2)
    assert g.after_step(1, applied=False, loss=math.nan) and not g.exhausted
    assert not g.after_step(2, applied=True, loss=1.0) and g.consecutive == 0
    g.after_step(3, applied=False, loss=math.inf)
    g.after_step(4, applied=False, loss=math.nan)
    assert g.exhausted and g.skipped_steps == 3
    assert "train.max_bad_steps=2" in g.message(4, None) and "\n" not in g.message(4, None)


def test_guard_state_round_trips():
    g = guard.StepGuard(5)
    g.after_step(1, applied=False, loss=math.nan)
    h = guard.StepGuard(5)
    h.load_state_dict(g.state_dict())
    assert h.state_dict() == g.state_dict() == {"skipped_steps": 1, "consecutive_bad_steps": 1}


def test_zero_max_bad_steps_never_stops():
    g = guard.StepGuard(0)
    for s in range(50):
        g.after_step(s, applied=False, loss=math.nan)
    assert not g.exhausted


def test_nan_fault_poisons_only_its_step():
    x = torch.tensor(2.0)
    assert torch.isnan(injector.poison(x, 3, frozenset({3}), frozenset()))
    assert injector.poison(x, 2, frozenset({3}), frozenset()) is x


def test_inf_grad_fault_keeps_the_loss_finite_but_not_its_gradient():
    w = torch.tensor(3.0, requires_grad=True)
    loss = injector.poison(w * 2, 1, frozenset(), frozenset({1}))
    loss.backward()
    assert float(loss.detach()) == 6.0 and math.isinf(float(w.grad))


def test_bad_fault_env_is_a_one_line_error(monkeypatch):
    monkeypatch.setenv("K3_FAULT_NAN_AT_STEP", "three")
    with pytest.raises(ValueError, match="K3_FAULT_NAN_AT_STEP='three' must be a comma-separated list"):
        injector.FaultInjector()


def test_production_code_never_imports_the_fault_injector():
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    hits = [
        str(p)
        for pkg in ("model", "data", "training")
        for p in (root / pkg).rglob("*.py")
        if "injector" in p.read_text() and "tests.fault" in p.read_text()
    ]
    assert hits == []


def test_checkpoint_estimate_grows_with_kept_checkpoints():
    assert rundir.checkpoint_bytes_estimate(10**6, 3) > rundir.checkpoint_bytes_estimate(10**6, 1)

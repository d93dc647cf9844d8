"""training/parallel/autoep_sp.py: ZeRO-3 + EP + SP is lifted only for the DeepSpeed sources it was reviewed against.

The distributed proof (2 ranks SP=2 + EP=2 + ZeRO-3 == 1 rank ZeRO-0) is tests/distributed/test_sequence_parallel.py;
here: the pinned sources, the refusal when one drifts, and that the lifted validator keeps every other check.
"""

from __future__ import annotations

import types

import pytest

from training.config import TrainConfigError, compose, validate
from training.parallel import autoep_sp

Z3_EP2_SP2 = ["experiment=tiny_ci", "deepspeed=zero3", "parallel.ep_size=2", "parallel=sp2"]


def test_the_pinned_deepspeed_sources_are_the_installed_ones():
    """Fails on a DeepSpeed upgrade that touches any piece the ZeRO-3 + EP + SP reasoning reads: re-review it."""
    assert autoep_sp.contract_drift() == []


def test_zero3_ep_and_sp_together_pass_validation():
    validate(compose(Z3_EP2_SP2), 2)


def test_a_drifted_source_refuses_the_layout_in_one_line_before_any_process_group(monkeypatch):
    key = ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3._gradient_averaging_world_size")
    monkeypatch.setitem(autoep_sp.PINNED_SOURCES, key, "0" * 16)
    with pytest.raises(TrainConfigError) as e:
        validate(compose(Z3_EP2_SP2), 2)
    msg = str(e.value)
    assert "_gradient_averaging_world_size" in msg and "deepspeed=zero2" in msg and "\n" not in msg
    with pytest.raises(RuntimeError, match="_gradient_averaging_world_size"), autoep_sp.allow_sequence_parallel():
        pass


def _engine(sp: int, qgz: bool = False):
    """What DeepSpeedEngine._validate_zero3_moe_compatibility reads off the engine, around one layer presented as
    AutoEP the way training/parallelize.py presents LatentMoE."""
    import torch

    from training.parallelize import _autoep_class

    layer = torch.nn.Identity()
    layer.__class__ = _autoep_class(torch.nn.Identity)  # as present_as_autoep does
    module = torch.nn.Sequential(layer)
    config = types.SimpleNamespace(
        zero_config=types.SimpleNamespace(zero_hpz_partition_size=1),
        expert_parallel_config=types.SimpleNamespace(expert_tensor_parallel_size=1),
    )
    return types.SimpleNamespace(
        has_moe_layers=True,
        module=module,
        sequence_parallel_size=sp,
        zero_quantized_gradients=lambda: qgz,
        _config=config,
    )


def test_deepspeed_alone_refuses_autoep_zero3_with_sequence_parallelism():
    from deepspeed.runtime.engine import DeepSpeedEngine

    with pytest.raises(AssertionError, match="does not support sequence parallelism"):
        DeepSpeedEngine._validate_zero3_moe_compatibility(_engine(2))


def test_inside_the_scope_sp_is_accepted_and_the_engine_keeps_its_sp_size():
    from deepspeed.runtime.engine import DeepSpeedEngine

    engine = _engine(2)
    with autoep_sp.allow_sequence_parallel():
        DeepSpeedEngine._validate_zero3_moe_compatibility(engine)
    assert engine.sequence_parallel_size == 2


def test_inside_the_scope_the_other_autoep_zero3_checks_still_refuse():
    from deepspeed.runtime.engine import DeepSpeedEngine

    with autoep_sp.allow_sequence_parallel(), pytest.raises(AssertionError, match="zero_quantized_gradients"):
        DeepSpeedEngine._validate_zero3_moe_compatibility(_engine(2, qgz=True))


def test_the_scope_ends_with_the_block():
    from deepspeed.runtime.engine import DeepSpeedEngine

    with autoep_sp.allow_sequence_parallel():
        pass
    with pytest.raises(AssertionError, match="does not support sequence parallelism"):
        DeepSpeedEngine._validate_zero3_moe_compatibility(_engine(2))

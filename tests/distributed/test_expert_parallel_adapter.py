"""How training/parallelize.py presents the model's LatentMoE experts to DeepSpeed (in-process, no process group):
as native MoE layers for ZeRO 0-2, as AutoEP layers for ZeRO-3; and which parameters ZeRO-3 must gather
outside their module's forward."""

from __future__ import annotations

import re

import pytest
import torch

from model.config import K3Config
from model.moe.experts import LatentExperts
from model.moe.layer import LatentMoE
from training.parallel.ds_moe import present_as_deepspeed_moe, undo_deepspeed_moe
from training.parallelize import AUTOEP_FAMILY, parallelize, present_as_autoep, register_zero3_external_params


def _cfg(**kw) -> K3Config:
    return K3Config.preset(
        "tiny",
        hidden_size=32,
        num_experts=4,
        num_experts_per_token=2,
        moe_intermediate_size=8,
        routed_expert_hidden_size=8,
        **kw,
    )


class _OneMoE(torch.nn.Module):
    def __init__(self, cfg: K3Config) -> None:
        super().__init__()
        self.moe = LatentMoE(cfg, 1)

    def moe_layers(self):
        return [self.moe]


def test_presented_experts_are_deepspeed_moe_and_still_latent_experts():
    from deepspeed.moe.layer import MoE

    ex = present_as_deepspeed_moe(LatentExperts(_cfg()), num_experts=4, ep_size=1)
    assert isinstance(ex, MoE) and isinstance(ex, LatentExperts)
    assert (ex.num_experts, ex.num_local_experts, ex.expert_group_name) == (4, 4, "ep_size_1")


def test_expert_params_are_tagged_for_the_expert_data_parallel_group():
    from deepspeed.moe.utils import is_moe_param

    ex = present_as_deepspeed_moe(LatentExperts(_cfg()), num_experts=4, ep_size=1)
    assert all(is_moe_param(p) and p.group_name == "ep_size_1" for p in ex.parameters())


def test_model_state_dict_keeps_stacked_hf_style_names():
    torch.manual_seed(0)
    moe = LatentMoE(_cfg(), 1)
    before = {k: v.clone() for k, v in moe.state_dict().items()}
    present_as_deepspeed_moe(moe.experts, num_experts=4, ep_size=1)
    after = moe.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_direct_experts_state_dict_is_one_entry_per_expert_in_deepspeed_naming():
    ex = present_as_deepspeed_moe(LatentExperts(_cfg()), num_experts=4, ep_size=1)
    sd = ex.state_dict()
    pattern = re.compile(r"^deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.(w[123])$")
    assert len(sd) == 4 * 3 and all(pattern.match(k) for k in sd)
    assert torch.equal(sd["deepspeed_moe.experts.deepspeed_experts.2.w3"], ex.w3[2])


def test_per_expert_entries_load_back_into_the_stacked_tensors():
    torch.manual_seed(0)
    src = present_as_deepspeed_moe(LatentExperts(_cfg()), num_experts=4, ep_size=1)
    torch.manual_seed(1)
    dst = present_as_deepspeed_moe(LatentExperts(_cfg()), num_experts=4, ep_size=1)
    dst.load_state_dict(src.state_dict(), strict=True)
    assert all(torch.equal(getattr(dst, w), getattr(src, w)) for w in ("w1", "w3", "w2"))


def test_presentation_does_not_change_the_layer_output():
    torch.manual_seed(0)
    moe = LatentMoE(_cfg(), 1).double()
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    y0, _ = moe(x)
    present_as_deepspeed_moe(moe.experts, num_experts=4, ep_size=1)
    y1, _ = moe(x)
    undo_deepspeed_moe(moe.experts)
    y2, _ = moe(x)
    assert torch.equal(y0, y1) and torch.equal(y0, y2)


def test_zero3_presentation_is_an_autoep_layer_with_deepspeeds_placement_tags():
    from deepspeed.checkpoint.constants import AUTOEP_PARAM_LOGICAL_SHAPE, DS_AUTOEP_UC_META
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    torch.manual_seed(0)
    moe = LatentMoE(_cfg(), 1).double()
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    y0, _ = moe(x)
    present_as_autoep(moe, num_experts=4, ep_size=1, ep_rank=0, ep_group=None, edp_group=None)
    assert isinstance(moe, AutoEPMoELayer) and isinstance(moe, LatentMoE)
    assert (moe.ep_group_name, moe.num_local_experts, moe.ep_size) == ("ep_size_1", 4, 1)
    for w in ("w1", "w2", "w3"):
        p = getattr(moe.experts, w)
        assert (p.allreduce, p.group_name, p.ds_zero_placement_family, p.ds_zero_partition_group_name) == (
            False,
            "ep_size_1",
            AUTOEP_FAMILY,
            "ep_size_1",
        )
        assert getattr(p, DS_AUTOEP_UC_META)[AUTOEP_PARAM_LOGICAL_SHAPE] == [4, *p.shape[1:]]
    assert not hasattr(moe.gate.weight, "ds_zero_placement_family")  # dense: partitioned over every rank
    y1, _ = moe(x)
    assert torch.equal(y0, y1)


def _registrations(model, monkeypatch) -> set[tuple[str, str]]:
    import deepspeed.runtime.zero.partition_parameters as pp

    mods = {id(m): n for n, m in model.named_modules()}
    params = {id(p): n for n, p in model.named_parameters()}
    got: set[tuple[str, str]] = set()
    monkeypatch.setattr(pp, "register_external_parameter", lambda owner, p: got.add((mods[id(owner)], params[id(p)])))
    register_zero3_external_params(model)
    return got


def test_zero3_external_params_are_found_on_a_meta_model_as_on_a_real_one(monkeypatch):
    from model import K3ForCausalLM

    cfg = K3Config.preset("tiny", num_hidden_layers=3)
    real = _registrations(K3ForCausalLM(cfg), monkeypatch)
    with torch.device("meta"):
        meta_model = K3ForCausalLM(cfg)
    meta = _registrations(meta_model, monkeypatch)
    assert real == meta
    moe = "model.layers.1.block_sparse_moe"
    assert {
        (moe, f"{moe}.experts.w1"),
        (moe, f"{moe}.gate.weight"),
        ("model.layers.1", "model.layers.1.mlp_res_proj.weight"),
    } <= real


def test_ep_size_that_does_not_divide_the_experts_is_refused():
    with pytest.raises(ValueError, match="must divide"):
        parallelize(_OneMoE(_cfg()), ep_size=3, zero_stage=2)

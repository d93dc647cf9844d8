"""How training/ presents the model's LatentMoE experts to DeepSpeed (in-process, no process group)."""
from __future__ import annotations

import re

import pytest
import torch

from model.config import K3Config
from model.moe.experts import LatentExperts
from model.moe.layer import LatentMoE
from training.ep.deepspeed_moe import present_as_deepspeed_moe, undo_deepspeed_moe
from training.expert_parallel import setup_expert_parallel


def _cfg(**kw) -> K3Config:
    return K3Config.preset("tiny", hidden_size=32, num_experts=4, num_experts_per_token=2, moe_intermediate_size=8,
                           routed_expert_hidden_size=8, **kw)


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


def test_zero3_with_expert_parallelism_is_refused_in_one_line():
    with pytest.raises(ValueError, match="ZeRO-3") as e:
        setup_expert_parallel(_OneMoE(_cfg()), ep_size=2, zero_stage=3)
    assert "\n" not in str(e.value)


def test_zero3_with_ep_size_1_keeps_experts_as_plain_parameters():
    model = _OneMoE(_cfg())
    handle = setup_expert_parallel(model, ep_size=1, zero_stage=3)
    assert handle.group_name is None and type(model.moe.experts) is LatentExperts
    assert not any(hasattr(p, "allreduce") for p in model.parameters())


def test_ep_size_that_does_not_divide_the_experts_is_refused():
    with pytest.raises(ValueError, match="must divide"):
        setup_expert_parallel(_OneMoE(_cfg()), ep_size=3, zero_stage=2)

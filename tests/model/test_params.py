"""Parameter counts from the real modules on the meta device (docs/model.md §8, §9, §10 item 15; issue 2 §4)."""

from __future__ import annotations

import pytest

from model.config import K3Config
from model.k3 import K3ForCausalLM
from model.params import build_meta, count_params, param_breakdown


@pytest.fixture(scope="module")
def k3_meta():
    return build_meta(K3Config.preset("k3"))


def test_k3_counts_match_the_published_totals():
    assert count_params(K3Config.preset("k3")) == (2_779_484_476_000, 104_189_612_640)


@pytest.mark.parametrize("name, total, active", [("tiny", 10_008_528, 6_895_568), ("small", 274_111_912, 125_083_048)])
def test_small_presets_match_spec_section_9(name, total, active):
    assert count_params(K3Config.preset(name)) == (total, active)


def test_golden_tiny_hf_config_total(golden_tiny_dir):
    total, _ = count_params(K3Config.from_hf_config(golden_tiny_dir))
    assert total == 1_508_368


def test_k3_breakdown_matches_the_spec_component_table(k3_meta):
    b = param_breakdown(K3Config.preset("k3"), k3_meta)
    assert b["embedding"] == b["lm_head"] == 1_174_405_120
    assert b["kda_layer"] == 443_740_384 and b["mla_layer"] == 232_196_096
    assert b["dense_ffn_layer"] == 726_663_168 and b["per_routed_expert"] == 33_030_144
    assert (b["moe_layer"], b["moe_layer_active"]) == (29_784_936_832, 718_410_112)
    assert b["moe_router"] == 92 * 6_423_424 and b["moe_shared_experts"] == 92 * 132_120_576
    assert b["moe_latent_proj_norm"] == 92 * 51_383_808
    assert b["layer_norms_attn_res"] + b["final_norm_attn_res"] == 4_021_248
    parts = [
        v
        for k, v in b.items()
        if k
        in (
            "embedding",
            "lm_head",
            "kda",
            "mla",
            "dense_ffn",
            "moe_router",
            "moe_routed_experts",
            "moe_shared_experts",
            "moe_latent_proj_norm",
            "layer_norms_attn_res",
            "final_norm_attn_res",
        )
    ]
    assert sum(parts) == b["total"]
    assert b["active_incl_embedding"] == 105_364_017_760


def test_counting_allocates_nothing(k3_meta):
    assert all(t.is_meta for t in k3_meta.state_dict().values())


def test_tiny_preset_counts_agree_with_a_real_build():
    """The meta build counts what a materialised model holds (A_log unpadded, router bias included)."""
    cfg = K3Config.preset("tiny")
    real = sum(t.numel() for t in K3ForCausalLM(cfg).state_dict().values())
    assert real == count_params(cfg)[0]

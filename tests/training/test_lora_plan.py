"""LoRA in the planner (training/tools/lora_memory.py): frozen-base bytes per format, adapter state, and the
per-rank peak against bench/lora.py's CPU measurement of the same job."""

from __future__ import annotations

import pytest

from model import K3Config
from model.lora import LoRASpec
from model.params import param_breakdown
from training.metrics.heap import heap_supported
from training.tools.lora_memory import adapter_counts, frozen_base_bytes
from training.tools.plan import Hardware, Layout, plan


def test_mxfp4_experts_are_4_25_bits_a_weight_the_release_size():
    """K3's routed experts at 4.25 bits are the release's 1.45 TB of MXFP4; bf16 is 2 B a weight."""
    cfg = K3Config.preset("k3")
    bd = param_breakdown(cfg)
    mx, bf = frozen_base_bytes(cfg, bd, "mxfp4", 2), frozen_base_bytes(cfg, bd, "bf16", 2)
    assert mx["expert"] == bd["moe_routed_experts"] * 4.25 / 8 and bf["expert"] == 2 * bd["moe_routed_experts"]
    assert 1.40e12 < mx["expert"] < 1.50e12 and mx["dense"] == bf["dense"]


def test_only_adapters_have_gradients_and_optimizer_state():
    cfg = K3Config.preset("tiny")
    spec = LoRASpec(base_experts="mxfp4")
    hw = Hardware(nodes=1, gpus_per_node=2, reserve_gb=0.0)
    full = plan(cfg, Layout(zero_stage=3, ep_size=2), hw)["gpu_memory_gb"]
    lora = plan(cfg, Layout(zero_stage=3, ep_size=2, lora=spec), hw)["gpu_memory_gb"]
    ad = adapter_counts(cfg, spec)
    local = ad["dense"] / 2 + ad["expert"] / 2  # ZeRO-3 over 2 ranks; experts over EP=2 (their DP group is 1)
    assert lora["optimizer"] * 1e9 == pytest.approx(12 * local) and lora["grads"] * 1e9 == pytest.approx(4 * local)
    assert lora["weights"] < full["weights"] and lora["total"] < full["total"]


@pytest.mark.skipif(not heap_supported(), reason="needs glibc >= 2.33 (mallinfo2)")
def test_planned_lora_peak_within_10pct_of_the_bench_measurement(tmp_path):
    """bench/lora.py's job (2 ranks ZeRO-3 + EP=2, MXFP4 base) on tiny: the train step's measured tensors against
    training.plan with finetune=lora for the same overrides (both computed here)."""
    from bench.lora import measure

    rows = measure("tiny", 64, ["lora_mxfp4"], 2, tmp_path)
    assert len(rows) == 2
    for r in rows:
        assert 0.9 <= r["est_ratio"] <= 1.1, r

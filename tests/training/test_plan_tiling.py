"""The planner models the long-sequence switches (issue 24): tiled loss, tiled FFN, host-offloaded checkpoints."""

from __future__ import annotations

import pytest
import torch

from model.config import K3Config
from model.loss import TiledLinearCrossEntropy
from training.metrics.heap import HeapPeak, heap_supported
from training.tools.activation_memory import activation_bytes, loss_backward_bytes
from training.tools.plan import from_overrides, plan

K3_2_20 = [
    "model=k3",
    "model.vision_config=false",  # the text model (its tower: tests/training/test_plan_vision.py)
    "deepspeed=zero3",
    "deepspeed.offload_optimizer=true",
    "parallel.ep_size=128",
    "parallel.sp_size=32",
    "train.seq_len=1048576",
    "train.micro_batch_size=1",
    "train.activation_checkpointing=true",
    "plan.nodes=32",
    "plan.gpus_per_node=8",
]
TILED = ["train.loss_tile_tokens=2048", "train.ffn_tile_tokens=4096"]


def test_a_tiled_loss_keeps_no_logits_for_backward():
    c = K3Config.preset("k3")
    full = activation_bytes(c, 1, 32768, 2, True)["head_loss"]
    tiled = activation_bytes(c, 1, 32768, 2, True, loss_tile=2048)["head_loss"]
    assert full - tiled == pytest.approx(32768 * c.vocab_size * 2)


def test_k3_loss_memory_at_32k_tokens_falls_under_a_third_with_1024_token_tiles():
    """Logits kept by the forward + the loss backward's transient, bf16. At K3's vocab the lm_head weight gradient
    ([V, d], 2.3 GB, which the untiled path makes too) and the final hidden states bound the ratio (0.27); `tiny`
    reaches 0.05 (bench/long_context)."""
    c, T = K3Config.preset("k3"), 32768

    def loss_memory(tile: int) -> float:
        kept = activation_bytes(c, 1, T, 2, True, loss_tile=tile)["head_loss"]
        return kept + loss_backward_bytes(c, 1, T, 2, loss_tile=tile)

    assert loss_memory(1024) < loss_memory(0) / 3


@pytest.mark.skipif(not heap_supported(), reason="needs glibc mallinfo2 to measure heap bytes")
def test_tiled_loss_backward_transient_matches_measured_heap_peak():
    c, T, tile = K3Config.preset("tiny"), 2048, 256
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(T, c.hidden_size, generator=gen, requires_grad=True)
    w = torch.randn(c.vocab_size, c.hidden_size, generator=gen, requires_grad=True)
    t = torch.randint(0, c.vocab_size, (T,), generator=gen)
    loss = TiledLinearCrossEntropy.apply(h, w, t, tile)
    with HeapPeak() as heap:
        loss.backward()
    assert heap.peak == pytest.approx(loss_backward_bytes(c, 1, T, act_bytes=4, loss_tile=tile), rel=0.10)


def test_ffn_tiling_lowers_the_one_layer_recompute_and_is_a_no_op_past_the_sequence():
    c = K3Config.preset("k3")
    base = activation_bytes(c, 1, 32768, 2, True)["recompute_peak"]
    assert activation_bytes(c, 1, 32768, 2, True, ffn_tile=4096)["recompute_peak"] < base
    assert activation_bytes(c, 1, 32768, 2, True, ffn_tile=32768)["recompute_peak"] == pytest.approx(base)


def test_offloaded_checkpoints_move_the_layer_inputs_to_host_memory():
    c = K3Config.preset("k3")
    dev = activation_bytes(c, 1, 32768, 2, True)
    off = activation_bytes(c, 1, 32768, 2, True, offload=True)
    assert off["host_layer_inputs"] == dev["layer_inputs"]
    assert off["total"] == pytest.approx(dev["total"] - dev["layer_inputs"])
    p_dev, p_off = (plan(*from_overrides(K3_2_20 + TILED + x)[:3]) for x in ([], ["train.activation_offload=true"]))
    moved = dev["layer_inputs"] * 8 / 1e9  # 8 GPUs per node
    assert p_off["cpu_memory_gb_per_node"] - p_dev["cpu_memory_gb_per_node"] == pytest.approx(moved, rel=1e-6)


def test_k3_at_2_20_tokens_on_256_h200_fits_only_with_tiling_and_the_trainer_accepts_it():
    untiled, tiled = (from_overrides(K3_2_20 + x) for x in ([], TILED))
    assert not plan(*untiled[:3])["fits"]["gpu"]
    config, layout, hw, _, warnings = tiled
    assert plan(config, layout, hw)["fits"]["gpu"] and warnings == []


def test_k3_256k_fine_tuning_on_256_h200_fits_with_tiling_and_the_trainer_accepts_it():
    """docs/planning.md's 256k worked example: SP 8 on 32 nodes, 32,768 tokens per GPU."""
    over = [a for a in K3_2_20 if not a.startswith(("parallel.sp_size", "train.seq_len"))]
    config, layout, hw, _, warnings = from_overrides([*over, "parallel.sp_size=8", "train.seq_len=262144", *TILED])
    assert plan(config, layout, hw)["fits"]["gpu"] and warnings == []


def test_mixer_tiling_lowers_the_one_layer_recompute_and_is_a_no_op_past_the_sequence():
    """K3 at 32k tokens per GPU, FFN tiled: the KDA layer's chunk tensors for one 1024-token tile instead of 32k."""
    c = K3Config.preset("k3")
    peak = lambda tile: activation_bytes(c, 1, 32768, 2, True, ffn_tile=1024, mixer_tile=tile)["recompute_peak"]  # noqa: E731
    assert peak(1024) < 0.7 * peak(0)
    assert peak(32768) == pytest.approx(peak(0))

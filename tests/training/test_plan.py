"""Planner: published K3 sizes, memory predictions vs tensors measured on real tiny models, ZeRO/EP arithmetic."""

from __future__ import annotations

import json

import pytest
import torch

from model.config import K3Config
from model.k3 import causal_lm_loss
from training.metrics.heap import HeapPeak, heap_supported
from training.tools.activation_memory import activation_bytes, loss_backward_bytes
from training.tools.plan import Hardware, Layout, from_overrides, main, plan

K3 = [
    "model=k3",
    "model.vision_config=false",  # the text model (its tower: tests/training/test_plan_vision.py)
    "deepspeed=zero3",
    "deepspeed.offload_optimizer=true",
    "parallel.ep_size=128",
    "train.seq_len=4096",
    "train.micro_batch_size=1",
    "train.activation_checkpointing=true",
    "plan.nodes=32",
    "plan.gpus_per_node=8",
]


def _tiny(**kw) -> K3Config:
    return K3Config.preset("tiny", **kw)


def _one_cpu_rank() -> Hardware:
    return Hardware(nodes=1, gpus_per_node=1, attention="math", reserve_gb=0.0)


@pytest.fixture(scope="module")
def k3_plan():
    config, layout, hw, _, warnings = from_overrides(K3)
    return plan(config, layout, hw, warnings=warnings)


def test_k3_reproduces_published_sizes(k3_plan):
    assert k3_plan["model"]["total_params"] == 2_779_484_476_000  # 2.78T
    assert k3_plan["model"]["active_params"] == 104_189_612_640  # 104.2B


def test_k3_worked_example_fits_an_h200_and_is_a_layout_the_trainer_accepts(k3_plan):
    # docs/planning.md: 256 H200, ZeRO-3 + EP 128 + optimizer offload; validation for world 256 passes
    assert k3_plan["fits"]["gpu"] and k3_plan["gpu_memory_gb"]["optimizer"] == 0.0
    assert k3_plan["warnings"] == []


def test_k3_on_512_h200_fits_without_offload():
    config, layout, hw, _, warnings = from_overrides(
        [a for a in K3 if "offload" not in a and "nodes" not in a] + ["plan.nodes=64"]
    )
    p = plan(config, layout, hw, warnings=warnings)
    assert warnings == [] and p["fits"]["gpu"] and p["gpu_memory_gb"]["optimizer"] > 0
    assert p["params_per_gpu"]["expert"] == pytest.approx(p["model"]["expert_params"] / 512)


def _measured_states(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of real parameters, gradients and torch AdamW state after one step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    model(ids, labels=ids).loss.backward()
    opt.step()
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    grads = (p.grad for p in model.parameters() if p.grad is not None)  # layer 0's AttnRes query is unused
    return {
        "weights": nbytes(model.parameters()),
        "grads": nbytes(grads),
        "optimizer": nbytes(v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)),
    }


@pytest.mark.parametrize("overrides", [{}, dict(num_experts=16, num_experts_per_token=4, num_hidden_layers=5)])
def test_param_grad_optimizer_memory_within_10pct_of_measured(overrides):
    from model.k3 import K3ForCausalLM

    cfg = _tiny(**overrides)
    model = K3ForCausalLM(cfg)
    measured = _measured_states(model)
    p = plan(cfg, Layout(zero_stage=0, precision="fp32", micro_batch_size=1, seq_len=16), _one_cpu_rank())
    for kind, real in measured.items():
        assert p["gpu_memory_gb"][kind] * 1e9 == pytest.approx(real, rel=0.10), kind


def _measured_activation_bytes(model: torch.nn.Module, B: int, T: int) -> int:
    """Bytes autograd saves for backward in one forward + loss, each storage once, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    ids = torch.randint(0, model.config.vocab_size, (B, T))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _ = model(ids, labels=ids).loss
    return sum(seen.values())


@pytest.mark.parametrize(
    "preset,overrides,B,T",
    [
        ("tiny", {}, 2, 64),
        ("tiny", dict(attn_res_block_size=0, kda_chunk_size=16), 1, 97),
        ("small", dict(num_hidden_layers=4, vocab_size=2048, hidden_size=256, intermediate_size=512), 1, 128),
    ],
)
def test_activation_memory_within_10pct_of_saved_tensors(preset, overrides, B, T):
    from model.k3 import K3ForCausalLM

    cfg = K3Config.preset(preset, **overrides)
    model = K3ForCausalLM(cfg).train()
    for layer in model.model.layers:  # decays at the gate bound (as trained models reach): the planned worst case
        if layer.layer_type == "kda":
            layer.self_attn.dt_bias.data.fill_(3.0)
    measured = _measured_activation_bytes(model, B, T)
    predicted = activation_bytes(cfg, B, T, act_bytes=4, checkpointing=False, attention="math")["total"]
    assert predicted == pytest.approx(measured, rel=0.10)


def test_zero_stages_partition_optimizer_then_grads_then_weights():
    cfg, hw = _tiny(), Hardware(nodes=1, gpus_per_node=8)
    g = {z: plan(cfg, Layout(zero_stage=z), hw)["gpu_memory_gb"] for z in (0, 1, 2, 3)}
    assert g[1]["optimizer"] == pytest.approx(g[0]["optimizer"] / 8)
    assert g[1]["grads"] == g[0]["grads"] and g[2]["grads"] == pytest.approx(g[0]["grads"] / 8)
    assert g[2]["weights"] == g[0]["weights"] and g[3]["weights"] == pytest.approx(g[0]["weights"] / 8)


@pytest.mark.skipif(not heap_supported(), reason="needs glibc mallinfo2 to measure heap bytes")
def test_loss_backward_transient_matches_measured_heap_peak():
    cfg, T = _tiny(), 2048  # fp32 logits [2048, 4096]: 34 MB, one CE chunk
    gen = torch.Generator().manual_seed(0)
    logits_BTV = torch.randn(1, T, cfg.vocab_size, generator=gen, requires_grad=True)
    labels_BT = torch.randint(0, cfg.vocab_size, (1, T), generator=gen)
    loss, _ = causal_lm_loss(logits_BTV, labels_BT)
    with HeapPeak() as heap:
        loss.backward()
    assert heap.peak == pytest.approx(loss_backward_bytes(cfg, 1, T, act_bytes=4), rel=0.10)


def test_fp32_zero0_peak_holds_activations_or_grads_not_both():
    cfg, hw = K3Config.preset("small"), _one_cpu_rank()
    g0 = plan(cfg, Layout(zero_stage=0, precision="fp32", seq_len=1024, reduce_bucket_size=0), hw)["gpu_memory_gb"]
    rest = g0["weights"] + g0["optimizer"]
    assert g0["total"] == pytest.approx(rest + max(g0["activations"] + g0["loss_backward"], g0["grads"]))
    g1 = plan(cfg, Layout(zero_stage=1, precision="fp32", seq_len=1024, reduce_bucket_size=0), hw)["gpu_memory_gb"]
    assert g1["optimizer"] == pytest.approx(g0["optimizer"] * 1.5)  # + DeepSpeed's fp32 master partition
    assert g1["total"] == pytest.approx(
        g1["weights"] + g1["optimizer"] + g1["grads"] + g1["activations"] + g1["loss_backward"]
    )


def test_expert_parallelism_shards_only_expert_params():
    cfg, hw = _tiny(), Hardware(nodes=1, gpus_per_node=8)
    p1, p4 = (plan(cfg, Layout(zero_stage=0, ep_size=e), hw)["params_per_gpu"] for e in (1, 4))
    assert p4["dense"] == p1["dense"] and p4["expert"] == pytest.approx(p1["expert"] / 4)


def test_offload_moves_optimizer_state_to_cpu():
    cfg, hw = _tiny(), Hardware(nodes=2, gpus_per_node=4)
    on = plan(cfg, Layout(zero_stage=2), hw)
    off = plan(cfg, Layout(zero_stage=2, offload_optimizer=True), hw)
    assert off["gpu_memory_gb"]["optimizer"] == 0.0
    # 4 GPUs per node; the CPU side holds master + m + v (12 B, bf16) and an fp32 gradient partition (4 B)
    assert off["cpu_memory_gb_per_node"] == pytest.approx(on["gpu_memory_gb"]["optimizer"] * 4 * 16 / 12)


def test_all_to_all_bytes_scale_with_latent_width_and_vanish_without_ep():
    hw = Hardware(nodes=1, gpus_per_node=8)
    a = plan(_tiny(routed_expert_hidden_size=128), Layout(ep_size=8), hw)["comm_per_step_per_gpu_gb"]
    b = plan(_tiny(routed_expert_hidden_size=64), Layout(ep_size=8), hw)["comm_per_step_per_gpu_gb"]
    assert a["moe_all_to_all"] == pytest.approx(2 * b["moe_all_to_all"])
    assert plan(_tiny(), Layout(ep_size=1), hw)["comm_per_step_per_gpu_gb"]["moe_all_to_all"] == 0.0


def test_activation_checkpointing_keeps_less():
    cfg = K3Config.preset("small")
    full = activation_bytes(cfg, 1, 2048, 2, checkpointing=False)["total"]
    ckpt = activation_bytes(cfg, 1, 2048, 2, checkpointing=True)["total"]
    assert ckpt < full / 3


def test_cli_prints_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["model=tiny", "deepspeed=zero2", "plan.gpus_per_node=2", f"plan.out={out}"]) == 0
    table = capsys.readouterr().out
    assert "GPU total" in table and "tokens/s" in table
    assert json.loads(out.read_text())["hardware"]["world"] == 2


def test_bad_override_is_a_one_line_error(capsys):
    assert main(["model=tiny", "plan.gpu_memmory_gb=80"]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown planner key plan.gpu_memmory_gb" in err and len(err.splitlines()) == 1


def test_sequence_parallelism_divides_token_activations_and_adds_only_the_gathered_mla_latents():
    cfg, hw = _tiny(), Hardware(nodes=1, gpus_per_node=4)
    a1, a4 = (
        plan(cfg, Layout(zero_stage=0, sp_size=s, seq_len=4096, precision="fp32"), hw)["activations_gb"] for s in (1, 4)
    )
    n_mla = sum(t != "kda" for t in cfg.layer_types)
    gathered = 4096 / 4 * n_mla * 3 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4 / 1e9
    assert a4["sequence_parallel"] == pytest.approx(gathered)
    assert a4["total"] - a4["sequence_parallel"] == pytest.approx(a1["total"] / 4)


def test_sequence_parallel_all_to_all_bytes_per_layer_are_reported_and_vanish_at_sp1():
    cfg, hw = _tiny(), Hardware(nodes=1, gpus_per_node=2)
    c1, c2 = (plan(cfg, Layout(sp_size=s, seq_len=2048), hw)["comm_per_step_per_gpu_gb"] for s in (1, 2))
    assert c1["sp_all_to_all"] == 0.0 and c2["sp_all_to_all"] > 0.0
    assert c2["sp_all_to_all_per_layer"] == pytest.approx(c2["sp_all_to_all"] / cfg.num_hidden_layers)


def test_sequence_parallel_ranks_share_a_sequence_so_tokens_per_step_count_data_parallel_ranks():
    cfg, hw = _tiny(), Hardware(nodes=1, gpus_per_node=4)
    t1, t2 = (plan(cfg, Layout(sp_size=s, seq_len=1024), hw)["time"]["tokens_per_step"] for s in (1, 2))
    assert t2 == t1 / 2


def test_planner_refuses_an_sp_size_that_does_not_divide_the_sequence():
    with pytest.raises(ValueError, match="parallel.sp_size=3"):
        plan(_tiny(), Layout(sp_size=3, seq_len=1024), Hardware(nodes=1, gpus_per_node=3))


def _zero3(cfg: K3Config, **layout) -> dict:
    kw = dict(zero_stage=3, ep_size=2, precision="fp32", micro_batch_size=1, seq_len=256)
    return plan(cfg, Layout(**{**kw, **layout}), Hardware(nodes=1, gpus_per_node=2, reserve_gb=0.0))


def test_fp32_zero3_keeps_one_fp32_copy_of_each_weight_unless_the_optimizer_is_offloaded():
    cfg = _tiny()
    local = _zero3(cfg)["params_per_gpu"]
    params = local["dense"] + local["expert"]
    assert _zero3(cfg)["gpu_memory_gb"]["optimizer"] * 1e9 == pytest.approx(params * 8)  # m, v; master = weights
    off = _zero3(cfg, offload_optimizer=True)
    # the CPU side: master, m, v (12 B), the optimizer's fp32 gradient and ZeRO-3's gradient partition (4 + 4)
    assert off["cpu_memory_gb_per_node"] * 1e9 == pytest.approx(2 * params * 20)
    assert off["gpu_memory_gb"]["grads"] == 0.0


def test_bf16_zero3_accumulates_gradients_in_an_fp32_partition():
    g = _zero3(_tiny(), precision="bf16")["gpu_memory_gb"]
    assert g["grads"] == pytest.approx(2 * g["weights"])  # grad_accum_dtype fp32 vs bf16 weights


def test_zero3_holds_the_whole_local_model_gathered_within_deepspeeds_reuse_distance():
    # DeepSpeed's defaults (max_live_parameters = max_reuse_distance = 1e9) exceed `small`'s 0.2B local elements:
    # measured on 2 ranks (bench/memory_dist.py), every parameter stays gathered from forward to backward
    p = _zero3(K3Config.preset("small"))
    local_full = p["params_per_gpu"]["dense_full"] + p["params_per_gpu"]["expert_full"]
    assert p["gpu_memory_gb"]["zero3_gathered"] * 1e9 == pytest.approx(local_full * 4)


def test_zero3_gathered_weights_are_bounded_by_max_live_parameters_and_reuse_distance():
    from model.params import param_breakdown
    from training.tools.plan import _largest_unit

    cfg = K3Config.preset("small")
    p = _zero3(cfg, max_live_parameters=1_000_000, max_reuse_distance=3_000_000)
    unit = _largest_unit(cfg, param_breakdown(cfg), 2)
    assert p["gpu_memory_gb"]["zero3_gathered"] * 1e9 == pytest.approx((3_000_000 + unit) * 4)
    # without prefetching nothing walks past gathered parameters: the live limit keeps none of them
    p = _zero3(cfg, max_live_parameters=10**9, max_reuse_distance=0, prefetch_bucket_size=0)
    assert p["gpu_memory_gb"]["zero3_gathered"] * 1e9 == pytest.approx(unit * 4)


def test_zero3_step_transient_is_one_sub_group_and_comes_after_the_backward():
    g = _zero3(K3Config.preset("small"), sub_group_size=1_000_000)["gpu_memory_gb"]
    assert g["optimizer_step"] * 1e9 == pytest.approx(1_000_000 * 4)  # one sub-group's gradients flattened, fp32
    backward = g["activations"] + g["loss_backward"] + g["zero3_gathered"]
    static = g["weights"] + g["grads"] + g["optimizer"] + g["comm_buckets"] + g["reserve"]
    assert g["total"] == pytest.approx(static + max(backward, g["optimizer_step"]))
    big = _zero3(K3Config.preset("small"), sub_group_size=10**12)["gpu_memory_gb"]
    assert big["optimizer_step"] == pytest.approx(g["optimizer"] / 2)  # capped at the local partition: m's size


def test_planner_reads_the_zero3_knobs_the_trainer_writes_into_the_deepspeed_json():
    _, layout, *_ = from_overrides(
        [
            "model=tiny",
            "deepspeed=zero3",
            "deepspeed.sub_group_size=1234",
            "+deepspeed.extra.zero_optimization.stage3_max_live_parameters=5678",
            "+deepspeed.extra.zero_optimization.stage3_max_reuse_distance=9",
        ]
    )
    assert (layout.sub_group_size, layout.max_live_parameters, layout.max_reuse_distance) == (1234, 5678, 9)
    assert layout.prefetch_bucket_size is None  # DeepSpeed's own default (training.tools.plan.zero3_gather_knobs)

"""QK-Clip (training/optim/qk_clip.py) and the MLA max-logit seam (model/mla.py): maths against float64 references,
the clip's effect on the same batch, and its metrics."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model.config import K3Config
from model.mla import GatedMLA, attention_mask, mla_max_logits
from training.config import TrainConfigError, compose, validate
from training.optim.qk_clip import QKClip, clip_factors

DN, DR, DV, R = 5, 3, 4, 6


def max_logits_reference(q, c_kv, k_r, w_kvb, mask_TS, scale):
    """Loop over batch, head, query and key in float64."""
    B, T, H, _ = q.shape
    S = c_kv.shape[1]
    kv = (c_kv.double() @ w_kvb.double().T).view(B, S, H, DN + DV)
    out = torch.full((H,), float("-inf"), dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                for s in range(S):
                    if mask_TS is not None and not mask_TS[t, s]:
                        continue
                    k = torch.cat([kv[b, s, h, :DN], k_r[b, s].double()])
                    out[h] = max(out[h], float(q[b, t, h].double() @ k) * scale)
    return out


@pytest.mark.parametrize("packed", [False, True])
def test_max_logits_match_float64_loop_with_odd_lengths_and_chunks(packed):
    torch.manual_seed(0)
    B, T, H = (1, 7, 3) if packed else (2, 7, 3)
    q, c_kv, k_r = torch.randn(B, T, H, DN + DR), torch.randn(B, T, R), torch.randn(B, T, DR)
    w = torch.randn(H * (DN + DV), R)
    cu = torch.tensor([0, 3, 7]) if packed else None
    mask_TS, causal = attention_mask(T, T, cu, q.device)
    got = mla_max_logits(q, c_kv, k_r, w, DN, 0.3, cu, None if cu is None else cu.tolist(), chunk=3)
    ref_mask = mask_TS if mask_TS is not None else torch.ones(T, T, dtype=torch.bool).tril()
    torch.testing.assert_close(got.double(), max_logits_reference(q, c_kv, k_r, w, ref_mask, 0.3), rtol=1e-6, atol=0)


def mla_layer(q_lora_rank):
    cfg = K3Config.preset(
        "tiny",
        hidden_size=16,
        num_attention_heads=3,
        num_key_value_heads=3,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=R,
        qk_nope_head_dim=DN,
        qk_rope_head_dim=DR,
        v_head_dim=DV,
    )
    torch.manual_seed(1)
    m = GatedMLA(cfg, layer_idx=1).double()
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(8.0)  # large logits
    return m


def step_max(m, x):
    clip = QKClip(m, None)
    clip.begin_step(track=True)
    m(x)
    return clip.global_max_logits()[0].double()


@pytest.mark.parametrize("q_lora_rank", [None, 8])
def test_clipped_head_reaches_tau_and_unclipped_heads_are_untouched(q_lora_rank):
    m = mla_layer(q_lora_rank)
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    s_H = step_max(m, x)
    order = s_H.argsort()
    tau = float(s_H[order[0]] + s_H[order[1]]) / 2  # above the smallest head, below the other two
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    clip = QKClip(m, tau)
    clip.begin_step(track=False)
    m(x)
    metrics = clip.after_step(applied=True)
    assert metrics["optim/qk_clip_heads"] == 2 and metrics["attn/max_logit"] == pytest.approx(float(s_H.max()))
    assert metrics["attn/layer1/max_logit"] == metrics["attn/max_logit"]
    after = step_max(m, x)
    for h in range(3):
        if s_H[h] > tau:
            assert float(after[h]) == pytest.approx(tau, rel=1e-6)
        else:
            assert after[h] == s_H[h]
    q_name = "q_proj.weight" if q_lora_rank is None else "q_b_proj.weight"
    p = dict(m.named_parameters())
    small = int(order[0])
    q_rows, kv_rows = (
        slice(small * (DN + DR), (small + 1) * (DN + DR)),
        slice(small * (DN + DV), (small + 1) * (DN + DV)),
    )
    assert torch.equal(p[q_name][q_rows], before[q_name][q_rows])
    assert torch.equal(p["kv_b_proj.weight"][kv_rows], before["kv_b_proj.weight"][kv_rows])
    v_rows = torch.cat([torch.arange(h * (DN + DV) + DN, (h + 1) * (DN + DV)) for h in range(3)])
    assert torch.equal(p["kv_b_proj.weight"][v_rows], before["kv_b_proj.weight"][v_rows])  # values never scaled
    for name in before:
        if name not in (q_name, "kv_b_proj.weight"):
            assert torch.equal(p[name], before[name]), name  # kv_a_proj_with_mqa (shared k_r) included


def test_clip_scales_q_nope_and_k_nope_by_root_gamma_and_q_pe_by_gamma():
    m = mla_layer(8)
    w_q, w_kv = m.q_b_proj.weight.detach().clone(), m.kv_b_proj.weight.detach().clone()
    gamma_H = torch.tensor([1.0, 0.25, 0.5])
    from training.optim.qk_clip import clip_layer

    clip_layer(m, gamma_H)
    for h, g in enumerate(gamma_H.tolist()):
        q0, k0 = h * (DN + DR), h * (DN + DV)
        torch.testing.assert_close(m.q_b_proj.weight[q0 : q0 + DN], w_q[q0 : q0 + DN] * g**0.5, rtol=1e-15, atol=0)
        torch.testing.assert_close(m.q_b_proj.weight[q0 + DN : q0 + DN + DR], w_q[q0 + DN : q0 + DN + DR] * g)
        torch.testing.assert_close(m.kv_b_proj.weight[k0 : k0 + DN], w_kv[k0 : k0 + DN] * g**0.5, rtol=1e-15, atol=0)


def test_clip_factors_are_min_one_tau_over_s():
    s = torch.tensor([[50.0, 100.0, 400.0, float("-inf")], [0.0, -3.0, 1e9, 101.0]])
    g = clip_factors(s, 100.0)
    expected = torch.tensor([[1.0, 1.0, 0.25, 1.0], [1.0, 1.0, 1e-7, 100 / 101]])
    torch.testing.assert_close(g, expected, rtol=1e-6, atol=0)


def test_a_skipped_step_is_not_clipped():
    m = mla_layer(8)
    x = torch.randn(1, 5, 16, dtype=torch.float64)
    before = [p.detach().clone() for p in m.parameters()]
    clip = QKClip(m, 1e-3)
    clip.begin_step(track=False)
    m(x)
    assert clip.after_step(applied=False)["optim/qk_clip_heads"] == 0
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))


def test_without_tau_logits_are_tracked_only_on_logged_steps():
    m = mla_layer(8)
    clip = QKClip(m, None)
    clip.begin_step(track=False)
    m(torch.randn(1, 4, 16, dtype=torch.float64))
    assert clip.after_step(applied=True) == {} and m.max_logit_H is None
    clip.begin_step(track=True)
    m(torch.randn(1, 4, 16, dtype=torch.float64))
    assert set(clip.after_step(applied=True)) == {"attn/max_logit", "attn/layer1/max_logit"}


@pytest.mark.parametrize("tau", ["0", "-1"])
def test_non_positive_tau_is_refused_in_one_line(tau):
    with pytest.raises(TrainConfigError, match="optim.qk_clip_tau"):
        validate(compose([f"optim.qk_clip_tau={tau}"]), 1)


def test_after_step_reads_every_layers_maxima_in_one_host_read():
    """Two MLA layers, tau set, clipping applied: one `tolist` in training/optim and no scalar read (`item`,
    `_local_scalar_dense`) anywhere: the step's scalars come to the host batched, not one `float()` per layer."""
    from tests.model.test_mla_packed import HostReads

    a, b = mla_layer(8), mla_layer(None)
    b.layer_idx = 5
    model = torch.nn.ModuleList([a, b])
    x = torch.randn(1, 6, 16, dtype=torch.float64)
    clip = QKClip(model, 1.0)
    clip.begin_step(track=True)
    a(x), b(x)
    optim_dir = str(Path(__file__).resolve().parents[2] / "training" / "optim")
    with HostReads(dispatch=True, where=optim_dir) as reads:
        metrics = clip.after_step(applied=True)
    assert metrics["optim/qk_clip_heads"] == 6 and set(metrics) >= {"attn/layer1/max_logit", "attn/layer5/max_logit"}
    assert reads.count == 1

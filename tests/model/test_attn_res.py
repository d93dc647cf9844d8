"""Block Attention Residuals (docs/model.md §6, §10 item 12)."""

from __future__ import annotations

import pytest
import torch

import model.k3 as k3_module
from model.attn_res import attn_res_mix, attn_res_mixture_sizes
from model.config import K3Config
from model.k3 import K3ForCausalLM
from tests.model.micro import micro_config


def reference_mix(cands: list[torch.Tensor], w: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    """The formula of docs/model.md §6 in float64: keys = RMSNorm(V_n) * g, logits = <w, key>, softmax over n,
    sum of raw V_n."""
    V = torch.stack([c.double() for c in cands])  # [N, ..., D]
    keys = V / torch.sqrt(V.pow(2).mean(-1, keepdim=True) + eps) * g.double()
    logits = (keys * w.double()).sum(-1)  # [N, ...]
    alpha = torch.softmax(logits, dim=0)
    return (alpha.unsqueeze(-1) * V).sum(0)


def test_single_candidate_is_identity():
    v = torch.randn(2, 5, 8)
    out = attn_res_mix([v], torch.randn(8), torch.randn(8), 1e-5)
    assert torch.equal(out, v)


def test_zero_query_gives_uniform_mean():
    cands = [torch.randn(3, 7, 16, dtype=torch.float64) for _ in range(4)]
    out = attn_res_mix(cands, torch.zeros(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64), 1e-5)
    torch.testing.assert_close(out, torch.stack(cands).mean(0), rtol=0, atol=1e-14)


def test_constant_candidates_give_the_constant():
    v = torch.randn(2, 3, 16, dtype=torch.float64)
    out = attn_res_mix(
        [v, v.clone(), v.clone()], torch.randn(16, dtype=torch.float64) * 3, torch.randn(16, dtype=torch.float64), 1e-5
    )
    torch.testing.assert_close(out, v, rtol=0, atol=1e-14)


def test_weights_sum_to_one_and_are_convex():
    """Mixing scalar-multiples of one vector v gives (sum_n a_n c_n) v with a on the simplex: c in [min, max]."""
    v = torch.randn(1, 1, 16, dtype=torch.float64)
    scales = [0.5, 2.0, 3.0, -1.0]
    cands = [c * v for c in scales]
    out = attn_res_mix(cands, torch.randn(16, dtype=torch.float64), torch.rand(16, dtype=torch.float64), 0.0)
    c = (out / v).flatten()
    assert torch.allclose(c, c[0].expand_as(c))
    assert min(scales) <= float(c[0]) <= max(scales)
    ones = attn_res_mix(
        [torch.ones_like(v)] * 4, torch.randn(16, dtype=torch.float64), torch.rand(16, dtype=torch.float64), 1e-5
    )
    torch.testing.assert_close(ones, torch.ones_like(v), rtol=0, atol=1e-15)


@pytest.mark.parametrize("n", [2, 3, 9])
def test_mix_matches_float64_reference_on_random_inputs(n):
    cands = [torch.randn(2, 11, 24, dtype=torch.float64) * (i + 1) for i in range(n)]
    w, g = torch.randn(24, dtype=torch.float64), torch.randn(24, dtype=torch.float64)
    torch.testing.assert_close(attn_res_mix(cands, w, g, 1e-5), reference_mix(cands, w, g, 1e-5), rtol=0, atol=1e-12)
    stacked = torch.stack(cands)
    torch.testing.assert_close(attn_res_mix(stacked, w, g, 1e-5), reference_mix(cands, w, g, 1e-5), rtol=0, atol=1e-12)


def test_bf16_mix_computes_softmax_in_fp32_and_returns_bf16():
    cands = [(torch.randn(4, 9, 32) * 4).bfloat16() for _ in range(5)]
    w, g = torch.randn(32).bfloat16(), torch.randn(32).bfloat16()
    out = attn_res_mix(cands, w, g, 1e-5)
    assert out.dtype == torch.bfloat16
    ref = reference_mix([c.double() for c in cands], w.double(), g.double(), 1e-5)
    assert (out.double() - ref).abs().max() <= 2**-7 * ref.abs().max()


def test_backward_matches_autograd_through_the_float64_reference():
    cands = [(torch.randn(3, 5, 12, dtype=torch.float64) * (n + 1)).requires_grad_() for n in range(4)]
    w = torch.randn(12, dtype=torch.float64, requires_grad=True)
    g = torch.randn(12, dtype=torch.float64, requires_grad=True)
    G = torch.randn(3, 5, 12, dtype=torch.float64)
    ours = torch.autograd.grad((attn_res_mix(cands, w, g, 1e-5) * G).sum(), [w, g, *cands])
    ref = torch.autograd.grad((reference_mix(cands, w, g, 1e-5) * G).sum(), [w, g, *cands])
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    small = [torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    wq = torch.randn(4, dtype=torch.float64, requires_grad=True)
    gn = torch.randn(4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda w_, g_, *c: attn_res_mix(list(c), w_, g_, 1e-5), (wq, gn, *small))


def test_zero_initialised_query_still_receives_gradient():
    cands = [torch.randn(2, 3, 8) for _ in range(3)]
    w = torch.zeros(8, requires_grad=True)
    g = torch.ones(8, requires_grad=True)
    attn_res_mix(cands, w, g, 1e-5).pow(2).sum().backward()
    assert w.grad.abs().sum() > 0


def test_mixture_sizes_follow_the_block_algorithm():
    k3 = K3Config.preset("k3")
    sizes = attn_res_mixture_sizes(k3.num_hidden_layers, k3.attn_res_block_size)
    assert sizes.layers[0] == (0, 2)  # layer 0: the embedding itself (no mixture), then [emb, a_0]
    assert max(max(c) for c in sizes.layers) == 9 and sizes.output == 9  # 7 full blocks + partial + embedding
    tiny = attn_res_mixture_sizes(8, 3)
    assert max(max(c) for c in tiny.layers) == 4 and tiny.output == 4  # tiny: partial last block
    off = attn_res_mixture_sizes(8, 0)
    assert off.layers == [(0, 0)] * 8 and off.output == 0 and attn_res_mixture_sizes(8, None) == off


def test_model_forward_uses_the_spec_candidate_counts(monkeypatch):
    cfg = micro_config(num_hidden_layers=5, attn_res_block_size=2)
    seen = []
    real = k3_module.attn_res_mix

    def spy(cands, *args):
        seen.append(len(cands))
        return real(cands, *args)

    monkeypatch.setattr(k3_module, "attn_res_mix", spy)
    K3ForCausalLM(cfg).eval()(torch.randint(0, cfg.vocab_size, (1, 6)))
    sizes = attn_res_mixture_sizes(5, 2)
    # layer 0's attention input is the embedding itself (no mix); every other sublayer mixes its candidates
    expected = [n for a, m in sizes.layers for n in (a, m) if n]
    assert sizes.output == 3 + 1  # output: blocks closed at layers 0, 2, 4 plus the partial sum
    expected.append(sizes.output)
    assert seen == expected


def test_block_at_least_depth_with_zero_queries_and_eps0_equals_prenorm_stack():
    """RMSNorm is scale-invariant at eps = 0, so mixing [emb, sum of outputs] uniformly (= h/2) feeds every
    sublayer and the final norm exactly what the PreNorm stack h = emb + sum of outputs would."""
    cfg = micro_config(attn_res_block_size=8, rms_norm_eps=0.0)
    torch.manual_seed(1)
    attn = K3ForCausalLM(cfg).double().eval()
    plain = K3ForCausalLM(cfg.replace(attn_res_block_size=0)).double().eval()
    missing, unexpected = plain.load_state_dict(attn.state_dict(), strict=False)
    assert not missing and all("_res_" in k for k in unexpected)
    ids = torch.randint(0, cfg.vocab_size, (2, 13))
    torch.testing.assert_close(attn(ids).logits, plain(ids).logits, rtol=0, atol=1e-10)

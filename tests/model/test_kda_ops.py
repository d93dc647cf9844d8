"""chunk_kda / recurrent_kda against the float64 per-token reference of model/kda/naive.py (docs/model.md §3,
§10 items 1-4 and 16); the reference itself against the product form of the recurrence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model.kda import chunk_kda, naive_recurrent_kda, recurrent_kda


# --------------------------------------------------------------------------------------------------------------
# the reference (model/kda/naive.py), always in float64, and the product form it must equal
# --------------------------------------------------------------------------------------------------------------
def oracle_kda(q, k, v, g, beta, initial_state=None):
    """The reference run in float64 whatever the inputs' dtype: (o, final state)."""
    xs = [x.double() for x in (q, k, v, g, beta)]
    S0 = None if initial_state is None else initial_state.double()
    return naive_recurrent_kda(*xs, initial_state=S0, output_final_state=True)


def product_form_kda(q, k, v, g, beta, initial_state):
    """S_t = (I - b_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + b_t k_t v_t^T;  o_t = S_t^T (q_t / sqrt(K)), literally
    (fp64)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    S = initial_state.clone()
    eye = torch.eye(K, dtype=torch.float64)
    out = torch.zeros(B, T, H, V, dtype=torch.float64)
    for t in range(T):
        k_t, b_t = k[:, t], beta[:, t, :, None, None]
        transition = eye - b_t * k_t[..., :, None] * k_t[..., None, :]  # [B, H, K, K]
        S = transition @ (torch.diag_embed(g[:, t].exp()) @ S) + b_t * k_t[..., :, None] * v[:, t, :, None, :]
        out[:, t] = (S.transpose(-1, -2) @ (q[:, t] * K**-0.5)[..., None])[..., 0]
    return out, S


def gated_deltanet_reference(q, k, v, alpha_BTH, beta):
    """Gated DeltaNet (scalar decay per head): S_t = alpha_t (S_{t-1} - b k k^T S_{t-1}) + b k v^T (fp64)."""
    B, T, H, K = q.shape
    S = torch.zeros(B, H, K, v.shape[-1], dtype=torch.float64)
    out = []
    for t in range(T):
        k_t = k[:, t, :, :, None]  # [B, H, K, 1]
        S = alpha_BTH[:, t, :, None, None] * (S - beta[:, t, :, None, None] * k_t @ (k_t.transpose(-1, -2) @ S))
        S = S + beta[:, t, :, None, None] * k_t @ v[:, t, :, None, :]
        out.append((S.transpose(-1, -2) @ (q[:, t] * K**-0.5)[..., None])[..., 0])
    return torch.stack(out, 1), S


def make_inputs(B=2, T=37, H=3, K=16, V=12, dtype=torch.float64, g_min=-5.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    g = g_min * torch.rand(B, T, H, K, generator=gen, dtype=torch.float64)
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    S0 = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)
    return [x.to(dtype) for x in (q, k, v, g, beta)], S0.to(dtype)


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


# --------------------------------------------------------------------------------------------------------------
# chunk == recurrent == oracle
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk_size,T", [(16, 37), (16, 5), (64, 100), (64, 64)])
def test_chunk_equals_oracle_fp64(chunk_size, T):
    (q, k, v, g, beta), S0 = make_inputs(T=T)
    o, S = chunk_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True, chunk_size=chunk_size)
    o_ref, S_ref = oracle_kda(q, k, v, g, beta, S0)
    assert max_err(o, o_ref) <= 1e-10
    assert max_err(S, S_ref) <= 1e-10


def test_reference_equals_the_product_form_fp64():
    (q, k, v, g, beta), S0 = make_inputs(T=23)
    o, S = naive_recurrent_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    o_ref, S_ref = product_form_kda(q, k, v, g, beta, S0)
    assert max_err(o, o_ref) <= 1e-12
    assert max_err(S, S_ref) <= 1e-12


def test_recurrent_equals_oracle_fp64():
    (q, k, v, g, beta), S0 = make_inputs(T=23)
    o, S = recurrent_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    o_ref, S_ref = oracle_kda(q, k, v, g, beta, S0)
    assert max_err(o, o_ref) <= 1e-12
    assert max_err(S, S_ref) <= 1e-12


def test_reference_keeps_low_precision_inputs_in_fp32_and_returns_their_dtype():
    (q, k, v, g, beta), S0 = make_inputs(T=9, dtype=torch.bfloat16)
    o, S = naive_recurrent_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    o_ref, S_ref = oracle_kda(q, k, v, g, beta, S0)
    assert max_err(S, S_ref) <= 1e-5
    o_empty, S_empty = naive_recurrent_kda(
        q[:, :0], k[:, :0], v[:, :0], g[:, :0], beta[:, :0], initial_state=S0, output_final_state=True
    )
    assert o_empty.shape == (2, 0, 3, 12) and torch.equal(S_empty, S0.float())


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunk_equals_oracle_fp32(chunk_size):
    (q, k, v, g, beta), S0 = make_inputs(T=100, K=32, V=32, dtype=torch.float32)
    o, S = chunk_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True, chunk_size=chunk_size)
    o_ref, S_ref = oracle_kda(q, k, v, g, beta, S0)
    assert o.dtype == torch.float32 and S.dtype == torch.float32
    assert max_err(o, o_ref) <= 1e-5
    assert max_err(S, S_ref) <= 1e-5


@pytest.mark.parametrize("g_min", [-40.0, -1000.0])
def test_chunk_is_exact_for_unbounded_decay(g_min):
    """Kimi-Linear's gate is not bounded: in fp64 with C = 64, g down to -40 needs 4 sub-blocks of 16 rows and
    g down to -1000 the exact difference form."""
    (q, k, v, g, beta), S0 = make_inputs(T=70, g_min=g_min)
    g[:, ::7] = 0.0  # some near-identity steps so that long-range terms still matter
    o, S = chunk_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True, chunk_size=64)
    o_ref, S_ref = oracle_kda(q, k, v, g, beta, S0)
    assert max_err(o, o_ref) <= 1e-10
    assert max_err(S, S_ref) <= 1e-10


@pytest.mark.parametrize("chunk_size,T,g_min", [(16, 37, -5.0), (64, 70, -5.0), (64, 70, -40.0), (16, 20, -1000.0)])
def test_chunk_gradients_equal_autograd_through_recurrent(chunk_size, T, g_min):
    (q, k, v, g, beta), S0 = make_inputs(B=1, T=T, H=2, K=8, V=6, g_min=g_min)
    g[:, ::5] = -0.1  # keep some long-range terms alive under strong decay
    gen = torch.Generator().manual_seed(1)
    w_o = torch.randn(1, T, 2, 6, generator=gen, dtype=torch.float64)
    w_S = torch.randn(1, 2, 8, 6, generator=gen, dtype=torch.float64)

    def grads(fn):
        xs = [x.clone().requires_grad_() for x in (q, k, v, g, beta, S0)]
        o, S = fn(*xs[:5], initial_state=xs[5], output_final_state=True, chunk_size=chunk_size)
        ((o * w_o).sum() + (S * w_S).sum()).backward()
        return [x.grad for x in xs]

    for name, a, b in zip(["q", "k", "v", "g", "beta", "initial_state"], grads(chunk_kda), grads(recurrent_kda)):
        assert max_err(a, b) <= 1e-10, name


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
def test_chunk_gradients_fp32_are_finite_and_match_the_oracle(chunk_size):
    """fp32 with K3's gate range (g in (-5, 0)): a single-sub-block chunk once produced NaN gradients for g."""
    (q, k, v, g, beta), S0 = make_inputs(B=1, T=77, H=2, K=16, V=8, dtype=torch.float32, g_min=-5.0)
    gen = torch.Generator().manual_seed(2)
    w_o = torch.randn(1, 77, 2, 8, generator=gen)

    def grads(fn, dtype):
        xs = [x.to(dtype).clone().requires_grad_() for x in (q, k, v, g, beta, S0)]
        o, S = fn(*xs[:5], initial_state=xs[5], output_final_state=True, chunk_size=chunk_size)
        ((o * w_o.to(dtype)).sum() + S.sum()).backward()
        return [x.grad for x in xs]

    for name, a, b in zip(
        ["q", "k", "v", "g", "beta", "initial_state"],
        grads(chunk_kda, torch.float32),
        grads(recurrent_kda, torch.float64),
    ):
        assert torch.isfinite(a).all(), name
        assert max_err(a.double(), b) <= 1e-4 * max(1.0, b.abs().max().item()), name


# --------------------------------------------------------------------------------------------------------------
# properties of the recurrence (docs/model.md §10 items 2-4)
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fn", [chunk_kda, recurrent_kda])
def test_beta_zero_is_pure_decay(fn):
    (q, k, v, g, beta), S0 = make_inputs(T=21)
    beta = torch.zeros_like(beta)
    o, S = fn(q, k, v, g, beta, initial_state=S0, output_final_state=True, chunk_size=16)
    expected = g.sum(1).exp()[..., None] * S0  # S_T = Diag(prod_t alpha_t) S_0
    assert max_err(S, expected) <= 1e-12
    o0, S0_out = fn(q, k, v, g, beta, output_final_state=True, chunk_size=16)
    assert torch.equal(o0, torch.zeros_like(o0)) and torch.equal(S0_out, torch.zeros_like(S0_out))
    _, S_const = fn(q, k, v, torch.zeros_like(g), beta, initial_state=S0, output_final_state=True, chunk_size=16)
    assert max_err(S_const, S0) <= 1e-12


@pytest.mark.parametrize("fn", [chunk_kda, recurrent_kda])
def test_delta_rule_overwrites_the_value_of_a_key(fn):
    K, V = 8, 5
    k_unit = F.normalize(torch.randn(K, dtype=torch.float64), dim=0)
    v1, v2 = torch.randn(V, dtype=torch.float64), torch.randn(V, dtype=torch.float64)
    k = k_unit.expand(1, 2, 1, K).clone()
    v = torch.stack([v1, v2]).view(1, 2, 1, V)
    q = k.clone()
    g = torch.zeros(1, 2, 1, K, dtype=torch.float64)
    beta = torch.ones(1, 2, 1, dtype=torch.float64)
    _, S = fn(q, k, v, g, beta, output_final_state=True, chunk_size=16)
    assert max_err(S[0, 0].T @ k_unit, v2) <= 1e-12


def test_scalar_gate_reduces_to_gated_deltanet():
    (q, k, v, _, beta), _ = make_inputs(T=40)
    log_alpha_BTH = -3.0 * torch.rand(q.shape[:3], dtype=torch.float64)
    g = log_alpha_BTH[..., None].expand_as(q).contiguous()
    o, S = chunk_kda(q, k, v, g, beta, output_final_state=True, chunk_size=16)
    o_ref, S_ref = gated_deltanet_reference(q, k, v, log_alpha_BTH.exp(), beta)
    assert max_err(o, o_ref) <= 1e-10
    assert max_err(S, S_ref) <= 1e-10


# --------------------------------------------------------------------------------------------------------------
# varlen, dtypes, errors
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fn", [chunk_kda, recurrent_kda])
def test_varlen_equals_separate_sequences(fn):
    lengths = [5, 0, 40, 23]
    cu = torch.tensor([0, 5, 5, 45, 68], dtype=torch.int32)
    (q, k, v, g, beta), _ = make_inputs(B=1, T=sum(lengths))
    S0 = torch.randn(len(lengths), 3, 16, 12, dtype=torch.float64)
    o, S = fn(q, k, v, g, beta, initial_state=S0, output_final_state=True, cu_seqlens=cu, chunk_size=16)
    assert S.shape == (4, 3, 16, 12)
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o_ref, S_ref = oracle_kda(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], S0[n : n + 1])
        if b > a:
            assert max_err(o[:, a:b], o_ref) <= 1e-10
        assert max_err(S[n : n + 1], S_ref) <= 1e-10


@pytest.mark.parametrize("fn", [chunk_kda, recurrent_kda])
def test_output_dtype_follows_input_state_stays_fp32(fn):
    (q, k, v, g, beta), _ = make_inputs(T=20, dtype=torch.bfloat16)
    o, S = fn(q, k, v, g, beta, output_final_state=True, chunk_size=16)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    o_none, S_none = fn(q, k, v, g, beta, chunk_size=16)
    assert S_none is None and o_none.shape == v.shape


def _bad_cases():
    (q, k, v, g, beta), _ = make_inputs(B=2, T=9)
    return {
        "3-d q": (dict(q=q[0]), "q must be [B, T, H, K]"),
        "k shape": (dict(k=k[:, :5]), "k must have q's shape"),
        "g shape": (dict(g=g[..., :4]), "g (log decay"),
        "v shape": (dict(v=v[:, :4]), "v must be [B, T, H, V]"),
        "beta shape": (dict(beta=beta[..., None]), "beta must be [B, T, H]"),
        "varlen batch": (dict(cu_seqlens=torch.tensor([0, 9])), "cu_seqlens needs batch size 1"),
        "state shape": (dict(initial_state=torch.zeros(2, 3, 16, 11)), "initial_state must be [N, H, K, V]"),
        "chunk size": (dict(chunk_size=0), "chunk_size must be a positive integer"),
    }


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_input_raises_one_line_error(case):
    (q, k, v, g, beta), _ = make_inputs(B=2, T=9)
    args = dict(q=q, k=k, v=v, g=g, beta=beta)
    override, message = _bad_cases()[case]
    args.update(override)
    with pytest.raises(ValueError) as err:
        chunk_kda(**args)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_bad_cu_seqlens_raises_one_line_error():
    (q, k, v, g, beta), _ = make_inputs(B=1, T=9)
    with pytest.raises(ValueError, match="cu_seqlens must be nondecreasing from 0 to T=9"):
        chunk_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 4, 8]))


# --------------------------------------------------------------------------------------------------------------
# the hand-written backward of the chunked kernel (model/kda/chunk.py): finite differences, fp64
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("g_min,n_sub", [(-5.0, 1), (-100.0, 2), (-200.0, 4), (-1000.0, 0)])
@pytest.mark.parametrize("group_bytes", [None, 1])
def test_chunk_backward_passes_gradcheck(g_min, n_sub, group_bytes, monkeypatch):
    """torch.autograd.gradcheck on chunk_kda (C = 16, T = 21: a padded last chunk) with the output and the final
    state both in the loss. The gate range picks the score factorisation (fp64: one sub-block, two, four, or
    the exact form); group_bytes = 1 streams the chunks one per group, so the state crosses group boundaries."""
    from model.kda import chunk as chunk_mod

    S = chunk_mod.sub_block_size(16, -g_min, torch.float64)
    assert (16 // S if S else 0) == n_sub  # the case really takes that path
    if group_bytes is not None:
        monkeypatch.setattr(chunk_mod, "GROUP_BYTES", group_bytes)
    (q, k, v, g, beta), S0 = make_inputs(B=1, T=21, H=1, K=4, V=3, g_min=g_min)
    g[:, ::4] = -0.3  # some long-range terms survive strong decay
    xs = [x.clone().requires_grad_() for x in (q, k, v, g, beta, S0)]

    def fn(q, k, v, g, beta, S0):
        return chunk_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True, chunk_size=16)

    assert torch.autograd.gradcheck(fn, xs, eps=1e-6, atol=1e-7, rtol=1e-5)


def test_chunk_backward_with_only_the_final_state_in_the_loss():
    """No gradient flows into o (the kernel's backward gets None for it): gradients still match the recurrence."""
    (q, k, v, g, beta), S0 = make_inputs(B=2, T=37, H=2, K=8, V=5)

    def grads(fn):
        xs = [x.clone().requires_grad_() for x in (q, k, v, g, beta, S0)]
        _, S = fn(*xs[:5], initial_state=xs[5], output_final_state=True, chunk_size=16)
        (S * S).sum().backward()
        return [torch.zeros_like(x) if x.grad is None else x.grad for x in xs]  # q does not reach the state

    for name, a, b in zip(["q", "k", "v", "g", "beta", "initial_state"], grads(chunk_kda), grads(recurrent_kda)):
        assert max_err(a, b) <= 1e-10, name

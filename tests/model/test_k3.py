"""The whole LM (issue 3 §3, docs/model.md §10 items 14, 16): schedule, causality, batch independence, packed
documents, loss conventions, init, activation checkpointing, balancing hooks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model.config import K3Config
from model.k3 import K3Cache, K3ForCausalLM, _ChunkedCrossEntropy, causal_lm_loss
from model.kda import KDA
from model.mla import GatedMLA
from model.moe.layer import LatentMoE
from tests.model.micro import exercise_every_path, micro_config


def random_model(cfg: K3Config | None = None, seed: int = 0) -> K3ForCausalLM:
    """fp64 model with non-zero AttnRes queries and router biases, so every path mixes and routes non-trivially."""
    torch.manual_seed(seed)
    return exercise_every_path(K3ForCausalLM(cfg or micro_config()).double().eval())


# --- structure ----------------------------------------------------------------------------------------------------


def test_k3_preset_builds_on_meta_with_the_released_schedule():
    cfg = K3Config.preset("k3")
    with torch.device("meta"):
        m = K3ForCausalLM(cfg)
    layers = m.model.layers
    kinds = [type(l.self_attn) for l in layers]
    assert kinds.count(KDA) == 69 and kinds.count(GatedMLA) == 24
    assert [i + 1 for i, l in enumerate(layers) if isinstance(l.self_attn, GatedMLA)] == [*range(4, 93, 4), 93]
    assert not layers[0].is_moe and hasattr(layers[0], "mlp")
    assert all(isinstance(l.block_sparse_moe, LatentMoE) for l in layers[1:])
    assert len(m.moe_layers()) == 92
    assert m.lm_head.weight.shape == (163_840, 7168) and m.lm_head.weight is not m.model.embed_tokens.weight


def test_state_dict_keys_use_the_hf_text_spelling():
    keys = set(random_model().state_dict())
    for k in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.output_attn_res_proj.weight",
        "model.output_attn_res_norm.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.self_attention_res_proj.weight",
        "model.layers.0.mlp_res_norm.weight",
        "model.layers.0.self_attn.q_conv1d.weight",
        "model.layers.3.self_attn.kv_a_proj_with_mqa.weight",
        "model.layers.1.block_sparse_moe.gate.e_score_correction_bias",
        "model.layers.1.block_sparse_moe.experts.w1",
        "model.layers.4.post_attention_layernorm.weight",
    ):
        assert k in keys, k


def test_init_follows_the_spec():
    cfg = micro_config(vocab_size=4096, hidden_size=64, pad_token_id=7)
    m = K3ForCausalLM(cfg)
    emb, head = m.model.embed_tokens.weight.detach(), m.lm_head.weight.detach()
    assert (emb[7] == 0).all()
    assert abs(float(emb.std()) - 0.02) < 1e-3 and abs(float(head.std()) - 0.02) < 1e-3
    for name, p in m.named_parameters():
        if name.endswith("_res_proj.weight"):
            assert (p == 0).all(), name
        if name.endswith("_res_norm.weight") or name.endswith("layernorm.weight"):
            assert (p == 1).all(), name


# --- whole-model properties ---------------------------------------------------------------------------------------


def test_causality_future_tokens_do_not_change_past_logits():
    m = random_model()
    ids = torch.randint(0, 61, (1, 23))
    t = 11
    other = ids.clone()
    other[0, t + 1 :] = torch.randint(0, 61, (23 - t - 1,))
    a, b = m(ids).logits, m(other).logits
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], rtol=0, atol=1e-12)
    assert (a[:, t + 1 :] - b[:, t + 1 :]).abs().max() > 1e-6


def test_batch_rows_are_independent():
    m = random_model()
    ids = torch.randint(0, 61, (3, 19))
    full = m(ids).logits
    for i in range(3):
        torch.testing.assert_close(full[i : i + 1], m(ids[i : i + 1]).logits, rtol=0, atol=1e-12)


def test_packed_documents_equal_separate_sequences():
    m = random_model()
    lens = [7, 1, 18, 5]
    docs = [torch.randint(0, 61, (1, n)) for n in lens]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    packed = m(torch.cat(docs, 1), cu_seqlens=cu).logits
    for d, s in zip(docs, cu[:-1].tolist()):
        torch.testing.assert_close(packed[:, s : s + d.shape[1]], m(d).logits, rtol=0, atol=1e-12)


# --- loss -----------------------------------------------------------------------------------------------------------


def test_loss_is_shifted_cross_entropy_ignoring_minus_100():
    m = random_model()
    ids = torch.randint(0, 61, (2, 13))
    labels = ids.clone()
    labels[0, 5] = -100
    out = m(ids, labels=labels)
    ref = F.cross_entropy(out.logits[:, :-1].reshape(-1, 61), labels[:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out.loss, ref, rtol=0, atol=1e-12)
    assert int(out.num_loss_tokens) == 2 * 12 - 1


def test_loss_with_cu_seqlens_ignores_targets_across_document_boundaries():
    m = random_model()
    lens = [6, 9, 4]
    docs = [torch.randint(0, 61, (1, n)) for n in lens]
    cu = torch.tensor([0, 6, 15, 19])
    out = m(torch.cat(docs, 1), labels=torch.cat(docs, 1), cu_seqlens=cu)
    total = sum(F.cross_entropy(m(d).logits[0, :-1], d[0, 1:], reduction="sum") for d in docs)
    assert int(out.num_loss_tokens) == sum(n - 1 for n in lens)
    torch.testing.assert_close(out.loss, total / sum(n - 1 for n in lens), rtol=0, atol=1e-12)


@pytest.mark.parametrize("rows", [1, 4, 1000])
def test_chunked_cross_entropy_value_and_gradient_match_reference(rows):
    logits = torch.randn(11, 17, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 17, (11,))
    targets[[2, 7]] = -100
    ours = _ChunkedCrossEntropy.apply(logits, targets, rows)
    (g_ours,) = torch.autograd.grad(ours * 1.5, logits)
    ref = F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
    (g_ref,) = torch.autograd.grad(ref * 1.5, logits)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(g_ours, g_ref, rtol=0, atol=1e-14)


def test_bf16_logits_loss_is_accumulated_in_fp32_and_grad_keeps_dtype():
    logits = (torch.randn(2, 9, 33) * 3).bfloat16().requires_grad_()
    labels = torch.randint(0, 33, (2, 9))
    loss, _ = causal_lm_loss(logits, labels)
    assert loss.dtype == torch.float32
    ref = F.cross_entropy(logits.double()[:, :-1].reshape(-1, 33), labels[:, 1:].reshape(-1))
    assert abs(float(loss.detach()) - float(ref.detach())) < 1e-5
    loss.backward()
    assert logits.grad.dtype == torch.bfloat16


def test_aux_balance_adds_the_aux_loss_to_the_lm_loss():
    m = random_model(micro_config(moe_balance="aux", moe_aux_loss_coef=0.1)).train()
    ids = torch.randint(0, 61, (2, 9))
    out = m(ids, labels=ids)
    assert out.aux_loss is not None and float(out.aux_loss.detach()) > 0
    ce, _ = causal_lm_loss(out.logits, ids)
    torch.testing.assert_close(out.loss, ce + out.aux_loss, rtol=0, atol=1e-12)
    assert random_model().train()(ids, labels=ids).aux_loss is None  # quantile: no aux loss


# --- training hooks -----------------------------------------------------------------------------------------------


def test_gradient_checkpointing_gives_identical_gradients_and_balancer_statistics():
    ids = torch.randint(0, 61, (2, 17))
    results = []
    for ckpt in (False, True):
        m = random_model(seed=3).train()
        m.set_gradient_checkpointing(ckpt)
        out = m(ids, labels=ids)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        # the recomputation in backward returns its statistics to nobody: the forward's are the only ones
        counts = [int(s.tokens_per_expert.sum()) for s in out.router_stats]
        assert counts == [2 * 17 * m.config.num_experts_per_token] * len(counts)
        errs = [moe.balancer.update(s.balance) for moe, s in zip(m.moe_layers(), out.router_stats)]
        results.append((out.loss.detach(), grads, errs, {n: b.clone() for n, b in m.named_buffers() if "e_score" in n}))
    (l0, g0, met0, b0), (l1, g1, met1, b1) = results
    assert torch.equal(l0, l1)
    assert g0.keys() == g1.keys()
    for n in g0:
        torch.testing.assert_close(g0[n], g1[n], rtol=0, atol=1e-12, msg=n)
    assert met0 == met1
    for n in b0:
        assert torch.equal(b0[n], b1[n])


def test_init_weights_after_meta_build_restores_the_spec_init():
    cfg = micro_config(pad_token_id=3)
    with torch.device("meta"):
        m = K3ForCausalLM(cfg)
    m.to_empty(device="cpu")
    m.init_weights()
    assert all(torch.isfinite(t).all() for t in m.state_dict().values())
    assert (m.model.embed_tokens.weight[3] == 0).all() and (m.model.layers[2].mlp_res_proj.weight == 0).all()
    assert (m.model.norm.weight == 1).all()
    assert (m.model.layers[1].block_sparse_moe.gate.e_score_correction_bias == 0).all()
    assert abs(float(m.lm_head.weight.detach().std()) - 0.02) < 3e-3
    kda = m.model.layers[0].self_attn
    assert (kda.A_log == 0).all() and (kda.o_norm.weight == 1).all()


def test_returned_router_statistics_move_router_biases():
    m = random_model().train()
    before = [moe.gate.e_score_correction_bias.clone() for moe in m.moe_layers()]
    out = m(torch.randint(0, 61, (2, 15)))
    errs = [moe.balancer.update(s.balance) for moe, s in zip(m.moe_layers(), out.router_stats)]
    assert all(e is not None and 0 <= e < 1 for e in errs)
    after = [moe.gate.e_score_correction_bias for moe in m.moe_layers()]
    assert any(not torch.equal(a, b) for a, b in zip(before, after))
    assert all(abs(float(a.mean())) < 1e-9 for a in after)  # quantile balancing re-centres


def test_router_stats_are_returned_per_moe_layer():
    cfg = micro_config()
    out = random_model(cfg)(torch.randint(0, 61, (2, 7)))
    assert [s.layer_idx for s in out.router_stats] == [1, 2, 3, 4]
    assert all(int(s.tokens_per_expert.sum()) == 2 * 7 * cfg.num_experts_per_token for s in out.router_stats)


# --- bad input ----------------------------------------------------------------------------------------------------


def test_bad_inputs_raise_one_line_errors():
    m = random_model()
    ids = torch.randint(0, 61, (2, 5))
    with pytest.raises(ValueError, match="batch size 1"):
        m(ids, cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match=r"cu_seqlens must be 1-D \[0, \.\.\., T=5\]"):
        m(ids[:1], cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="cannot be combined"):
        m(ids[:1], cu_seqlens=torch.tensor([0, 5]), cache=K3Cache.empty(m.config))
    with pytest.raises(ValueError, match="input_ids must be an int64 tensor"):
        m(ids[0])
    with pytest.raises(ValueError, match="labels"):
        m(ids, labels=ids[:, :3])

"""Multi-token prediction (model/mtp.py): off is the old model, the loss equals a per-position float64 reference,
document boundaries and -100 labels are masked, and the gradient reaches the MTP inputs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model.k3 import IGNORE_INDEX, K3ForCausalLM, shift_targets
from model.mtp import depth_targets
from tests.model.micro import exercise_every_path, micro_config


def build(depth: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> K3ForCausalLM:
    torch.manual_seed(seed)
    return exercise_every_path(K3ForCausalLM(micro_config(mtp_depth=depth)).to(dtype))


def batch(T: int = 24, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 61, (1, T), generator=g)
    labels = ids.clone()
    labels[0, 5] = IGNORE_INDEX
    return ids, labels, torch.tensor([0, 9, 17, T])


def test_mtp_depth_0_main_path_is_bitwise_the_model_without_mtp():
    ids, labels, cu = batch()
    with_mtp = build(1)
    plain = K3ForCausalLM(micro_config())
    plain.load_state_dict({k: v for k, v in with_mtp.state_dict().items() if k in plain.state_dict()})
    a, b = plain(ids, labels=labels, cu_seqlens=cu), with_mtp(ids, labels=labels, cu_seqlens=cu)
    assert a.mtp_losses is None and len(plain.model.layers) == 5
    assert torch.equal(a.logits, b.logits) and torch.equal(a.loss, b.loss - b.mtp_loss)


def _reference_mtp_loss(model: K3ForCausalLM, ids, labels, cu) -> list[float]:
    """Per depth: explicit per-position loop over the DeepSeek-V3 recurrence on the truncated sequence [0, T-k)."""
    L, T = model.config.num_hidden_layers, ids.shape[1]
    doc = [sum(int(c) <= t for c in cu[1:]) for t in range(T)]
    h, _ = model.model(ids, cu_seqlens=cu)  # h_0: the main model's final-normed hidden state
    out = []
    for k in range(1, model.config.mtp_depth + 1):
        layer, n = model.model.layers[L + k - 1], T - k
        e = torch.stack([model.model.embed_tokens.weight[ids[0, t + k]] for t in range(n)])[None]
        x = layer.eh_proj(torch.cat([layer.enorm(e), layer.hnorm(h[:, :n])], -1))
        cu_n = torch.unique(torch.clamp(cu, max=n))
        _, h, _ = layer([], x, cu_n, None)
        logits = model.lm_head(model.model.norm(h))[0]
        total, count = 0.0, 0
        for t in range(n - 1 if n > 0 else 0):
            target = int(labels[0, t + 1 + k])
            if doc[t] != doc[t + 1 + k] or target == IGNORE_INDEX:
                continue
            total -= float(F.log_softmax(logits[t], -1)[target])
            count += 1
        out.append(total / count)
    return out


def test_mtp_loss_equals_a_float64_per_position_reference():
    ids, labels, cu = batch()
    model = build(2, dtype=torch.float64)
    with torch.no_grad():
        got = model(ids, labels=labels, cu_seqlens=cu)
        ref = _reference_mtp_loss(model, ids, labels, cu)
    assert torch.allclose(torch.stack(got.mtp_losses), torch.tensor(ref, dtype=torch.float64), rtol=1e-12, atol=0)
    assert torch.allclose(got.mtp_loss, 0.3 * torch.tensor(ref, dtype=torch.float64).mean(), rtol=1e-12, atol=0)


def test_depth_targets_mask_document_boundaries_the_end_and_ignored_labels():
    labels = torch.arange(10, 20)[None]
    labels[0, 8] = IGNORE_INDEX
    cu = torch.tensor([0, 4, 10])
    got = depth_targets(shift_targets(labels, cu), 2, cu)
    # depth 2: position t predicts label t+3 when t+3 is in t's document (docs [0, 4), [4, 10)) and not -100
    assert got[0].tolist() == [13, -100, -100, -100, 17, -100, 19, -100, -100, -100]


def test_gradient_reaches_eh_proj_and_the_mtp_block():
    ids, labels, cu = batch()
    model = build(1)
    model(ids, labels=labels, cu_seqlens=cu).loss.backward()
    block = model.model.layers[5]
    for p in (block.eh_proj.weight, block.enorm.weight, block.hnorm.weight, block.self_attn.kv_b_proj.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0


def test_router_stats_and_moe_layers_include_the_mtp_blocks():
    ids, labels, cu = batch()
    model = build(2)
    out = model(ids, labels=labels, cu_seqlens=cu)
    moe = model.moe_layers()
    assert [m.layer_idx for m in moe][-2:] == [5, 6]
    assert [s.layer_idx for s in out.router_stats] == [m.layer_idx for m in moe]

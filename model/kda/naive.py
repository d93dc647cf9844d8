"""The KDA reference: the gated delta rule one token at a time, in plain PyTorch (docs/model.md §3).

Kept beside the kernel the way fla keeps `fla/ops/kda/naive.py` next to `chunk.py`: it is slow (T sequential steps,
two small matmuls each) and obviously correct, so the chunked kernel (`model/kda/chunk.py`), the tests and
`bench/kda.py` all measure themselves against it. Per head, with alpha_t = exp(g_t) per key channel:

    S' = Diag(alpha_t) S_{t-1}                     decay every key channel of the state
    S_t = S' + beta_t k_t (v_t - S'^T k_t)^T       delta rule: move what S' recalls for k_t towards v_t
    o_t = S_t^T (scale * q_t)

which is the product form S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T written without the
K x K transition matrix. It is also the CPU decode path: `recurrent_kda` (model/kda/ops.py) validates its inputs,
unpacks `cu_seqlens` and calls this loop unless fla's fused kernel is available.
"""

from __future__ import annotations

import torch


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's `naive_recurrent_kda` signature: q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H], state [B, H, K, V].

    Runs in fp64 if any input is fp64, else fp32 (the state's dtype); returns (o [B, T, H, V] in q's dtype, the
    final state or None). Differentiable by autograd; inputs are never modified.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    inputs = (q, k, v, g, beta, initial_state)
    dt = torch.float64 if any(x is not None and x.dtype == torch.float64 for x in inputs) else torch.float32
    scale = K**-0.5 if scale is None else scale
    q_BTHK = q.to(dt) * scale
    k_BTHK, v_BTHV, beta_BTH = k.to(dt), v.to(dt), beta.to(dt)
    alpha_BTHK = g.to(dt).exp()
    if initial_state is None:
        S_BHKV = torch.zeros(B, H, K, V, dtype=dt, device=q.device)
    else:
        S_BHKV = initial_state.to(dt)
    outs = []
    for t in range(T):
        k_BHK = k_BTHK[:, t]
        S_BHKV = S_BHKV * alpha_BTHK[:, t, :, :, None]  # S' = Diag(alpha_t) S_{t-1}
        recalled_BHV = (k_BHK.unsqueeze(-2) @ S_BHKV).squeeze(-2)  # S'^T k_t
        delta_BHV = beta_BTH[:, t, :, None] * (v_BTHV[:, t] - recalled_BHV)
        S_BHKV = S_BHKV + k_BHK.unsqueeze(-1) * delta_BHV.unsqueeze(-2)
        outs.append((q_BTHK[:, t].unsqueeze(-2) @ S_BHKV).squeeze(-2))
    o_BTHV = torch.stack(outs, dim=1) if outs else torch.zeros(B, 0, H, V, dtype=dt, device=q.device)
    return o_BTHV.to(q.dtype), (S_BHKV if output_final_state else None)

"""Muon: momentum whose update matrix is orthogonalised by a Newton-Schulz iteration, AdamW for the rest.

Hidden weight matrices (`*proj.weight`, stacked experts `experts.w1/w2/w3` per expert) take Muon steps; the
query/key/value projections are orthogonalised per head (the [H*K, d] matrix as H independent [K, d] blocks),
since each head is its own linear map. Embeddings, lm_head, norms, gates' 1-D parameters and convolutions take
AdamW steps. Needs whole matrices, so it runs with ZeRO stage 0 (validated in training/config.py).
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterable

import torch
from torch import nn

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # quintic iteration pushing singular values towards 1
_PER_HEAD = re.compile(r"\.(q_proj|k_proj|v_proj|q_b_proj|kv_b_proj)\.weight$")
_MUON = re.compile(r"(proj\.weight|experts\.w[123])$")
_LAYER = re.compile(r"layers\.(\d+)\.")


def newton_schulz(g_BMN: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Approximate U V^T of each [M, N] matrix in a batch (singular values mapped into ~[0.7, 1.2]), in >= fp32."""
    x = g_BMN.float() if g_BMN.dtype not in (torch.float32, torch.float64) else g_BMN
    transpose = x.shape[-2] > x.shape[-1]
    if transpose:
        x = x.transpose(-2, -1)
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    a, b, c = NS_COEFFS
    for _ in range(steps):
        A = x @ x.transpose(-2, -1)
        B = b * A + c * A @ A
        x = a * x + B @ x
    if transpose:
        x = x.transpose(-2, -1)
    return x.to(g_BMN.dtype)


def orthogonalise(update: torch.Tensor, heads: int | None, steps: int) -> torch.Tensor:
    """Orthogonalised update with Muon's shape scale sqrt(max(1, rows/cols)), per head or per leading index."""
    if update.dim() == 2 and heads:
        H = heads
        blocks = update.reshape(H, update.shape[0] // H, update.shape[1])  # [H, K, d]
    elif update.dim() == 2:
        blocks = update.unsqueeze(0)
    else:
        blocks = update.reshape(-1, update.shape[-2], update.shape[-1])  # stacked experts [E, a, b]
    o = newton_schulz(blocks, steps)
    scale = math.sqrt(max(1.0, blocks.shape[-2] / blocks.shape[-1]))
    return (o * scale).reshape(update.shape)


class Muon(torch.optim.Optimizer):
    """Groups with `use_muon=True` take Muon steps (lr = group's `lr`); the others AdamW (decoupled decay)."""

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        lr: float = 3e-4,
        betas=(0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        ns_steps: int = 5,
        nesterov: bool = True,
    ):
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            momentum=momentum,
            ns_steps=ns_steps,
            nesterov=nesterov,
            use_muon=False,
            heads=None,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_group(group)
            else:
                self._adamw_group(group)
        return loss

    def _muon_group(self, group: dict[str, Any]) -> None:
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            st = self.state[p]
            if "momentum_buffer" not in st:
                st["momentum_buffer"] = torch.zeros_like(p)
            buf = st["momentum_buffer"]
            buf.mul_(mu).add_(p.grad)
            upd = p.grad.add(buf, alpha=mu) if group["nesterov"] else buf
            p.mul_(1 - lr * wd)
            p.add_(orthogonalise(upd, group["heads"], group["ns_steps"]), alpha=-lr)

    def _adamw_group(self, group: dict[str, Any]) -> None:
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        b1, b2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            st = self.state[p]
            if "step" not in st:
                st["step"] = 0
                st["exp_avg"] = torch.zeros_like(p)
                st["exp_avg_sq"] = torch.zeros_like(p)
            st["step"] += 1
            k = st["step"]
            p.mul_(1 - lr * wd)
            st["exp_avg"].lerp_(p.grad, 1 - b1)
            st["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
            denom = (st["exp_avg_sq"] / (1 - b2**k)).sqrt_().add_(eps)
            p.addcdiv_(st["exp_avg"], denom, value=-lr / (1 - b1**k))


def muon_param_groups(model: nn.Module, weight_decay: float, cfg) -> list[dict[str, Any]]:
    """Split `model` into Muon groups (per-head q/k/v by layer type, other matrices) and AdamW groups."""
    mcfg = getattr(model, "config", None)
    types = mcfg.layer_types if mcfg is not None else []
    muon_lr, adam_lr = float(cfg.optim.muon_lr), float(cfg.optim.lr)
    by_heads: dict[int | None, list[nn.Parameter]] = {}
    adam_decay, adam_plain = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if _MUON.search(name) and p.dim() in (2, 3) and "embed" not in name and "lm_head" not in name:
            heads = None
            m = _LAYER.search(name)
            if _PER_HEAD.search(name) and m and types:
                t = types[int(m.group(1))]
                h = mcfg.kda_num_heads if t == "kda" else mcfg.num_attention_heads
                heads = h if p.shape[0] % h == 0 else None
            by_heads.setdefault(heads, []).append(p)
        elif p.dim() >= 2:
            adam_decay.append(p)
        else:
            adam_plain.append(p)
    groups: list[dict[str, Any]] = [
        {"params": ps, "use_muon": True, "heads": h, "lr": muon_lr, "weight_decay": weight_decay}
        for h, ps in by_heads.items()
    ]
    groups.append({"params": adam_decay, "use_muon": False, "lr": adam_lr, "weight_decay": weight_decay})
    groups.append({"params": adam_plain, "use_muon": False, "lr": adam_lr, "weight_decay": 0.0})
    return [g for g in groups if g["params"]]

"""Muon on DeepSpeed's sharded Muon plumbing: orthogonalised momentum for hidden matrices, AdamW for the rest.

Hidden weight matrices (`*proj.weight`, `kv_a_proj_with_mqa`, stacked routed experts `experts.w1/w2/w3`, one
matrix per expert) take Muon steps; KDA q/k/v and MLA `q_b_proj`/`kv_b_proj` are orthogonalised per head (the
[H*K, d] matrix as H independent [K, d] blocks, since each head is its own linear map). Embeddings, lm_head, the
router, norms, conv, [1, d] vectors and every 1-D parameter take AdamW steps.

DeepSpeed 0.19.8 does the distribution when the optimizer is a `MuonWithAuxAdam` and the parameters carry
`use_muon` (and `muon_num_heads`): ZeRO-1/2 all-reduce a Muon matrix's whole gradient to every rank holding a
piece of it and orthogonalise it while the gradient partition is built (`stage_1_and_2.get_flat_partition` /
`_get_flat_partition_unpadded`, momentum flat in `optimizer.state[partition]["momentum_buffer"]`, so it is
checkpointed); ZeRO-3 (`reduce_scatter: false`) all-gathers whole gradients and orthogonalises them round-robin
(`stage3._muon_update_sub_group`, momentum partitioned in the optimizer state). The flat partitions then reach
`Muon.step` holding the update, which applies weight decay and the step size.

What is ours is the per-matrix kernel. Every one of those call sites imports `muon_update` from
`deepspeed.runtime.zero.muon.original_muon` inside the function, at call time (the contract relied on);
`install_muon_update` points that name at `muon_update` below, with DeepSpeed's signature and momentum rule
(momentum <- lerp(momentum, g, 1 - beta), nesterov update lerp(g, momentum, beta), non-finite gradients leave the
momentum alone). Why not DeepSpeed's: it is `torch.compile`d (an inductor build per shape on first use, where
k3-train compiles nothing), it runs Newton-Schulz in bf16 on any accelerator reporting bf16 support (the CPU one
does: 2 ranks could not reproduce 1 rank to 1e-5), and its step scale is fixed to sqrt(max(1, rows/cols)). Ours
iterates in >= fp32 and scales by `optim.muon_lr_scale`:
  * `rms` (Kimi K2 / Moonlight): 0.2 * sqrt(max(rows, cols)), the update's RMS matches AdamW's (~0.2), so
    `optim.muon_lr` can be AdamW's lr;
  * `shape` (DeepSpeed, Keller Jordan): sqrt(max(1, rows / cols)), spectral-norm units, lr ~0.02.
rows x cols is the orthogonalised block: one head's [K, d], one expert's matrix, or the whole matrix.
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterable

import torch
from torch import nn

from training.optim.ds_muon import MuonWithAuxAdam, original_muon

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # quintic iteration pushing singular values towards 1
SCALES = ("rms", "shape")
_PER_HEAD = re.compile(r"\.(q_proj|k_proj|v_proj|q_b_proj|kv_b_proj)\.weight$")
_MUON = re.compile(r"(proj\.weight|proj_with_mqa\.weight|experts\.w[123])$")
_LAYER = re.compile(r"layers\.(\d+)\.")
# set by install_muon_update; read by muon_update, which DeepSpeed calls without these arguments
_SETTINGS: dict[str, Any] = {"ns_steps": 5, "scale": "rms"}


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


def block_scale(rows: int, cols: int, scale: str) -> float:
    """Step scale of an orthogonalised [rows, cols] block (see the module docstring)."""
    if scale == "rms":
        return 0.2 * math.sqrt(max(rows, cols))
    if scale == "shape":
        return math.sqrt(max(1.0, rows / cols))
    raise ValueError(f"optim.muon_lr_scale must be one of {SCALES}, got {scale!r}")


def orthogonalise(update: torch.Tensor, heads: int | None, steps: int, scale: str = "shape") -> torch.Tensor:
    """Orthogonalised, scaled update: per head ([H*K, d] as H [K, d] blocks), per leading index (stacked experts
    [E, a, b]) or the whole matrix."""
    if update.dim() == 2 and heads:
        if update.shape[0] % heads:
            raise ValueError(f"per-head Muon: {update.shape[0]} rows do not split into {heads} heads")
        blocks = update.reshape(heads, update.shape[0] // heads, update.shape[1])  # [H, K, d]
    elif update.dim() == 2:
        blocks = update.unsqueeze(0)
    else:
        blocks = update.reshape(-1, update.shape[-2], update.shape[-1])  # stacked experts [E, a, b]
    o = newton_schulz(blocks, steps)
    return (o * block_scale(blocks.shape[-2], blocks.shape[-1], scale)).reshape(update.shape)


@torch.no_grad()
def muon_update(
    grad: torch.Tensor,
    momentum: torch.Tensor,
    beta: float = 0.95,
    ns_steps: int | None = None,
    nesterov: bool = True,
    ns_method: str = "standard",
    is_expert_group: bool = False,
    num_heads: int | None = None,
) -> torch.Tensor:
    """DeepSpeed's `original_muon.muon_update` contract (updates `momentum` in place, returns the update in
    `grad`'s dtype), computed by `orthogonalise` in >= fp32. `ns_method` is accepted and ignored (one iteration);
    a 3-D gradient is a stack of experts whatever `is_expert_group` says."""
    finite = torch.isfinite(grad).all()
    momentum.copy_(torch.where(finite, momentum.lerp(grad.to(momentum.dtype), 1 - beta), momentum))
    upd = grad.to(momentum.dtype).lerp(momentum, beta) if nesterov else momentum
    steps = int(ns_steps if ns_steps is not None else _SETTINGS["ns_steps"])
    out = orthogonalise(upd, num_heads, steps, _SETTINGS["scale"]).to(grad.dtype)
    return torch.where(finite, out, grad)  # a non-finite step stays visible to the overflow check


def install_muon_update(ns_steps: int, scale: str) -> None:
    """Make DeepSpeed's ZeRO Muon paths call `muon_update` (process-wide: one Muon configuration per process)."""
    block_scale(1, 1, scale)  # validates
    _SETTINGS.update(ns_steps=int(ns_steps), scale=str(scale))
    original_muon.muon_update = muon_update


class Muon(MuonWithAuxAdam):
    """DeepSpeed's `MuonWithAuxAdam` (ZeRO recognises it by isinstance) with our kernel and AdamW.

    Groups with `use_muon=True`: a flat ZeRO partition (1-D) already holds its update (see the module docstring),
    a whole matrix (ZeRO-0) is orthogonalised here with its `muon_num_heads`; both then take
    p <- p (1 - lr wd) - lr update. Other groups: AdamW with decoupled decay (torch.optim.AdamW's maths)."""

    def __init__(self, groups: Iterable[dict[str, Any]], ns_steps: int = 5, scale: str = "rms"):
        install_muon_update(ns_steps, scale)
        super().__init__(list(groups))  # inline AdamW (no aux optimizer): nothing compiles

    @torch.no_grad()
    def step(self, closure=None, step_id=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            (self._muon_group if group["use_muon"] else self._adamw_group)(group)
        return loss

    def _muon_group(self, group: dict[str, Any]) -> None:
        lr, wd = group["lr"], group["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.dim() < 2:
                upd = p.grad
            else:
                st = self.state[p]
                if "momentum_buffer" not in st:
                    st["momentum_buffer"] = torch.zeros_like(p)
                heads = getattr(p, "muon_num_heads", None)
                upd = muon_update(p.grad.clone(), st["momentum_buffer"], group["momentum"], num_heads=heads)
            p.mul_(1 - lr * wd)
            p.add_(upd.reshape(p.shape), alpha=-lr)

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


def muon_heads(name: str, shape: tuple[int, ...], mcfg) -> int | None:
    """Heads to orthogonalise separately for parameter `name` (KDA q/k/v, MLA q_b_proj/kv_b_proj), else None."""
    m = _LAYER.search(name)
    if mcfg is None or not _PER_HEAD.search(name) or not m:
        return None
    t = mcfg.layer_kind(int(m.group(1)))  # MTP blocks (>= num_hidden_layers): MLA
    h = mcfg.kda_num_heads if t == "kda" else mcfg.num_attention_heads
    return h if shape[0] % h == 0 else None


def is_muon_matrix(name: str, shape: tuple[int, ...]) -> bool:
    """Hidden matrices (a vector shaped [1, d], such as AttnRes pseudo-queries, is not one)."""
    if not _MUON.search(name) or len(shape) not in (2, 3) or min(shape[-2:]) < 2:
        return False
    return "embed" not in name and "lm_head" not in name


def muon_param_groups(model: nn.Module, weight_decay: float, cfg) -> list[dict[str, Any]]:
    """One Muon group (parameters tagged `use_muon`, `muon_num_heads` for DeepSpeed) and two AdamW groups."""
    mcfg = getattr(model, "config", None)
    o = cfg.optim
    muon, adam_decay, adam_plain = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        shape = tuple(getattr(p, "ds_shape", p.shape))  # ZeRO-3 built sharded: flat already (training/parallel)
        if is_muon_matrix(name, shape):
            p.use_muon, p.muon_num_heads = True, muon_heads(name, shape, mcfg)
            p.is_expert_group = len(shape) == 3
            muon.append(p)
        elif len(shape) >= 2:
            adam_decay.append(p)
        else:
            adam_plain.append(p)
    adam = dict(use_muon=False, lr=float(o.lr), betas=tuple(float(b) for b in o.betas), eps=float(o.eps))
    groups: list[dict[str, Any]] = [
        dict(params=muon, use_muon=True, lr=float(o.muon_lr), momentum=float(o.muon_momentum), ns_method="standard")
        | {"weight_decay": weight_decay},
        dict(adam, params=adam_decay, weight_decay=weight_decay),
        dict(adam, params=adam_plain, weight_decay=0.0),
    ]
    return [g for g in groups if g["params"]]

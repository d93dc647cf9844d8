"""Regenerate the repo golden vector: `python -m tests.golden.make` (writes tests/golden/micro/).

A fixed-seed micro K3 (every code path: KDA over two chunks, MLA, a dense and four MoE layers, Block AttnRes with a
partial last block) saved in the HF layout, plus `golden.safetensors` with `input_ids` and the float64 logits this
code computes. `tests/model/test_golden.py` compares against them at 1e-6 relative, so numerics never drift
silently. Regenerate only for an intended change of the model's function, and say so in the commit.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from safetensors.torch import save_file

from model.config import K3Config
from model.hf import save_hf_checkpoint
from model.k3 import K3ForCausalLM

GOLDEN_DIR = Path(__file__).resolve().parent / "micro"
SEED = 1234


def micro_config() -> K3Config:
    return K3Config(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=5,
        intermediate_size=128,
        linear_attn_config=dict(
            num_heads=2, head_dim=32, short_conv_kernel_size=4, gate_lower_bound=-5.0, use_full_rank_gate=True
        ),
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_experts=4,
        num_experts_per_token=2,
        num_shared_experts=1,
        moe_intermediate_size=32,
        routed_expert_hidden_size=32,
        attn_res_block_size=2,
        kda_chunk_size=16,
    )


def build() -> tuple[K3ForCausalLM, torch.Tensor]:
    """The seeded model (spec init, then non-trivial AttnRes queries/key norms, router biases, A_log) and ids."""
    g = torch.Generator().manual_seed(SEED)
    torch.manual_seed(SEED)
    model = K3ForCausalLM(micro_config())
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("_res_proj.weight"):
                t.copy_(torch.randn(t.shape, generator=g))
            elif name.endswith("_res_norm.weight") or name.endswith("layernorm.weight"):
                t.copy_(1.0 + 0.1 * torch.randn(t.shape, generator=g))
            elif name.endswith("e_score_correction_bias"):
                t.copy_(0.05 * torch.randn(t.shape, generator=g))
            elif name.endswith("A_log"):
                t.copy_(0.5 * torch.randn(t.shape, generator=g))
    ids = torch.randint(0, model.config.vocab_size, (2, 21), generator=g)
    return model, ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=GOLDEN_DIR)
    args = ap.parse_args()
    model, ids = build()
    save_hf_checkpoint(model, args.out)
    with torch.no_grad():
        logits = model.double().eval()(ids).logits
    save_file({"input_ids": ids, "logits": logits.contiguous()}, str(args.out / "golden.safetensors"))
    size = sum(p.stat().st_size for p in args.out.iterdir())
    print(f"wrote {args.out} ({size / 1e6:.2f} MB), max |logit| {float(logits.abs().max()):.3f}")


if __name__ == "__main__":
    main()

"""A frozen base for the LoRA tests: experiment=sft_tiny_base's model (random init, seed 0) and its tiktoken
tokenizer written as an HF checkpoint in-process (a second, not a pretraining run)."""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import OmegaConf

from data import prepare_tokenizer
from model import K3ForCausalLM, save_hf_checkpoint
from training.config import build_model_config, compose


def make_base(out: Path, seed: int = 0, **model_overrides) -> Path:
    cfg = compose(["experiment=sft_tiny_base"])
    mcfg = build_model_config(cfg).replace(**model_overrides)
    tok = prepare_tokenizer(OmegaConf.to_object(cfg.data))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = K3ForCausalLM(mcfg)
    save_hf_checkpoint(model, out)
    tok.save(str(out))
    return out

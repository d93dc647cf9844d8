"""Cross-key checks of one feature each (sequence parallelism, Muon, LoRA, the checkpoint's tokenizer, the data
config), run by `training.config.validate` before any process group: each raises `TrainConfigError` with one line
naming the key and the fix."""

from __future__ import annotations

import glob
import os

from omegaconf import DictConfig, OmegaConf

from data import DataError, Tokenizer, load_tokenizer
from data.config import coerce_config
from data.tokenizer import detect_kind
from model.config import K3Config


class TrainConfigError(ValueError):
    """A training configuration that must not start; the message is one line naming the key and the fix."""


def check_sequence_parallel(cfg: DictConfig, mcfg: K3Config, world_size: int) -> None:
    """`parallel.sp_size` must split the world, the sequence and every mixer's heads (training/parallel/ulysses.py)."""
    sp, seq_len = int(cfg.parallel.sp_size), int(cfg.train.seq_len)
    if sp < 1:
        raise TrainConfigError(f"parallel.sp_size must be >= 1, got {sp}")
    if sp == 1:
        return
    if world_size % sp:
        raise TrainConfigError(
            f"parallel.sp_size={sp} must divide the world size {world_size}; change sp_size or --num_gpus"
        )
    if seq_len % sp:
        raise TrainConfigError(f"train.seq_len={seq_len} must be divisible by parallel.sp_size={sp}")
    for what, heads in (
        ("linear_attn_config.num_heads (KDA)", mcfg.kda_num_heads),
        ("num_attention_heads (MLA)", mcfg.num_attention_heads),
    ):
        if heads % sp:
            raise TrainConfigError(
                f"model {what}={heads} is not divisible by parallel.sp_size={sp}: Ulysses splits heads over the "
                f"sequence-parallel ranks; pick an sp_size dividing {heads}"
            )


def check_precision(cfg: DictConfig) -> None:
    """bf16 trains on fp32 master weights with fp32 gradient accumulation (training/engine.py), which DeepSpeed 0.19
    provides from ZeRO-1 up (`BF16_Optimizer` at stage 1, the ZeRO optimizers above); at ZeRO-0 it refuses that mix
    (`_do_optimizer_sanity_check`), and its bf16-accumulating alternative keeps no fp32 master."""
    import torch

    p = str(cfg.train.precision)
    bf16 = p == "bf16" or (p == "auto" and torch.cuda.is_available())
    if bf16 and int(cfg.deepspeed.zero_stage) == 0:
        raise TrainConfigError(
            f"train.precision={p} (bf16) with deepspeed=zero0: DeepSpeed keeps no fp32 master weights at ZeRO-0; "
            "use deepspeed=zero1 (or higher) for bf16, or train.precision=fp32 with zero0"
        )


def check_muon(cfg: DictConfig) -> None:
    """optim=muon runs on DeepSpeed's ZeRO Muon (training/optim/muon.py); what that cannot do fails here."""
    ds = cfg.deepspeed
    if ds.offload_optimizer or ds.offload_param:
        raise TrainConfigError(
            "optim=muon cannot offload: DeepSpeed offload needs its own CPU Adam, not a client Muon; "
            "use optim=adamw with offload or a deepspeed=zero0..zero3 preset without it"
        )
    if float(cfg.train.grad_clip) > 0:
        raise TrainConfigError(
            f"optim=muon with train.grad_clip={cfg.train.grad_clip}: DeepSpeed's ZeRO Muon would clip the "
            "orthogonalised update (fixed norm), not the gradient; set train.grad_clip=0 (optim=muon's default)"
        )
    if ds.zero_stage == 3 and int(cfg.parallel.sp_size) > 1:
        raise TrainConfigError(
            "optim=muon with ZeRO-3 needs zero_optimization.reduce_scatter=false, which parallel.sp_size>1 "
            "cannot use; use deepspeed=zero2 with sequence parallelism"
        )


def check_lora(cfg: DictConfig) -> None:
    """`finetune=lora` needs a base to freeze and adapter settings model/lora.py accepts."""
    if cfg.finetune != "lora":
        return
    from training.lora import lora_spec  # torch-side module: imported only for LoRA runs

    if not cfg.model.init_from:
        raise TrainConfigError(
            "finetune=lora needs model.init_from=<hf dir> (the frozen base the adapters train on); set it, "
            "or use finetune=none to train every parameter"
        )
    if cfg.optim.name == "muon":
        raise TrainConfigError("finetune=lora trains small adapter matrices only; use optim=adamw with finetune=lora")
    spec = lora_spec(cfg)
    try:
        if spec is not None:
            spec.check()
    except ValueError as e:
        raise TrainConfigError(str(e)) from None


def checkpoint_tokenizer(cfg: DictConfig) -> Tokenizer | None:
    """The tokenizer `model.init_from` ships (its rows are the checkpoint's embedding rows), or None."""
    if not cfg.model.init_from:
        return None
    try:
        detect_kind(cfg.model.init_from)
    except DataError:
        return None  # a checkpoint without tokenizer files: the data config's tokenizer is used
    return load_tokenizer(cfg.model.init_from, kind=str(cfg.data.tokenizer.type))


def check_tokenizer(cfg: DictConfig, mcfg: K3Config) -> None:
    """Pre-flight: the checkpoint's tokenizer fits the model and agrees with a configured one."""
    try:
        tok = checkpoint_tokenizer(cfg)
        if tok is None:
            return
        if tok.vocab_size > mcfg.vocab_size:
            raise TrainConfigError(
                f"the tokenizer of model.init_from={cfg.model.init_from} has {tok.vocab_size} "
                f"ids but the model has vocab_size={mcfg.vocab_size}; use the checkpoint's own "
                "tokenizer and config"
            )
        path = cfg.data.tokenizer.model_path
        if path and load_tokenizer(path).fingerprint != tok.fingerprint:
            raise TrainConfigError(
                f"data.tokenizer.model_path={path} is not the tokenizer of model.init_from="
                f"{cfg.model.init_from}; drop data.tokenizer.model_path (the checkpoint brings "
                "its own)"
            )
    except DataError as e:
        raise TrainConfigError(str(e)) from None


def check_data_config(data: DictConfig) -> None:
    """Pre-flight data checks that need no process group: the data config itself, local paths, tokenizer file."""
    try:
        dcfg = coerce_config(OmegaConf.to_object(data))
    except DataError as e:
        raise TrainConfigError(str(e)) from None
    tok = dcfg.tokenizer.model_path
    if tok and not os.path.exists(tok):
        raise TrainConfigError(
            f"data.tokenizer.model_path={tok} does not exist; fix it, or set it to null to "
            "train (and cache) the default tokenizer"
        )
    for i, src in enumerate(dcfg.sources):
        if src.type in ("embedded", "hub", "synthetic"):
            continue
        if not os.path.exists(src.path) and not glob.glob(src.path):
            raise TrainConfigError(f"data.sources[{i}].path={src.path} does not exist; fix the path or glob")

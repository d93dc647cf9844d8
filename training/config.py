"""Typed training configuration: Hydra structured configs plus the cross-key validation.

Every section is a dataclass registered in Hydra's ConfigStore, so a typo'd key, a wrong type or a choice outside
its Enum (precision, optimizer, schedule, logging mode, and every `Literal` field of K3Config such as
`model.moe_balance`) fails when the config is composed, with Hydra's own message, before any process group or
run directory exists. `validate` adds the checks that span several keys (batch arithmetic, ZeRO/EP/offload
combinations, model vs sequence length, missing files; one feature's checks each in training/checks.py) and raises
`TrainConfigError` with one line naming the key and the fix.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from data import DataConfig, SourceConfig
from model.config import ConfigError, K3Config, preset_names
from model.presets import preset_vision
from training.checks import (
    TrainConfigError,
    check_data_config,
    check_lora,
    check_muon,
    check_precision,
    check_sequence_parallel,
    check_tokenizer,
)
from training.eval.checks import check_eval


class Choice(str, Enum):
    """A config choice: compares, prints and serialises as its value (`cfg.optim.name == "muon"`)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Precision(Choice):
    auto = "auto"  # fp32 on CPU (exact resume), bf16 on GPU
    fp32 = "fp32"
    bf16 = "bf16"


class OptimName(Choice):
    adamw = "adamw"
    muon = "muon"


class MuonScale(Choice):
    rms = "rms"  # Kimi K2 / Moonlight: 0.2 * sqrt(max(rows, cols)), AdamW-matched update RMS
    shape = "shape"  # DeepSpeed / Keller Jordan: sqrt(max(1, rows / cols))


class ScheduleName(Choice):
    cosine = "cosine"
    wsd = "wsd"
    constant = "constant"


class LossOn(Choice):
    assistant = "assistant"  # chat sources: assistant turns (+ their end marker) only; text sources: every token
    all = "all"


class FreezeGroup(Choice):
    """`train.freeze` groups (NeMo-AM's freeze options; the release trains the tower jointly, so none by default)."""

    vision_tower = "vision_tower"
    mm_projector = "mm_projector"
    language_model = "language_model"  # the whole text model, embeddings and lm_head included
    embeddings = "embeddings"  # the input embedding table `embed_tokens`


class Finetune(Choice):
    none = "none"  # every parameter trains
    lora = "lora"  # adapters over a frozen model.init_from (model/lora.py, training/lora.py)


class BaseExperts(Choice):
    bf16 = "bf16"  # frozen routed experts held in the model dtype
    mxfp4 = "mxfp4"  # held as the release's MXFP4 codes, dequantised at use


class LoggingMode(Choice):
    offline = "offline"
    online = "online"
    disabled = "disabled"


_LITERAL_ENUMS: dict[tuple, type[Choice]] = {}


def _literal_enum(values: tuple) -> type[Choice]:
    """One Choice Enum per distinct Literal of K3Config (its values are the one home of the choices)."""
    if values not in _LITERAL_ENUMS:
        _LITERAL_ENUMS[values] = Choice("Choice_" + "_".join(values), [(v, v) for v in values])  # type: ignore
    return _LITERAL_ENUMS[values]


# --- model: every K3Config field, optional (None = the preset's value) ----------------------------------------
def _omegaconf_type(tp: Any) -> Any:
    """Map K3Config's annotations (PEP 604 unions, Literal, builtin generics) onto types OmegaConf accepts."""
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return _literal_enum(typing.get_args(tp))
    if origin in (dict, Dict):
        return Dict[str, Any]
    if origin in (list, List):
        return List[Any]
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if args and origin is not None:  # Optional / union: keep the first non-None member
        return _omegaconf_type(args[0])
    return tp


def _model_fields() -> list[tuple[str, Any, Any]]:
    hints = typing.get_type_hints(K3Config)
    out: list[tuple[str, Any, Any]] = [
        ("preset", str, field(default="tiny")),
        ("init_from", Optional[str], field(default=None)),
        ("expert_backend", str, field(default="auto")),  # runtime: auto|grouped_mm|loop (model/moe/grouped.py)
    ]
    for f in dataclasses.fields(K3Config):
        # vision_config: true = the preset's tower; a mapping = VisionConfig fields; false = text-only; null = the
        # preset's default (k3: the release's tower; tiny/small: text-only)
        if f.name == "vision_config":
            out.append((f.name, Any, field(default=None)))
            continue
        out.append((f.name, Optional[_omegaconf_type(hints[f.name])], field(default=None)))
    return out


ModelSection = dataclasses.make_dataclass("ModelSection", _model_fields())
ModelSection.__doc__ = (
    "`preset` picks K3Config.preset(...); any other non-null key overrides that preset field (HF key names); "
    "`init_from` starts from an HF checkpoint directory (its config.json wins over the preset)."
)


@dataclass
class TrainSection:
    steps: int = 100
    seed: int = 0
    seq_len: int = 256
    micro_batch_size: int = 8  # rows per rank per micro-batch
    grad_accum: int = 1
    grad_clip: float = 1.0
    precision: Precision = Precision.auto
    activation_checkpointing: bool = False
    activation_offload: bool = False  # the checkpointed layer inputs live in host memory (model/offload.py)
    loss_tile_tokens: int = 0  # > 0: tiled logits + CE, this many tokens of logits at a time (model/loss.py)
    ffn_tile_tokens: int = 0  # > 0: dense FFN / shared experts recompute over tiles of this many tokens (model/ffn.py)
    mixer_tile_tokens: int = 0  # > 0: KDA chunked core over recomputed tiles of this many tokens (model/kda/tiled.py)
    max_bad_steps: int = 5  # stop (with a checkpoint) after this many consecutive non-finite steps; 0 = never
    loss_on: LossOn = LossOn.assistant  # which tokens of chat sources carry loss
    mtp_weight: float = 0.3  # loss = main + mtp_weight x mean of the model.mtp_depth MTP depths' CE (model/mtp.py)
    freeze: List[FreezeGroup] = field(default_factory=list)  # frozen: no gradients, no optimizer state


@dataclass
class OptimSection:
    name: OptimName = OptimName.adamw
    lr: float = 3e-4
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    muon_lr: float = 3e-4
    muon_momentum: float = 0.95
    muon_ns_steps: int = 5
    muon_lr_scale: MuonScale = MuonScale.rms  # step scale of an orthogonalised block (training/optim/muon.py)
    qk_clip_tau: Optional[float] = None  # QK-Clip's bound on MLA logits (Kimi K2: 100); null = off (docs/optim.md)


@dataclass
class ScheduleSection:
    name: ScheduleName = ScheduleName.cosine
    warmup_frac: float = 0.01
    decay_frac: float = 0.2  # wsd: fraction of steps in the final decay
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1


@dataclass
class DeepSpeedSection:
    zero_stage: int = 2
    offload_optimizer: bool = False
    offload_param: bool = False
    overlap_comm: bool = False
    reduce_bucket_size: int = 50_000_000
    # ZeRO-3: optimizer sub-group size in elements (DeepSpeed's default 1e9). The step flattens one sub-group's
    # gradients at a time (stage3 `_prepare_fp32_grad_for_sub_group`), so this bounds that fp32 transient.
    sub_group_size: int = 20_000_000
    extra: Dict[str, Any] = field(default_factory=dict)  # deep-merged last into the generated JSON


@dataclass
class ParallelSection:
    ep_size: int = 1
    sp_size: int = 1  # Ulysses sequence parallelism: each sequence split over this many ranks (training/parallel)
    # A collective (or the rendezvous) waiting longer than this for a peer fails and the rank exits: a lost node
    # ends the job instead of hanging it. DeepSpeed's default for its world group, here for every group (gloo and
    # NCCL); keep it above the longest wait a healthy job has (a checkpoint write). docs/multinode.md
    timeout_s: float = 1800.0


@dataclass
class LoRASection:
    """`finetune=lora` (conf/finetune/lora.yaml): adapter ranks, scale, dropout, targets (model/lora.py)."""

    rank: int = 16
    expert_rank: int = 2
    alpha: float = 32.0
    dropout: float = 0.0
    targets: List[str] = field(  # model/lora.py LINEAR_TARGETS names, and "experts" (the routed experts)
        default_factory=lambda: [
            *("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"),
            *("gate_proj", "up_proj", "down_proj", "experts"),
        ]
    )
    base_experts: BaseExperts = BaseExperts.bf16


@dataclass
class LoggingSection:
    mode: LoggingMode = LoggingMode.offline
    every: int = 10
    project: str = "k3-train"
    heatmap_every: int = 100
    progress: bool = True
    group: Optional[str] = None  # W&B run group (launch/sweep.sh gives every job of a sweep the same one)


@dataclass
class CheckpointSection:
    every: int = 0  # 0: only the final checkpoint
    resume: str = "auto"  # auto | none | <checkpoint dir>
    keep_last: int = 2
    save_final: bool = True
    fallback: bool = False  # resume: a corrupted newest checkpoint falls back to the previous complete one
    allow_changes: List[str] = field(default_factory=list)  # resume despite these changes: train.steps|data|optim.lr
    start_over: bool = False  # archive the run dir's previous run (archive/<UTC time>/) and start fresh
    keep_best: Optional[str] = None  # eval/<set or task>/<metric>: keep + mark the best checkpoint (checkpoint/best.py)


@dataclass
class EvalSetSection:
    """One loss set (training/eval/sets.py): its own `sources` (like data.sources) or `heldout: true`."""

    name: str = "heldout"
    heldout: bool = False  # the held-out share of data.sources (data.sources[i].holdout, data/holdout.py)
    sources: List[SourceConfig] = field(default_factory=list)
    rows: int = 32  # fixed rows of train.seq_len tokens scored at every evaluation; 0 = the whole set


@dataclass
class EvalSection:
    """`eval=<none|heldout|...>` (conf/eval/): held-out loss and tasks in the loop (training/eval/)."""

    every: int = 0  # evaluate every this many steps and at the last step; 0 = off
    on_start: bool = False  # also before the first step of a session
    sets: List[EvalSetSection] = field(default_factory=list)
    tasks: List[Dict[str, Any]] = field(default_factory=list)  # each {type: choice|passkey, name, ...}
    batch_rows: int = 0  # rows per rank per evaluation forward; 0 = train.micro_batch_size


@dataclass
class LauncherSection:
    """Only for `--multirun` sweeps: num_gpus > 0 re-launches each job with the deepspeed launcher."""

    num_gpus: int = 0
    hostfile: Optional[str] = None


@dataclass
class TrainConfig:
    name: str = "default"
    run_dir: Optional[str] = None  # null -> runs/<name>
    model: ModelSection = field(default_factory=ModelSection)  # type: ignore[valid-type]
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimSection = field(default_factory=OptimSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    deepspeed: DeepSpeedSection = field(default_factory=DeepSpeedSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    train: TrainSection = field(default_factory=TrainSection)
    launcher: LauncherSection = field(default_factory=LauncherSection)
    finetune: Finetune = Finetune.none
    lora: LoRASection = field(default_factory=LoRASection)
    callbacks: List[str] = field(default_factory=list)  # extra training.callbacks.Callback classes, by import path
    eval: EvalSection = field(default_factory=EvalSection)


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def register_configs() -> None:
    """Register the schema so conf/train.yaml (which lists `train_schema` first in its defaults) is typed, and
    `${k3_repo:}` (this checkout's root) so shipped example data resolves from any working directory."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    if not OmegaConf.has_resolver("k3_repo"):
        OmegaConf.register_new_resolver("k3_repo", lambda: REPO_ROOT)


register_configs()

CONF_DIR = os.path.join(REPO_ROOT, "conf")


def compose(overrides: list[str] | None = None) -> DictConfig:
    """Compose conf/train.yaml with overrides outside of @hydra.main (tests, tools)."""
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra_compose(config_name="train", overrides=list(overrides or []))


# --- derived values -----------------------------------------------------------------------------------------
def resolve_run_dir(cfg: DictConfig) -> str:
    return os.path.abspath(cfg.run_dir or os.path.join("runs", cfg.name))


def data_parallel_size(cfg: DictConfig, world_size: int) -> int:
    """Ranks that hold different rows: the world divided by the sequence-parallel size (its ranks share rows)."""
    return world_size // int(cfg.parallel.sp_size)


def global_batch_rows(cfg: DictConfig, world_size: int) -> int:
    return cfg.train.micro_batch_size * cfg.train.grad_accum * data_parallel_size(cfg, world_size)


def build_model_config(cfg: DictConfig) -> K3Config:
    """K3Config from the `model` section; errors become one-line TrainConfigError."""
    m = OmegaConf.to_container(cfg.model, resolve=True, enum_to_str=True)
    preset, init_from = m.pop("preset"), m.pop("init_from")
    backend = m.pop("expert_backend", None) or "auto"  # runtime (K3ForCausalLM.set_expert_backend), not config.json
    if backend not in ("auto", "grouped_mm", "loop"):
        raise TrainConfigError(f"model.expert_backend must be auto|grouped_mm|loop, got {backend!r}")
    overrides = {k: v for k, v in m.items() if v is not None}
    try:
        if init_from:
            base = K3Config.from_hf_config(init_from)
            lac = overrides.pop("linear_attn_config", None)
            if lac:
                overrides["linear_attn_config"] = {**base.linear_attn_config, **lac}
            return base.replace(**overrides) if overrides else base
        vision = overrides.get("vision_config")
        if isinstance(vision, dict):  # a mapping overrides fields of the preset's own tower
            text = K3Config.preset(preset, **{k: v for k, v in overrides.items() if k != "vision_config"})
            overrides["vision_config"] = {**preset_vision(preset, text.hidden_size).to_dict(), **vision}
        return K3Config.preset(preset, **overrides)
    except ConfigError as e:
        raise TrainConfigError(f"model: {e}") from None
    except TypeError as e:
        raise TrainConfigError(f"model: {e}") from None


def check_parallel_layout(cfg: DictConfig, world_size: int) -> None:
    """What DeepSpeed cannot run with ZeRO-3 + EP, checked on the generated DeepSpeed JSON (training/parallelize.py).
    Local imports: training.engine and training.parallelize import torch/DeepSpeed pieces this module avoids."""
    from training.engine import build_ds_config
    from training.parallelize import LayoutError, check_layout

    try:
        check_layout(int(cfg.deepspeed.zero_stage), int(cfg.parallel.ep_size), build_ds_config(cfg, world_size))
    except LayoutError as e:
        raise TrainConfigError(str(e)) from None


def validate(cfg: DictConfig, world_size: int) -> K3Config:
    """Cross-key checks that must pass before any process group starts; returns the model config."""

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise TrainConfigError(msg)

    t, ds, par = cfg.train, cfg.deepspeed, cfg.parallel
    need(
        cfg.model.preset in preset_names() or cfg.model.init_from,
        f"unknown model preset {cfg.model.preset!r}; use model=<{'|'.join(preset_names())}>",
    )
    if cfg.model.init_from:
        need(
            os.path.isfile(os.path.join(cfg.model.init_from, "config.json")),
            f"model.init_from={cfg.model.init_from} has no config.json; point it at an HF checkpoint directory",
        )
    mcfg = build_model_config(cfg)
    for key in ("steps", "seq_len", "micro_batch_size", "grad_accum"):
        need(t[key] >= 1, f"train.{key} must be >= 1, got {t[key]}")
    need(
        t.seq_len <= mcfg.max_position_embeddings,
        f"train.seq_len={t.seq_len} exceeds model max_position_embeddings={mcfg.max_position_embeddings}",
    )
    need(world_size >= 1, f"world size must be >= 1, got {world_size}")
    need(ds.zero_stage in (0, 1, 2, 3), f"deepspeed.zero_stage must be 0..3, got {ds.zero_stage}")
    need(
        not (ds.offload_optimizer or ds.offload_param) or ds.zero_stage >= 1,
        "CPU offload needs ZeRO stage >= 1; use deepspeed=zero2_offload or deepspeed=zero3_offload",
    )
    need(
        not ds.offload_param or ds.zero_stage == 3, "deepspeed.offload_param needs ZeRO-3; use deepspeed=zero3_offload"
    )
    check_precision(cfg)
    if cfg.optim.name == "muon":
        check_muon(cfg)
    need(par.ep_size >= 1, f"parallel.ep_size must be >= 1, got {par.ep_size}")
    need(
        world_size % par.ep_size == 0,
        f"parallel.ep_size={par.ep_size} must divide the world size {world_size}; change ep_size or --num_gpus",
    )
    need(
        mcfg.num_experts % par.ep_size == 0,
        f"parallel.ep_size={par.ep_size} must divide model.num_experts={mcfg.num_experts}",
    )
    check_sequence_parallel(cfg, mcfg, world_size)
    check_parallel_layout(cfg, world_size)
    need(0 <= cfg.schedule.warmup_frac < 1, f"schedule.warmup_frac must be in [0, 1), got {cfg.schedule.warmup_frac}")
    need(0 <= cfg.schedule.decay_frac <= 1, f"schedule.decay_frac must be in [0, 1], got {cfg.schedule.decay_frac}")
    need(cfg.optim.lr > 0, f"optim.lr must be > 0, got {cfg.optim.lr}")
    tau = cfg.optim.qk_clip_tau
    need(
        tau is None or 0 < tau < float("inf"),
        f"optim.qk_clip_tau must be > 0 (K2 uses 100) or null to turn QK-Clip off, got {tau}",
    )
    need(cfg.logging.every >= 1, f"logging.every must be >= 1, got {cfg.logging.every}")
    need(cfg.checkpoint.every >= 0, f"checkpoint.every must be >= 0 (0 = only at the end), got {cfg.checkpoint.every}")
    need(
        t.activation_checkpointing or not t.activation_offload,
        "train.activation_offload=true offloads activation checkpoints: set train.activation_checkpointing=true too",
    )
    for key in ("loss_tile_tokens", "ffn_tile_tokens"):
        need(t[key] >= 0, f"train.{key} must be >= 0 (0 = untiled), got {t[key]}")
    C = mcfg.kda_chunk_size
    need(
        t.mixer_tile_tokens >= 0 and t.mixer_tile_tokens % C == 0,
        f"train.mixer_tile_tokens must be >= 0 (0 = untiled) and a multiple of kda_chunk_size={C}, got "
        f"{t.mixer_tile_tokens}",
    )
    need(t.mtp_weight >= 0, f"train.mtp_weight must be >= 0 (DeepSeek-V3: 0.3, then 0.1), got {t.mtp_weight}")
    need(t.max_bad_steps >= 0, f"train.max_bad_steps must be >= 0 (0 = never stop), got {t.max_bad_steps}")
    vision = sorted({str(g) for g in t.freeze} & {"vision_tower", "mm_projector"})
    need(
        not vision or mcfg.vision_config is not None,
        f"train.freeze={vision}: the model has no vision tower; set model.vision_config (or drop those groups)",
    )
    need(cfg.checkpoint.keep_last >= 1, f"checkpoint.keep_last must be >= 1, got {cfg.checkpoint.keep_last}")
    r = cfg.checkpoint.resume
    if r not in ("auto", "none"):
        need(os.path.isdir(r), f"checkpoint.resume={r} is not a directory; use auto, none or a checkpoint path")
    check_data_config(cfg.data)
    check_tokenizer(cfg, mcfg)
    check_lora(cfg)
    check_eval(cfg)
    return mcfg

"""K3Config: one dataclass for the whole text model, mirroring the released HF `text_config` keys.

Field names are the HF keys (docs/model.md §12) so `config.json` round-trips; the few project-only
settings (balancer, chunk size) are saved too and ignored by other readers. The 3:1 KDA/MLA schedule is derived
(`layer_types`), never hand-listed in presets. Every check raises `ConfigError` with one line naming the key and
the fix.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from model.presets import _PRESETS, K3_MEDIA_PLACEHOLDER_TOKEN_ID, VISION_BY_DEFAULT, k3_schedule, preset_vision
from model.presets import preset_names as preset_names
from model.vision.config import VisionConfig, VisionConfigError

BalanceMode = Literal["quantile", "sign", "aux", "none"]  # the one list of balancing modes (training's Enum too)
BalanceEstimator = Literal["exact", "histogram"]

_LINEAR_ATTN_KEYS = (
    "full_attn_layers",
    "kda_layers",
    "num_heads",
    "head_dim",
    "short_conv_kernel_size",
    "gate_lower_bound",
    "use_full_rank_gate",
)


class ConfigError(ValueError):
    """A model configuration that cannot be built; the message names the key and the fix."""


@dataclass
class K3Config:
    # --- global -------------------------------------------------------------------------------------------
    vocab_size: int = 4096
    hidden_size: int = 256
    num_hidden_layers: int = 8
    intermediate_size: int = 1024  # dense FFN width (layers < first_k_dense_replace)
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1_048_576
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    mtp_depth: int = 0  # multi-token-prediction blocks (model/mtp.py); HF/DeepSeek-V3: num_nextn_predict_layers
    # --- SiTU-GLU ---------------------------------------------------------------------------------------------
    hidden_act: str = "situ"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    # --- KDA (`linear_attn_config`); None lists are derived from the 3:1 schedule ---------------------------------
    linear_attn_config: dict[str, Any] = field(default_factory=dict)
    # --- Gated MLA --------------------------------------------------------------------------------------------
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    q_lora_rank: int | None = 128
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    # --- LatentMoE --------------------------------------------------------------------------------------------
    num_experts: int = 8
    num_experts_per_token: int = 2
    num_shared_experts: int = 2
    moe_intermediate_size: int = 128
    routed_expert_hidden_size: int = 128  # latent width l
    latent_moe_use_norm: bool = True
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    moe_router_activation_func: str = "sigmoid"
    num_expert_group: int = 1
    topk_group: int = 1
    topk_method: str = "noaux_tc"
    use_grouped_topk: bool = True
    # --- Block Attention Residuals (None or 0 disables: plain PreNorm residual stack) ---------------------------
    attn_res_block_size: int | None = 3
    # --- project-only settings (saved in config.json; other readers ignore them) -------------------------------
    kda_chunk_size: int = 64
    moe_balance: BalanceMode = "quantile"
    moe_balance_estimator: BalanceEstimator = "exact"
    moe_balance_bins: int = 1000
    moe_sign_update_rate: float = 1e-3  # DeepSeek-V3 gamma
    moe_aux_loss_coef: float = 1e-4  # sequence-wise auxiliary loss coefficient (balance == "aux")
    # --- vision (the release's top-level keys; None = a text-only model) ----------------------------------------
    vision_config: VisionConfig | None = None
    media_placeholder_token_id: int | None = None  # `<|media_pad|>`: where projected image features go

    def __post_init__(self) -> None:
        if isinstance(self.vision_config, dict):
            try:
                self.vision_config = VisionConfig.from_dict(self.vision_config)
            except (VisionConfigError, TypeError) as e:
                raise ConfigError(str(e)) from None
        lac = dict(self.linear_attn_config or {})
        unknown = set(lac) - set(_LINEAR_ATTN_KEYS)
        if unknown:
            raise ConfigError(
                f"linear_attn_config has unknown keys {sorted(unknown)}; allowed: {list(_LINEAR_ATTN_KEYS)}"
            )
        kda, mla = k3_schedule(self.num_hidden_layers)
        lac.setdefault("kda_layers", kda)
        lac.setdefault("full_attn_layers", mla)
        lac.setdefault("num_heads", 4)
        lac.setdefault("head_dim", 64)
        lac.setdefault("short_conv_kernel_size", 4)
        lac.setdefault("gate_lower_bound", -5.0)
        lac.setdefault("use_full_rank_gate", True)
        lac["kda_layers"] = [int(x) for x in lac["kda_layers"]]
        lac["full_attn_layers"] = [int(x) for x in lac["full_attn_layers"]]
        self.linear_attn_config = lac
        self.validate()

    # --- derived views ----------------------------------------------------------------------------------------
    @property
    def layer_types(self) -> list[str]:
        """'kda' or 'mla' for each 0-based layer."""
        mla = set(self.linear_attn_config["full_attn_layers"])
        return ["mla" if (i + 1) in mla else "kda" for i in range(self.num_hidden_layers)]

    def layer_kind(self, layer_idx: int) -> str:
        """'kda' | 'mla' of a 0-based layer; the MTP blocks (indices L..L+mtp_depth-1) are MLA."""
        return self.layer_types[layer_idx] if layer_idx < self.num_hidden_layers else "mla"

    def is_moe_layer(self, layer_idx: int) -> bool:
        """0-based: MoE iff past the first_k_dense_replace dense layers (and on the moe_layer_freq grid); the MTP
        blocks (layer_idx >= num_hidden_layers) always are."""
        if layer_idx >= self.num_hidden_layers:
            return True
        return layer_idx >= self.first_k_dense_replace and layer_idx % self.moe_layer_freq == 0

    @property
    def kda_num_heads(self) -> int:
        return int(self.linear_attn_config["num_heads"])

    @property
    def kda_head_dim(self) -> int:
        return int(self.linear_attn_config["head_dim"])

    @property
    def kda_conv_size(self) -> int:
        return int(self.linear_attn_config["short_conv_kernel_size"])

    @property
    def kda_gate_lower_bound(self) -> float | None:
        g = self.linear_attn_config["gate_lower_bound"]
        return None if g is None else float(g)

    @property
    def kda_use_full_rank_gate(self) -> bool:
        return bool(self.linear_attn_config["use_full_rank_gate"])

    @property
    def mla_q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def attn_res_enabled(self) -> bool:
        return bool(self.attn_res_block_size)

    # --- validation -------------------------------------------------------------------------------------------
    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        L = self.num_hidden_layers
        for key in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "intermediate_size",
            "num_attention_heads",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "v_head_dim",
            "num_experts",
            "num_experts_per_token",
            "moe_intermediate_size",
            "routed_expert_hidden_size",
            "kda_chunk_size",
            "moe_balance_bins",
        ):
            v = getattr(self, key)
            need(
                isinstance(v, int) and not isinstance(v, bool) and v > 0, f"{key} must be a positive integer, got {v!r}"
            )
        need(self.qk_rope_head_dim >= 0, f"qk_rope_head_dim must be >= 0, got {self.qk_rope_head_dim}")
        need(self.num_shared_experts >= 0, f"num_shared_experts must be >= 0, got {self.num_shared_experts}")
        need(
            self.q_lora_rank is None or self.q_lora_rank > 0,
            f"q_lora_rank must be positive or null, got {self.q_lora_rank!r}",
        )
        need(not self.tie_word_embeddings, "tie_word_embeddings must be false: K3 has an untied lm_head")
        need(self.hidden_act == "situ", f"hidden_act must be 'situ' (SiTU-GLU), got {self.hidden_act!r}")
        need(
            self.moe_router_activation_func == "sigmoid",
            f"moe_router_activation_func must be 'sigmoid', got {self.moe_router_activation_func!r}",
        )
        need(self.mla_use_nope, "mla_use_nope must be true: this implementation has no RoPE (K3 is NoPE)")
        need(
            isinstance(self.mtp_depth, int) and not isinstance(self.mtp_depth, bool) and self.mtp_depth >= 0,
            f"mtp_depth must be an integer >= 0 (0 = no multi-token prediction), got {self.mtp_depth!r}",
        )
        for key in ("initializer_range", "routed_scaling_factor"):
            need(getattr(self, key) > 0, f"{key} must be > 0, got {getattr(self, key)}")
        for key in ("moe_sign_update_rate", "moe_aux_loss_coef"):
            need(getattr(self, key) >= 0, f"{key} must be >= 0, got {getattr(self, key)}")
        need(self.rms_norm_eps >= 0, f"rms_norm_eps must be >= 0, got {self.rms_norm_eps}")

        lac = self.linear_attn_config
        kda, mla = lac["kda_layers"], lac["full_attn_layers"]
        covered = sorted(kda + mla)
        need(
            covered == list(range(1, L + 1)),
            "linear_attn_config.kda_layers + full_attn_layers must list every layer 1..num_hidden_layers exactly "
            f"once (1-indexed); got kda={kda} full_attn={mla} for num_hidden_layers={L}",
        )
        need(
            self.kda_num_heads > 0 and self.kda_head_dim > 0,
            f"linear_attn_config.num_heads/head_dim must be positive, got {self.kda_num_heads}/{self.kda_head_dim}",
        )
        need(
            self.kda_conv_size >= 1, f"linear_attn_config.short_conv_kernel_size must be >= 1, got {self.kda_conv_size}"
        )
        g = self.kda_gate_lower_bound
        need(g is None or g < 0, f"linear_attn_config.gate_lower_bound must be negative or null, got {g}")

        need(
            self.num_key_value_heads == self.num_attention_heads,
            f"num_key_value_heads ({self.num_key_value_heads}) must equal num_attention_heads "
            f"({self.num_attention_heads}) for MLA",
        )
        need(
            self.num_experts_per_token <= self.num_experts,
            f"num_experts_per_token ({self.num_experts_per_token}) must be <= num_experts ({self.num_experts})",
        )
        need(
            self.num_expert_group >= 1 and self.num_experts % self.num_expert_group == 0,
            f"num_experts ({self.num_experts}) must be divisible by num_expert_group ({self.num_expert_group})",
        )
        need(
            1 <= self.topk_group <= self.num_expert_group,
            f"topk_group ({self.topk_group}) must be in [1, num_expert_group={self.num_expert_group}]",
        )
        per_group = self.num_experts // self.num_expert_group
        need(
            self.topk_group * per_group >= self.num_experts_per_token,
            f"topk_group*experts_per_group ({self.topk_group * per_group}) must be >= num_experts_per_token "
            f"({self.num_experts_per_token}); raise topk_group",
        )
        need(
            0 <= self.first_k_dense_replace <= L,
            f"first_k_dense_replace must be in [0, num_hidden_layers={L}], got {self.first_k_dense_replace}",
        )
        need(self.moe_layer_freq >= 1, f"moe_layer_freq must be >= 1, got {self.moe_layer_freq}")
        need(
            self.attn_res_block_size is None or self.attn_res_block_size >= 0,
            f"attn_res_block_size must be >= 1 (or 0/null to disable), got {self.attn_res_block_size}",
        )
        for key, choices in (
            ("moe_balance", get_args(BalanceMode)),
            ("moe_balance_estimator", get_args(BalanceEstimator)),
        ):
            need(getattr(self, key) in choices, f"{key} must be one of {'|'.join(choices)}, got {getattr(self, key)!r}")
        for tok in ("bos_token_id", "eos_token_id", "pad_token_id", "media_placeholder_token_id"):
            t = getattr(self, tok)
            need(t is None or 0 <= t < self.vocab_size, f"{tok}={t} is outside the vocabulary [0, {self.vocab_size})")
        v = self.vision_config
        if v is not None:
            need(isinstance(v, VisionConfig), f"vision_config must be a dict or VisionConfig, got {type(v).__name__}")
            need(
                self.media_placeholder_token_id is not None,
                "media_placeholder_token_id is required with vision_config (the `<|media_pad|>` id)",
            )
            need(
                v.text_hidden_size == self.hidden_size,
                f"vision_config.text_hidden_size ({v.text_hidden_size}) must equal hidden_size ({self.hidden_size})",
            )
            try:
                v.validate()
            except VisionConfigError as e:
                raise ConfigError(str(e)) from None

    # --- presets ----------------------------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> K3Config:
        """`tiny` (CPU smoke, ~10M), `small` (one GPU, ~274M), `k3` (the released dims, 2.78T, with the released
        vision tower). `vision_config=True` gives a preset its tower (tiny/small: a small one), None text-only."""
        if name not in _PRESETS:
            raise ConfigError(f"unknown model preset {name!r}; choose one of {sorted(_PRESETS)}")
        kwargs = copy.deepcopy(_PRESETS[name])
        lac_over = overrides.pop("linear_attn_config", None)
        if lac_over:
            kwargs["linear_attn_config"] = {**kwargs.get("linear_attn_config", {}), **lac_over}
        if (
            "num_hidden_layers" in overrides
            and "linear_attn_config" in kwargs
            and not (lac_over and ("kda_layers" in lac_over or "full_attn_layers" in lac_over))
        ):
            # a changed depth re-derives the schedule
            kwargs["linear_attn_config"].pop("kda_layers", None)
            kwargs["linear_attn_config"].pop("full_attn_layers", None)
        vision = overrides.pop("vision_config", name in VISION_BY_DEFAULT)
        kwargs.update(overrides)
        if vision is True:
            vision = preset_vision(name, kwargs["hidden_size"])
        if vision not in (None, False):
            kwargs["vision_config"] = vision
            default_id = K3_MEDIA_PLACEHOLDER_TOKEN_ID if name == "k3" else kwargs["vocab_size"] - 1
            kwargs.setdefault("media_placeholder_token_id", default_id)
        return cls(**kwargs)

    # --- HF config.json ---------------------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, path_or_dict: str | os.PathLike | dict[str, Any]) -> K3Config:
        """Read a flat or `text_config`-nested HF config (dict, config.json path, or checkpoint dir)."""
        if isinstance(path_or_dict, dict):
            raw = path_or_dict
        else:
            p = os.fspath(path_or_dict)
            if os.path.isdir(p):
                p = os.path.join(p, "config.json")
            if not os.path.isfile(p):
                raise ConfigError(f"no config.json at {p}; pass a checkpoint directory or a config.json path")
            with open(p, encoding="utf-8") as f:
                raw = json.load(f)
        top = raw
        if isinstance(raw.get("text_config"), dict):
            raw = raw["text_config"]
        names = {f.name for f in dataclasses.fields(cls)} - {"vision_config", "media_placeholder_token_id"}
        kwargs = {k: v for k, v in raw.items() if k in names}
        if "mtp_depth" not in raw and raw.get("num_nextn_predict_layers"):  # DeepSeek-V3's key for the MTP blocks
            kwargs["mtp_depth"] = int(raw["num_nextn_predict_layers"])
        if isinstance(top.get("vision_config"), dict):  # the release: vision keys sit beside text_config
            kwargs["vision_config"] = {"text_hidden_size": raw.get("hidden_size"), **top["vision_config"]}
            kwargs["media_placeholder_token_id"] = top.get("media_placeholder_token_id")
        if isinstance(kwargs.get("linear_attn_config"), dict):
            kwargs["linear_attn_config"] = {
                k: v for k, v in kwargs["linear_attn_config"].items() if k in _LINEAR_ATTN_KEYS
            }
        # HF configs use a list for eos sometimes; keep the first
        for tok in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if isinstance(kwargs.get(tok), list):
                kwargs[tok] = kwargs[tok][0] if kwargs[tok] else None
        return cls(**kwargs)

    def to_hf_config(self) -> dict[str, Any]:
        """Flat HF text config (`model_type: kimi_linear`) including the project-only keys; with vision, the
        release's nesting: `text_config` beside `vision_config` and `media_placeholder_token_id` (`kimi_k3`)."""
        d = dataclasses.asdict(self)
        vision, media = d.pop("vision_config"), d.pop("media_placeholder_token_id")
        d["linear_attn_config"] = dict(self.linear_attn_config)
        d["num_nextn_predict_layers"] = self.mtp_depth  # DeepSeek-V3 readers' name for the MTP blocks
        d["model_type"] = "kimi_linear"
        d["architectures"] = ["KimiLinearForCausalLM"]
        if self.vision_config is None:
            return d
        return {
            "model_type": "kimi_k3",
            "architectures": ["KimiK3ForConditionalGeneration"],
            "text_config": d,
            "vision_config": self.vision_config.to_dict() if vision is not None else None,
            "media_placeholder_token_id": media,
        }

    def text_only(self) -> K3Config:
        """This config without its vision tower (the text model K3ForCausalLM builds)."""
        return dataclasses.replace(self, vision_config=None, media_placeholder_token_id=None)

    def save(self, path: str | os.PathLike) -> None:
        """Write config.json into directory `path` (created if needed)."""
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
            json.dump(self.to_hf_config(), f, indent=2, sort_keys=True)
            f.write("\n")

    def replace(self, **changes: Any) -> K3Config:
        """A copy with `changes`; a new depth without explicit layer lists re-derives the 3:1 schedule."""
        if "num_hidden_layers" in changes and "linear_attn_config" not in changes:
            lac = {k: v for k, v in self.linear_attn_config.items() if k not in ("kda_layers", "full_attn_layers")}
            changes["linear_attn_config"] = lac
        return dataclasses.replace(self, **changes)


def _ceil_to(x: int, m: int) -> int:
    return int(math.ceil(x / m) * m)


def a_log_storage_len(num_heads: int) -> int:
    """Length A_log is stored with in a checkpoint: zero-padded to ceil(H/128)*128 (docs/model.md §12)."""
    return _ceil_to(num_heads, 128)

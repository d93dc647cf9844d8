"""Hydra configuration: every group composes, typos fail at compose time, cross-key validation is one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from training.config import TrainConfigError, build_model_config, compose, global_batch_rows, validate

CONF = Path(__file__).resolve().parents[2] / "conf"
REPO = CONF.parent


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize(
    "group", ["model", "data", "optim", "schedule", "deepspeed", "parallel", "logging", "experiment"]
)
def test_every_group_option_composes_and_validates(group):
    options = group_options(group)
    assert options, f"conf/{group}/ is empty"
    for opt in options:
        over = [f"{group}={opt}"]
        if opt == "muon":
            over.append("deepspeed=zero0")
        cfg = compose(over)
        world = 2 if cfg.parallel.ep_size <= 2 else cfg.parallel.ep_size
        if cfg.model.init_from and not os.path.isdir(cfg.model.init_from):
            # a fine-tuning experiment whose base checkpoint is made by another documented command
            with pytest.raises(TrainConfigError, match="model.init_from"):
                validate(cfg, world)
            continue
        mcfg = validate(cfg, world)
        assert mcfg.num_hidden_layers >= 1


def test_group_selection_reaches_the_typed_config():
    cfg = compose(["model=small", "deepspeed=zero3_offload", "logging=disabled", "optim=adamw"])
    assert cfg.model.preset == "small"
    assert cfg.deepspeed.zero_stage == 3 and cfg.deepspeed.offload_param
    assert cfg.logging.mode == "disabled"


def test_interface_overrides_are_typed_keys():
    cfg = compose(
        [
            "train.steps=7",
            "train.seed=3",
            "train.seq_len=32",
            "train.micro_batch_size=2",
            "train.grad_accum=3",
            "checkpoint.every=5",
            "checkpoint.resume=none",
            "logging.mode=disabled",
            "logging.every=2",
            "run_dir=/tmp/x",
            "model.moe_balance=sign",
            "parallel.ep_size=2",
        ]
    )
    assert (cfg.train.steps, cfg.train.grad_accum, cfg.checkpoint.every, cfg.run_dir) == (7, 3, 5, "/tmp/x")
    assert build_model_config(cfg).moe_balance == "sign"
    assert global_batch_rows(cfg, world_size=2) == 2 * 3 * 2


def test_model_overrides_go_through_to_k3config():
    cfg = compose(["model=tiny", "model.num_hidden_layers=4", "model.hidden_size=128"])
    m = build_model_config(cfg)
    assert (m.num_hidden_layers, m.hidden_size) == (4, 128)
    assert m.layer_types == ["kda", "kda", "kda", "mla"]


def test_typo_key_fails_at_compose_time():
    with pytest.raises(ConfigCompositionException) as e:
        compose(["train.stepz=3"])
    assert isinstance(e.value.__cause__, ConfigKeyError) or "stepz" in str(e.value.__cause__ or e.value)


def test_wrong_type_fails_at_compose_time():
    with pytest.raises(ConfigCompositionException) as e:
        compose(["train.steps=many"])
    assert isinstance(e.value.__cause__, ValidationError) or "steps" in str(e.value.__cause__)


@pytest.mark.parametrize(
    "override",
    [
        "model.moe_balance=magic",
        "model.moe_balance_estimator=guess",
        "train.precision=fp8",
        "optim.name=sgd",
        "schedule.name=linear",
        "logging.mode=loud",
    ],
)
def test_choice_outside_its_enum_fails_at_compose_time(override):
    with pytest.raises(ConfigCompositionException) as e:
        compose([override])
    assert override.split("=")[1] in str(e.value.__cause__ or e.value)


def test_choices_read_as_their_values():
    cfg = compose(["optim=muon", "deepspeed=zero0", "model.moe_balance=sign"])
    assert cfg.optim.name == "muon" and f"{cfg.optim.name}" == "muon"
    assert build_model_config(cfg).moe_balance == "sign"
    assert type(build_model_config(cfg).moe_balance) is str


def test_unknown_model_field_fails_at_compose_time():
    with pytest.raises(ConfigCompositionException):
        compose(["model.num_layerz=3"])


@pytest.mark.parametrize(
    "overrides,world,needle",
    [
        (["train.micro_batch_size=0"], 1, "train.micro_batch_size"),
        (["model.preset=huge"], 1, "unknown model preset"),
        (["model.num_experts_per_token=99"], 1, "num_experts_per_token"),
        (["parallel.ep_size=3"], 2, "must divide the world size"),
        (["parallel.ep_size=2", "model.num_experts=3", "model.num_experts_per_token=1"], 2, "model.num_experts"),
        (["optim=muon", "deepspeed=zero2_offload"], 1, "offload"),
        (["deepspeed=zero0", "deepspeed.offload_optimizer=true"], 1, "ZeRO stage >= 1"),
        (["train.seq_len=4096", "model.max_position_embeddings=1024"], 1, "max_position_embeddings"),
        (["checkpoint.resume=/nonexistent/ckpt"], 1, "checkpoint.resume"),
        (["model.init_from=/nonexistent/hf"], 1, "model.init_from"),
    ],
)
def test_cross_key_errors_are_one_line(overrides, world, needle):
    with pytest.raises(TrainConfigError) as e:
        validate(compose(overrides), world)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg


def test_bad_config_exits_nonzero_with_one_line_and_touches_nothing(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").write_text("step_00000003")
    env = dict(os.environ, DS_ACCELERATOR="cpu", WANDB_MODE="disabled")
    env.pop("RANK", None)
    p = subprocess.run(
        [sys.executable, "-m", "training.train", f"run_dir={run_dir}", "train.grad_accum=0"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    assert lines[-1].startswith("error: train.grad_accum"), p.stderr
    assert sorted(os.listdir(run_dir)) == ["checkpoints"]
    assert os.listdir(run_dir / "checkpoints") == ["latest"]
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_00000003"


def test_missing_data_file_is_a_one_line_error(tmp_path):
    cfg = compose([f"data.sources=[{{type: jsonl, path: {tmp_path}/nope.jsonl}}]"])
    with pytest.raises(TrainConfigError, match="nope.jsonl"):
        validate(cfg, 1)


def test_missing_tokenizer_file_is_a_one_line_error(tmp_path):
    cfg = compose([f"data.tokenizer.model_path={tmp_path}/tok.model"])
    with pytest.raises(TrainConfigError, match="tok.model"):
        validate(cfg, 1)

"""finetune=lora end to end on one process (ZeRO-2): refusals, a checkpoint of adapters only, bitwise resume,
the base identity, PEFT adapter export and the merged export's logits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from model import load_hf_checkpoint
from model.lora import is_adapter_param
from tests.distributed.conftest import must_succeed, run_training
from tests.lora_base import make_base
from tests.training.export_compare import assert_same_as_consolidated
from training.config import TrainConfigError, compose, validate
from training.tools.export import export_checkpoint, load_checkpoint_model

STEPS = 4


def _job(base: Path, *extra: str) -> list[str]:
    return [
        "experiment=sft_tiny",
        "finetune=lora",
        f"model.init_from={base}",
        "deepspeed=zero2",
        f"train.steps={STEPS}",
        "train.micro_batch_size=2",
        "checkpoint.every=2",
        "logging.every=1",
        "logging.mode=disabled",
        *extra,
    ]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lora")


@pytest.fixture(scope="module")
def base(root) -> Path:
    return make_base(root / "base-hf")


@pytest.fixture(scope="module")
def ref(root, base):
    return must_succeed(run_training(root / "ref", _job(base), launcher=False))


def _tag(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / f"step_{STEPS:08d}"


@pytest.fixture(scope="module")
def mxfp4(root, base):
    """1 rank ZeRO-3, frozen experts as MXFP4 codes (the sft_tiny base is dense: quantised on load)."""
    return must_succeed(
        run_training(root / "mxfp4", _job(base, "lora.base_experts=mxfp4", "deepspeed=zero3"), launcher=False)
    )


def test_mxfp4_base_trains_and_checkpoints_adapters_only(mxfp4):
    losses = mxfp4.losses()
    assert sorted(losses) == list(range(1, STEPS + 1)) and losses[STEPS] < losses[1]
    module = torch.load(next(_tag(mxfp4.run_dir).glob("*model_states.pt")), map_location="cpu", weights_only=False)[
        "module"
    ]
    assert any(".experts.lora." in k for k in module)
    assert not [k for k in module if ".experts.w" in k]  # no codes (non-persistent buffers), no base experts


def test_mxfp4_merged_export_gives_the_trained_models_logits(root, mxfp4):
    out = export_checkpoint(str(mxfp4.run_dir), str(root / "mxfp4-merged"), merge=True)
    trained, _ = load_checkpoint_model(str(mxfp4.run_dir))
    merged = load_hf_checkpoint(out, dtype=torch.float32).eval()
    ids = torch.randint(0, trained.config.vocab_size, (2, 33))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, trained.eval()(ids).logits, rtol=1e-5, atol=1e-5)
    # streamed from the base (quantised per expert as in training) == built in memory and merged, bitwise
    assert_same_as_consolidated(mxfp4.run_dir, Path(out), root / "mxfp4-merged-cmp")


def test_lora_without_init_from_is_refused_in_one_line():
    with pytest.raises(TrainConfigError, match="finetune=lora needs model.init_from") as e:
        validate(compose(["experiment=sft_tiny", "finetune=lora", "model.init_from=null"]), 1)
    assert "\n" not in str(e.value)


def test_checkpoint_holds_adapters_and_their_optimizer_state_only(ref):
    tag = _tag(ref.run_dir)
    module = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    params = [k for k, v in module.items() if v.is_floating_point() and not k.endswith("e_score_correction_bias")]
    assert params and all(is_adapter_param(k) for k in params)
    trainable = sum(module[k].numel() for k in params)
    optim = torch.load(next(tag.glob("*optim_states.pt")), weights_only=False)["optimizer_state_dict"]
    master = sum(t.numel() for t in optim["single_partition_of_fp32_groups"])
    assert master == trainable  # no fp32 master (and so no Adam moments) for any base weight
    record = json.loads((tag / "lora.json").read_text())
    assert record["base.path"] == str(ref.run_dir.parent / "base-hf") and len(record["base.hash"]) == 64


def test_resume_reproduces_the_uninterrupted_losses_bitwise(root, base, ref):
    run_dir = root / "resumed"
    killed = run_training(run_dir, _job(base), launcher=False, env={"K3_FAULT_KILL_AT_STEP": "3"})
    assert killed.returncode != 0
    resumed = must_succeed(run_training(run_dir, _job(base), launcher=False))
    assert "resumed from" in resumed.stdout
    assert resumed.losses() == ref.losses() and len(ref.losses()) == STEPS


def test_resume_on_another_base_is_refused_in_one_line(root, base, ref):
    other = root / "other-base"
    shutil.copytree(base, other)
    make_base(other, seed=1)  # same names and shapes, other weights
    res = run_training(ref.run_dir, _job(other), launcher=False)
    assert res.returncode == 2
    line = res.stderr.strip().splitlines()[-1]
    assert "base.hash" in line and "base.path" in line


def test_resume_at_another_layout_is_refused_in_one_line(ref, base):
    res = run_training(ref.run_dir, _job(base, "deepspeed=zero3"), launcher=False)
    assert res.returncode == 2
    assert "layout.zero_stage 2 -> 3" in res.stderr.strip().splitlines()[-1]


def test_adapter_export_is_peft_layout_keyed_by_release_names(root, ref):
    out = Path(export_checkpoint(str(ref.run_dir), str(root / "peft"), adapters=True))
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 16 and config["rank_pattern"]
    with safe_open(out / "adapter_model.safetensors", "pt") as f:
        keys = set(f.keys())
        a = f.get_tensor("base_model.model.language_model.model.layers.1.block_sparse_moe.experts.5.w1.lora_A.weight")
    assert "base_model.model.language_model.model.layers.0.self_attn.q_proj.lora_B.weight" in keys
    assert a.shape[0] == 2  # lora.expert_rank
    model, _ = load_checkpoint_model(str(ref.run_dir))
    n_adapter = sum(p.numel() for n, p in model.named_parameters() if is_adapter_param(n))
    with safe_open(out / "adapter_model.safetensors", "pt") as f:
        assert sum(f.get_tensor(k).numel() for k in keys) == n_adapter


def test_merged_export_gives_the_trained_models_logits(root, ref):
    out = export_checkpoint(str(ref.run_dir), str(root / "merged"), merge=True)
    trained, _ = load_checkpoint_model(str(ref.run_dir))
    merged = load_hf_checkpoint(out, dtype=torch.float32).eval()
    ids = torch.randint(0, trained.config.vocab_size, (2, 33))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, trained(ids).logits, rtol=1e-5, atol=1e-5)
    assert_same_as_consolidated(ref.run_dir, Path(out), root / "merged-cmp")  # streamed == merged in memory


@pytest.mark.parametrize(
    "override, message",
    [
        ("lora.targets=[qproj]", "lora.targets has unknown names"),
        ("lora.rank=0", "lora.rank must be >= 1"),
        ("optim=muon", "use optim=adamw with finetune=lora"),
    ],
)
def test_bad_lora_settings_are_refused_in_one_line(base, override, message):
    cfg = compose(["experiment=sft_tiny", "finetune=lora", f"model.init_from={base}", override])
    with pytest.raises(TrainConfigError, match=message) as e:
        validate(cfg, 1)
    assert "\n" not in str(e.value)


def test_evaluating_the_checkpoint_scores_base_plus_adapters(root, base, ref):
    """`training.evaluate` on the LoRA run (its checkpoint holds adapters only; the tool merges them into the base)
    gives the held-out loss of the trained model with its adapters live, not the base's."""
    import subprocess
    import sys

    from data import DataConfig, load_tokenizer
    from model import load_hf_checkpoint
    from tests.distributed.conftest import REPO, job_env
    from training.eval.forward import EvalContext
    from training.eval.loss import evaluate_loss
    from training.eval.sets import build_loss_set

    chat = REPO / "data" / "examples" / "chat_tiny.jsonl"
    sets = f"eval.sets=[{{name: chat, rows: 6, sources: [{{type: jsonl, path: {chat}, format: chat}}]}}]"
    out = root / "lora_eval.json"
    cmd = [sys.executable, "-m", "training.evaluate", f"checkpoint={ref.run_dir}", sets, f"out={out}"]
    p = subprocess.run(cmd, cwd=REPO, env=job_env(None), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(out.read_text())["chat"]["loss"]

    spec = {"name": "chat", "rows": 6, "sources": [{"type": "jsonl", "path": str(chat), "format": "chat"}]}
    chat_set = build_loss_set(spec, DataConfig(), load_tokenizer(str(base)), 256, "assistant")  # sft_tiny's rows

    def loss(model) -> float:
        return evaluate_loss(EvalContext(model.eval(), torch.device("cpu"), batch_rows=2), chat_set)["loss"]

    trained, _ = load_checkpoint_model(str(ref.run_dir))  # base + adapters, unmerged
    assert got == pytest.approx(loss(trained), rel=1e-5)
    assert abs(got - loss(load_hf_checkpoint(str(base), dtype=torch.float32))) > 1e-3  # the adapters count

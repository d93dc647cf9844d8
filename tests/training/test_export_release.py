"""`training.export --format release` (issue 37 §3): the release's tensor names, dtypes and config, and the round
trip: a release-layout checkpoint loaded and exported again gives the same bytes (MXFP4 codes and scales
included); the golden tiny checkpoint survives load -> export -> load with its logits."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from model import K3ForConditionalGeneration, load_hf_checkpoint
from model.hf import FP32_SUFFIXES
from tests.model.vision_micro import micro_mm_config, randomise
from training.tools.export import export_checkpoint, export_model


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _golden_logits(ckpt: Path, golden: Path) -> tuple[torch.Tensor, torch.Tensor]:
    ref = load_file(str(golden / "golden.safetensors"))
    with torch.no_grad():
        return load_hf_checkpoint(ckpt, dtype=torch.float64).eval()(ref["input_ids"]).logits, ref["logits"]


def test_golden_tiny_release_export_round_trips_byte_for_byte(golden_tiny_dir, tmp_path):
    r1, r2, hf = tmp_path / "r1", tmp_path / "r2", tmp_path / "hf"
    export_checkpoint(str(golden_tiny_dir), str(r1), fmt="release")  # the HF directory itself: load -> export
    export_model(load_hf_checkpoint(r1), str(r2), fmt="release", max_shard_bytes=400_000)  # loaded, untouched
    a, b = _tensors(r1), _tensors(r2)
    assert a.keys() == b.keys() and len(list(r2.glob("*.safetensors"))) > 1
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k
    packed = [k for k in a if k.endswith(".weight_packed")]
    assert len(packed) == 7 * 8 * 3 and not any(k.endswith("experts.0.w1.weight") for k in a)  # 7 MoE layers
    assert a["model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"].shape == (32, 32)
    assert a["model.layers.1.block_sparse_moe.experts.0.w1.weight_scale"].shape == (32, 2)
    for k, t in a.items():
        want = torch.float32 if k.endswith(FP32_SUFFIXES) else torch.bfloat16
        want = torch.uint8 if "experts." in k and ".weight_" in k else want
        assert t.dtype == want, k
    cfg = json.loads((r1 / "config.json").read_text())
    assert cfg["quantization_config"]["format"] == "mxfp4-pack-quantized" and cfg["torch_dtype"] == "bfloat16"
    # the two release exports compute the same logits; the hf layout keeps the golden ones (fp32 stored)
    l1, _ = _golden_logits(r1, golden_tiny_dir)
    l2, _ = _golden_logits(r2, golden_tiny_dir)
    assert torch.equal(l1, l2)
    export_model(load_hf_checkpoint(golden_tiny_dir), str(hf))
    got, ref = _golden_logits(hf, golden_tiny_dir)
    assert float((got - ref).abs().max()) <= 1e-8


def test_release_export_of_a_multimodal_model_nests_its_config(tmp_path):
    m = randomise(K3ForConditionalGeneration(micro_mm_config(moe_intermediate_size=32, routed_expert_hidden_size=32)))
    out = tmp_path / "rel"
    export_model(m, str(out), fmt="release")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["KimiK3ForConditionalGeneration"] and "text_config" in cfg
    assert cfg["media_placeholder_token_id"] == m.config.media_placeholder_token_id
    assert cfg["vision_config"]["vt_hidden_size"] == 16 and "quantization_config" in cfg
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())  # noqa: SIM118
    assert "language_model.model.layers.1.block_sparse_moe.experts.0.w2.weight_packed" in keys
    assert "language_model.lm_head.weight" in keys and any(k.startswith("vision_tower.") for k in keys)
    loaded = load_hf_checkpoint(out, dtype=torch.float32)
    assert isinstance(loaded, K3ForConditionalGeneration)
    for k, t in m.state_dict().items():
        if k.startswith(("vision_tower.", "mm_projector.")):
            assert torch.equal(loaded.state_dict()[k], t.to(torch.bfloat16).float()), k

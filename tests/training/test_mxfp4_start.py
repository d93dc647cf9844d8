"""The sharded start of an MXFP4 base (lora.base_experts=mxfp4; training/parallel/construct.py, model/hf.py
HFReader.expert_codes): an EP rank keeps the release's codes of its own experts, bit for bit, and reads no other
expert's; a dense (bf16/fp32) checkpoint is quantised on load to the reference quantiser's codes."""

from __future__ import annotations

import torch
from safetensors import safe_open

from model.hf import HFReader
from model.lora import LoRASpec, apply_lora
from model.mxfp4 import pack_mxfp4
from tests.model.test_hf import micro_config
from tests.training.test_sharded_start import _released
from training.parallel.construct import build_meta, materialise
from training.parallelize import shard_experts

MXFP4 = LoRASpec(rank=2, expert_rank=2, alpha=4.0, base_experts="mxfp4")


def _rank_model(cfg, path, ep_rank: int | None):
    """The meta model with mxfp4 experts (EP rank `ep_rank` of 2, or all experts), materialised from `path`."""
    model = build_meta(cfg)
    apply_lora(model, MXFP4)
    if ep_rank is not None:
        E = cfg.num_experts
        for moe in model.moe_layers():
            shard_experts(moe, E // 2, ep_rank * (E // 2))
    reader = HFReader(path)
    materialise(model, 0, None, reader)
    return model, reader.bytes_read


def test_an_ep_rank_keeps_the_release_codes_of_its_experts_only(tmp_path):
    cfg = micro_config()
    path = _released(tmp_path, cfg)
    _, full_bytes = _rank_model(cfg, path, None)
    model, half_bytes = _rank_model(cfg, path, 1)
    E = cfg.num_experts
    stored = {}
    for file in path.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            stored.update({k: f.get_tensor(k) for k in f.keys() if "experts" in k})  # noqa: SIM118
    checked = 0
    for name, buf in model.named_buffers():
        if name.endswith(("_packed", "_scale")):
            prefix, w, part = name.rsplit(".", 1)[0], *name.rsplit(".", 1)[1].split("_")
            assert buf.shape[0] == E // 2
            for r in range(E // 2):
                key = f"language_model.{prefix}.{E // 2 + r}.{w}.weight_{part}"
                assert torch.equal(buf[r], stored[key]), key
                checked += 1
    assert checked == 6 * (E // 2) * len(model.moe_layers())
    assert half_bytes < full_bytes


def test_a_dense_checkpoint_is_quantised_on_load(tmp_path):
    cfg = micro_config()
    _released(tmp_path, cfg)
    plain = tmp_path / "plain"  # the same model saved dense (fp32)
    model, _ = _rank_model(cfg, plain, None)
    with safe_open(plain / "model.safetensors", "pt") as f:
        dense = {k: f.get_tensor(k) for k in f.keys() if ".experts." in k}  # noqa: SIM118
    checked = 0
    for name, buf in model.named_buffers():
        if name.endswith("_packed"):
            prefix, w = name.rsplit(".", 1)[0], name.rsplit(".", 1)[1].split("_")[0]
            scale = dict(model.named_buffers())[f"{prefix}.{w}_scale"]
            for j in range(buf.shape[0]):
                packed, s = pack_mxfp4(dense[f"{prefix}.{j}.{w}.weight"])
                assert torch.equal(buf[j], packed) and torch.equal(scale[j], s)
                checked += 1
    assert checked == 3 * cfg.num_experts * len(model.moe_layers())

"""Sharded construction in one process (training/parallel/construct.py, model/hf.py HFReader).

The released layout (`language_model.` prefix, vision keys, padded A_log, MXFP4 experts, several shards behind
`model.safetensors.index.json`) is read lazily: the meta-built model materialised through the reader equals
`load_hf_checkpoint`, an EP rank's slice reads only its experts, and a row range reads only those rows.
Fresh construction is the same whatever the experts a rank holds.
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from model.hf import HFReader, load_hf_checkpoint, save_hf_checkpoint
from model.mxfp4 import pack_mxfp4
from tests.model.test_hf import micro_config, randomised
from training.parallel.construct import build_meta, materialise
from training.parallelize import shard_experts


def _released(tmp_path, cfg):
    """Write `cfg`'s random model as a K3 release: MXFP4 experts, prefixed keys, vision tensors, 3 shards."""
    m = randomised(cfg)
    save_hf_checkpoint(m, tmp_path / "plain")
    from safetensors.torch import load_file

    state = load_file(str(tmp_path / "plain" / "model.safetensors"))
    rel: dict[str, torch.Tensor] = {}
    for k, t in state.items():
        if ".experts." in k:
            (
                rel["language_model." + k.replace(".weight", ".weight_packed")],
                rel["language_model." + k.replace(".weight", ".weight_scale")],
            ) = pack_mxfp4(t)
        else:
            rel["language_model." + k] = t
    rel["vision_tower.patch_embed.weight"] = torch.zeros(3, 3)
    rel["mm_projector.proj.weight"] = torch.zeros(2, 2)
    out = tmp_path / "release"
    out.mkdir()
    keys = sorted(rel)
    shards = [keys[i::3] for i in range(3)]
    weight_map = {}
    for i, ks in enumerate(shards):
        name = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file({k: rel[k] for k in ks}, str(out / name))
        weight_map.update(dict.fromkeys(ks, name))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps({"model_type": "kimi_k3", "text_config": cfg.to_hf_config()}))
    return out


def test_reader_materialises_the_released_layout_like_load_hf_checkpoint(tmp_path):
    cfg = micro_config()
    path = _released(tmp_path, cfg)
    ref = load_hf_checkpoint(path, text_only=True).state_dict()  # (its vision tensors: dropped, explicitly)
    model = build_meta(cfg)
    reader = HFReader(path)
    materialise(model, 0, None, reader)
    got = model.state_dict()
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    assert not any(k.startswith(("vision_tower", "mm_projector")) for k in reader.where)


def test_an_ep_rank_reads_only_its_experts(tmp_path):
    cfg = micro_config()
    path = _released(tmp_path, cfg)
    ref = load_hf_checkpoint(path, text_only=True).state_dict()  # (its vision tensors: dropped, explicitly)
    full, half = HFReader(path), HFReader(path)
    materialise(build_meta(cfg), 0, None, full)
    model = build_meta(cfg)
    E = cfg.num_experts
    for moe in model.moe_layers():
        shard_experts(moe, E // 2, E // 2)  # EP rank 1 of 2
    materialise(model, 0, None, half)
    for name, t in model.state_dict().items():
        want = ref[name][E // 2 :] if ".experts.w" in name else ref[name]
        assert torch.equal(t, want), name
    assert half.bytes_read < full.bytes_read


def test_a_row_range_reads_only_those_rows(tmp_path):
    path = _released(tmp_path, micro_config())
    ref = load_hf_checkpoint(path, text_only=True).state_dict()["lm_head.weight"]
    r = HFReader(path)
    rows = r.read("lm_head.weight", tuple(ref.shape), 3, 7)
    assert torch.equal(rows, ref[3:7]) and r.bytes_read == rows.numel() * rows.element_size()


def test_fresh_construction_does_not_depend_on_which_experts_a_rank_holds():
    cfg = micro_config()
    whole, part = build_meta(cfg), build_meta(cfg)
    E = cfg.num_experts
    for moe in part.moe_layers():
        shard_experts(moe, E // 2, E // 2)
    materialise(whole, 7, None)
    materialise(part, 7, None)
    a, b = whole.state_dict(), part.state_dict()
    for k in a:
        assert torch.equal(b[k], a[k][E // 2 :] if ".experts.w" in k else a[k]), k
    assert any(float(v.abs().sum()) > 0 for k, v in a.items() if ".experts.w" in k)

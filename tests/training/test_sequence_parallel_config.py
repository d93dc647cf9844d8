"""parallel.sp_size: what it changes in the batch arithmetic and the DeepSpeed JSON, and the one-line refusals
before any process group starts (issue 16)."""

from __future__ import annotations

import pytest
import torch

from model.k3 import IGNORE_INDEX, shift_targets
from training.config import TrainConfigError, compose, global_batch_rows, validate
from training.engine import build_ds_config
from training.step import pack_microbatch

TINY = ["experiment=tiny_ci", "logging.mode=offline"]


def test_sequence_parallel_ranks_share_rows_so_the_global_batch_counts_data_parallel_ranks():
    cfg = compose([*TINY, "parallel=sp2", "train.micro_batch_size=2", "train.grad_accum=3"])
    assert global_batch_rows(cfg, 4) == 2 * 3 * 2


def test_the_deepspeed_json_carries_sequence_parallel_size():
    assert build_ds_config(compose([*TINY, "parallel=sp2"]), 2)["sequence_parallel_size"] == 2
    assert "sequence_parallel_size" not in build_ds_config(compose(TINY), 2)


def test_sp_size_must_divide_the_world_size():
    with pytest.raises(TrainConfigError, match=r"parallel.sp_size=2 must divide the world size 3"):
        validate(compose([*TINY, "parallel=sp2"]), 3)


def test_seq_len_must_be_divisible_by_sp_size():
    with pytest.raises(TrainConfigError, match=r"train.seq_len=63 must be divisible by parallel.sp_size=2"):
        validate(compose([*TINY, "parallel=sp2", "train.seq_len=63"]), 2)


@pytest.mark.parametrize(
    "over, what",
    [
        (["model.linear_attn_config.num_heads=3", "model.linear_attn_config.head_dim=16"], "KDA"),
        (["model.num_attention_heads=3", "model.num_key_value_heads=3"], "MLA"),
    ],
)
def test_heads_must_be_divisible_by_sp_size(over, what):
    with pytest.raises(TrainConfigError, match=rf"\({what}\)=3 is not divisible by parallel.sp_size=2"):
        validate(compose([*TINY, "parallel=sp2", *over]), 2)


def test_zero3_with_sequence_parallelism_still_needs_reduce_scatter_with_or_without_experts():
    for ep in ("parallel.ep_size=1", "parallel.ep_size=2"):
        over = [*TINY, "parallel=sp2", ep, "deepspeed=zero3", "+deepspeed.extra.zero_optimization.reduce_scatter=false"]
        with pytest.raises(TrainConfigError, match=r"needs zero_optimization.reduce_scatter=true"):
            validate(compose(over), 2)


def test_the_refusals_exit_non_zero_in_one_line_before_any_rank_starts(tmp_path):
    import subprocess
    import sys

    from tests.distributed.conftest import REPO, job_env

    cmd = [sys.executable, "-m", "training.train", *TINY, "parallel=sp2", f"run_dir={tmp_path}/run"]
    p = subprocess.run(cmd, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode != 0
    assert "parallel.sp_size=2 must divide the world size 1" in p.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_each_sequence_rank_keeps_its_slice_with_targets_shifted_on_the_whole_stream():
    ids = torch.arange(10, 22).view(2, 6)  # two rows of 6 -> one packed stream of 12
    mb = {"input_ids": ids, "labels": ids, "cu_seqlens": torch.tensor([0, 5, 12])}
    whole = shift_targets(ids.reshape(1, -1), torch.tensor([0, 5, 12]))
    parts = [pack_microbatch(mb, 2, r) for r in range(2)]
    assert torch.equal(torch.cat([p.ids_1N for p in parts], 1), ids.reshape(1, -1))
    assert torch.equal(torch.cat([p.targets_1N for p in parts], 1), whole)
    assert int(parts[0].targets_1N[0, -1]) == 16  # the slice's last token predicts the next slice's first
    assert sum(p.n_targets for p in parts) == int((whole != IGNORE_INDEX).sum())
    assert all(torch.equal(p.cu_seqlens, torch.tensor([0, 5, 12])) for p in parts)


def test_sequence_parallel_pieces_carry_the_whole_streams_mtp_factors():
    """MTP under SP (training/step.py MicroBatch.objective): every shard gets n / c_k of the whole stream."""
    from model.mtp import depth_targets

    ids = torch.arange(10, 22).view(2, 6)
    mb = {"input_ids": ids, "labels": ids, "cu_seqlens": torch.tensor([0, 5, 12])}
    whole = shift_targets(ids.reshape(1, -1), torch.tensor([0, 5, 12]))
    n = int((whole != IGNORE_INDEX).sum())
    want = [n / int((depth_targets(whole, k, mb["cu_seqlens"]) != IGNORE_INDEX).sum()) for k in (1, 2)]
    assert want == [10 / 8, 10 / 6]
    assert [pack_microbatch(mb, 2, r, None, 2).mtp_factors for r in range(2)] == [want, want]

"""Image–text training under DeepSpeed (issue 23 §4) on batches mixing synthetic image–caption and text-only
conversations, one 144-token row per micro-batch (1 process, GA=2: micro-batches 1, 2, 4 and 7 hold no image, 5's
image crosses the sequence-parallel shard edge at token 72, 6 has one image per half). Against that 1-process job,
within 1e-5 (losses and grad norms):
  zero2   2 ranks, EP=2 + ZeRO-2 (at step 2 rank 0's row has no image, rank 1's has: the idle tower)
  zero3   2 ranks, EP=2 + ZeRO-3: the tower partitioned like the text model (training/parallel/construct.py)
  sp2     2 ranks, parallel=sp2 (the tower on all the rows' images on both ranks, each rank scatters its slice's)
and `kill -9` of the zero3 job after step 3 + `checkpoint.resume=auto` reproduces its losses bitwise. `training.export`
of the zero3 run holds the trained tower (the 1-process run's, exported through zero_to_fp32); `frozen`, 2 steps of
the zero3 layout with train.freeze=[vision_tower,mm_projector], keeps no optimizer state for them and exports them
bitwise as initialised. The caption evaluation at the last step (training/eval/caption.py: rows dealt over the
data-parallel ranks, or each row split over the sequence-parallel pair) gives every layout the 1-process value."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from omegaconf import OmegaConf

from model import K3Config
from model.hf import VISION_PREFIXES, read_hf_state
from model.params import build_meta
from tests.distributed.conftest import must_succeed, run_training
from training.checkpoint import resolve_checkpoint
from training.checkpoint.safe_load import safe_torch_load
from training.parallel.construct import _vision_values
from training.tools.export import export_checkpoint

pytestmark = pytest.mark.distributed
STEPS, KILL_AT = 4, 3
VLM = [
    "experiment=vlm_smoke",
    "eval.tasks.0.n=8",  # its caption task, at the last step only (eval.every=100), on 8 held-out examples
    "logging.mode=disabled",
    "logging.every=1",
    f"train.steps={STEPS}",
    "train.micro_batch_size=1",
    "checkpoint.save_final=false",
    "data.shuffle_buffer=32",
    "data.sources=[{type: synthetic, path: captions, format: chat, size: 256},"
    " {type: jsonl, path: data/examples/chat_tiny.jsonl, format: chat}]",
]
# persistence threshold 0: every tower parameter is gathered collectively at each use (the tiny tower's tensors are
# all under DeepSpeed's 1e5 default, which would keep them gathered and hide a rank that skips the tower)
ZERO3 = [
    *VLM,
    "parallel=ep2",
    "deepspeed=zero3",
    "+deepspeed.extra.zero_optimization.stage3_param_persistence_threshold=0",
    "train.grad_accum=1",
    "checkpoint.every=2",
]
FROZEN = [o for o in ZERO3 if not o.startswith("train.steps=")] + [
    "train.steps=2",
    "train.freeze=[vision_tower,mm_projector]",
]
ONE = [o for o in VLM if o != "checkpoint.save_final=false"] + ["checkpoint.save_final=true", "train.grad_accum=2"]
JOBS = {
    "zero2": ([*VLM, "parallel=ep2", "deepspeed=zero2", "train.grad_accum=1"], 2, None),
    "zero3": (ZERO3, 2, None),
    "sp2": ([*VLM, "parallel=sp2", "train.grad_accum=2"], 2, None),
    "one": (ONE, 1, None),  # its final checkpoint: the reference weights of the export test
    "frozen": (FROZEN, 2, None),
    "killed": (ZERO3, 2, {"K3_FAULT_KILL_AT_STEP": str(KILL_AT)}),
}


@pytest.fixture(scope="module")
def vlm_runs(runs_root):
    """{job: run}: the JOBS in one wave, then the killed job resumed (`resumed`)."""
    with ThreadPoolExecutor(len(JOBS)) as pool:
        futs = {
            k: pool.submit(run_training, runs_root / f"vlm_{k}", o, nproc=n, env=env, launcher=n > 1)
            for k, (o, n, env) in JOBS.items()
        }
        out = {k: f.result() for k, f in futs.items()}
    for k, r in out.items():
        if k != "killed":
            must_succeed(r)
    out["resumed"] = must_succeed(run_training(runs_root / "vlm_killed", [*ZERO3, "checkpoint.resume=auto"]))
    return out


@pytest.mark.parametrize("layout", ["zero2", "zero3", "sp2"])
def test_two_ranks_reproduce_one_process(vlm_runs, layout):
    two, one = vlm_runs[layout], vlm_runs["one"]
    got, ref = two.losses(), one.losses()
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    norms = {int(r["step"]): r["grad_norm"] for r in one.metrics if "grad_norm" in r}
    for r in two.metrics:
        if "loss" in r:
            assert r["loss"] == pytest.approx(ref[r["step"]], rel=1e-5), r["step"]
            assert r["grad_norm"] == pytest.approx(norms[r["step"]], rel=1e-5), r["step"]


@pytest.mark.parametrize("layout", ["zero2", "zero3", "sp2"])
def test_caption_evaluation_at_two_ranks_is_the_one_process_value(vlm_runs, layout):
    def last(run) -> dict:
        return [r for r in run.metrics if "eval/caption/loss" in r][-1]

    got, ref = last(vlm_runs[layout]), last(vlm_runs["one"])
    assert got["step"] == ref["step"] == STEPS
    for k in ("eval/caption/loss", "eval/caption/loss_shuffled"):  # the weights agree within ~1e-5, as the losses
        assert got[k] == pytest.approx(ref[k], rel=1e-4), k


def test_kill_and_resume_auto_are_bitwise(vlm_runs):
    killed, resumed = vlm_runs["killed"], vlm_runs["resumed"]
    assert killed.returncode != 0 and max(killed.losses()) == KILL_AT  # it died right after step 3
    assert resumed.losses() == vlm_runs["zero3"].losses()  # every step, exact float equality


def test_metrics_count_images_and_their_token_fraction(vlm_runs):
    rec = [r for r in vlm_runs["zero2"].metrics if "loss" in r][-1]
    assert rec["data/images"] >= STEPS  # (1, 1, 1 and 2 images in the 4 steps' global batches)
    assert 0 < rec["data/image_token_fraction"] < 1


@pytest.fixture(scope="module")
def exported(vlm_runs, tmp_path_factory):
    """job -> {name: tensor} of `training.export` of its newest checkpoint (release names), each exported once."""
    done: dict[str, dict[str, torch.Tensor]] = {}

    def get(job: str) -> dict[str, torch.Tensor]:
        if job not in done:
            out = export_checkpoint(str(vlm_runs[job].run_dir), str(tmp_path_factory.mktemp(f"export_{job}")))
            done[job] = {k: v for k, v in read_hf_state(out, vision=True).items() if k.startswith(VISION_PREFIXES)}
        return done[job]

    return get


def test_zero3_export_holds_the_trained_vision_weights(exported):
    got, ref = exported("zero3"), exported("one")  # both after step 4; the reference through zero_to_fp32
    assert ref and sorted(got) == sorted(ref)
    for k, t in ref.items():
        torch.testing.assert_close(got[k], t, rtol=0, atol=1e-5, msg=k)


def vision_init(run, params_only: bool = False) -> dict[str, torch.Tensor]:
    """The seed-initialised tower + projector of `run` (training/parallel/construct.py, same for every layout)."""
    config = K3Config.from_hf_config(resolve_checkpoint(str(run)))
    seed = int(OmegaConf.load(run / "config.yaml").train.seed)
    model = _vision_values(build_meta(config), config, seed, None)
    state = dict(model.named_parameters()) if params_only else model.state_dict()
    return {k: v for k, v in state.items() if k.startswith(VISION_PREFIXES)}


def test_frozen_zero3_tower_has_no_optimizer_state(vlm_runs):
    run = vlm_runs["frozen"].run_dir
    states = safe_torch_load(f"{resolve_checkpoint(str(run))}/zero_pp_rank_0_mp_rank_00_model_states.pt")
    managed = {k for group in states["param_shapes"] for k in group}  # what the ZeRO-3 optimizer partitions
    assert managed and not any(k.startswith(VISION_PREFIXES) for k in managed)
    assert sorted(states["frozen_param_shapes"]) == sorted(vision_init(run, params_only=True))


def test_frozen_zero3_tower_exports_bitwise_as_initialised(vlm_runs, exported):
    init, got = vision_init(vlm_runs["frozen"].run_dir), exported("frozen")
    assert init and sorted(got) == sorted(init)
    for k, t in got.items():
        assert torch.equal(t, init[k]), k

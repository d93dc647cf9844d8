"""RunLogger: metrics.jsonl contract, offline W&B run contents, resume, heatmap key cap, secrets, rank gating."""

from __future__ import annotations

import json
import re

import pytest
import torch

from training.metrics import RunLogger, router_metrics
from training.metrics.sinks import (
    read_jsonl,
    read_wandb_offline_history,
    read_wandb_offline_run,
    read_wandb_offline_summary,
    scrub_secrets,
)

REQUIRED = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu")


def _step_metrics(step: int, counts: torch.Tensor) -> dict:
    return {
        "loss": 5.0 / step,
        "lr": 1e-3,
        "grad_norm": 0.5,
        "tokens_per_s": 1234.0,
        "mfu": 0.01,
        **router_metrics(counts, torch.zeros(counts.shape), list(range(1, counts.shape[0] + 1))),
    }


def _log_steps(logger: RunLogger, steps, counts):
    for s in steps:
        logger.log(s, _step_metrics(s, counts))
        logger.log_heatmap(s, counts)


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory):
    """Two offline sessions in one run dir: steps 1..4, then a resume logging 3..6 (re-logged after a kill)."""
    run_dir = tmp_path_factory.mktemp("run")
    counts = torch.randint(0, 20, (3, 8))
    cfg = {"model": {"preset": "tiny"}, "wandb": {"api_key": "cfg-secret-123"}, "logging": {"group": "runs/sweep/lr"}}
    with RunLogger(run_dir, cfg, "offline", "k3-test", None, 6, True, 2, False, progress=False) as lg:
        _log_steps(lg, range(1, 5), counts)
        first_id = lg.run_id
    with RunLogger(run_dir, cfg, "offline", "k3-test", None, 6, True, 2, True, progress=False) as lg:
        _log_steps(lg, range(3, 7), counts)
        second_id = lg.run_id
    return run_dir, first_id, second_id


def test_metrics_jsonl_has_one_record_per_logged_step_with_required_keys(offline_run):
    run_dir, _, _ = offline_run
    recs = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 3, 4, 5, 6]  # resume appends
    for r in recs:
        assert all(k in r for k in REQUIRED)
        assert {"router/maxvio", "router/load_cv", "router/dead_frac", "router/layer1/maxvio"} <= set(r)


def test_resume_continues_the_same_wandb_run(offline_run):
    run_dir, first_id, second_id = offline_run
    assert first_id == second_id
    assert (run_dir / "wandb_run_id").read_text().strip() == first_id
    # every offline run directory belongs to the one run id: W&B names them offline-run-<YYYYmmdd_HHMMSS>-<id>,
    # adding -<n> when the resumed session starts within the same second
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert runs and all(re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{first_id}(-\d+)?", p.name) for p in runs), runs


def test_offline_wandb_run_contains_router_metrics(offline_run):
    run_dir, _, _ = offline_run
    rows = [r for r in read_wandb_offline_history(run_dir) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 3, 4, 5, 6]
    assert rows[0]["router/maxvio"] == pytest.approx(read_jsonl(run_dir / "metrics.jsonl")[0]["router/maxvio"])
    assert "router/layer3/dead_frac" in rows[-1]


def test_the_run_configs_logging_group_is_the_wandb_group(offline_run):
    run_dir, first_id, _ = offline_run
    assert read_wandb_offline_run(run_dir) == {
        "id": first_id,
        "project": "k3-test",
        "group": "runs/sweep/lr",
        "name": "",
    }


def test_heatmap_every_n_steps_full_resolution_in_jsonl(offline_run):
    run_dir, _, _ = offline_run
    loads = read_jsonl(run_dir / "expert_load.jsonl")
    assert [r["step"] for r in loads] == [1, 3, 3, 5]
    assert len(loads[0]["expert_load"]) == 3 and len(loads[0]["expert_load"][0]) == 8


def test_secrets_never_reach_the_run_dir(offline_run):
    run_dir, _, _ = offline_run
    for f in run_dir.rglob("*"):
        if f.is_file():
            assert b"cfg-secret-123" not in f.read_bytes(), f


def test_scrub_secrets_keeps_ordinary_keys():
    out = scrub_secrets(
        {
            "wandb_api_key": "x",
            "tokenizer": "t.model",
            "tokens_per_s": 3,
            "nested": [{"password": 1}],
            "secret": {"inner": "y"},
        }
    )
    assert out == {
        "wandb_api_key": "<redacted>",
        "tokenizer": "t.model",
        "tokens_per_s": 3,
        "nested": [{"password": "<redacted>"}],
        "secret": {"inner": "y"},
    }


def test_heatmap_at_k3_scale_is_one_capped_image_not_82k_keys(tmp_path):
    counts = torch.randint(0, 50, (92, 896))
    with RunLogger(tmp_path, {}, "offline", "k3-test", None, 1, True, 1, False, progress=False) as lg:
        assert lg.log_heatmap(10, counts, layer_ids=list(range(1, 93)))
    assert read_wandb_offline_run(tmp_path)["group"] is None  # no logging.group: no W&B group
    rows = [r for r in read_wandb_offline_history(tmp_path) if "router/expert_load_heatmap" in r]
    assert len(rows) == 1 and len([k for k in rows[0] if not k.startswith("_")]) <= 3
    img = rows[0]["router/expert_load_heatmap"]
    assert img["width"] <= 128 * 4 and img["height"] == 92 * 4
    rec = read_jsonl(tmp_path / "expert_load.jsonl")[0]
    assert rec["layer_ids"][0] == 1 and torch.equal(torch.tensor(rec["expert_load"]), counts)


def test_disabled_mode_writes_jsonl_and_summary_but_no_wandb(tmp_path, capsys):
    with RunLogger(tmp_path, {}, "disabled", "p", None, 2, True, 0, False, progress=False) as lg:
        lg.log(1, {"loss": 2.0})
        assert not lg.log_heatmap(1, torch.ones(1, 4))  # heatmap_every=0 disables
        line = lg.summary({"final_loss": 2.0, "steps": 1})
    assert not (tmp_path / "wandb").exists() and lg.run_id is None
    assert line.startswith("summary: ") and line in capsys.readouterr().out
    assert json.loads((tmp_path / "summary.json").read_text()) == {"final_loss": 2.0, "steps": 1}


def test_fresh_run_truncates_and_nan_becomes_null(tmp_path):
    for _ in range(2):
        with RunLogger(tmp_path, {}, "disabled", "p", None, 2, True, 0, False, progress=False) as lg:
            lg.log(1, {"loss": float("nan"), "grad_norm": torch.tensor(1.5)})
    recs = read_jsonl(tmp_path / "metrics.jsonl")
    assert len(recs) == 1 and recs[0]["loss"] is None and recs[0]["grad_norm"] == 1.5


def test_non_main_rank_writes_nothing(tmp_path):
    with RunLogger(tmp_path / "r1", {}, "offline", "p", "abc", 2, False, 1, False, progress=False) as lg:
        lg.log(1, {"loss": 1.0})
        assert not lg.log_heatmap(1, torch.ones(2, 2))
        assert lg.summary({"x": 1}) == ""
        assert lg.run_id == "abc"
    assert not (tmp_path / "r1").exists()


def test_bad_mode_is_a_one_line_error(tmp_path):
    with pytest.raises(ValueError, match="logging.mode=offline"):
        RunLogger(tmp_path, {}, "onlin", "p", None, 1, True, 1, False)


def test_the_wandb_summary_keeps_each_eval_metrics_best_value(tmp_path):
    """log_eval's goals: the W&B summary holds the lowest loss and the highest accuracy seen, not the last."""
    goals = {"eval/heldout/loss": "min", "eval/mc/acc": "max"}
    with RunLogger(tmp_path, {}, "offline", "k3-test", None, 6, True, 0, False, progress=False) as lg:
        for step, loss, acc in [(2, 5.0, 0.25), (4, 4.0, 0.5), (6, 4.5, 0.375)]:
            lg.log_eval(step, {"eval/heldout/loss": loss, "eval/mc/acc": acc, "eval/time_s": 0.1}, goals)
    summary = read_wandb_offline_summary(tmp_path)
    assert summary["eval/heldout/loss"] == {"min": 4.0} and summary["eval/mc/acc"] == {"max": 0.5}
    assert [r["eval/heldout/loss"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [5.0, 4.0, 4.5]

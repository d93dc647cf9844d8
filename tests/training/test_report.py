"""Offline report: renders every plot from a run directory's JSONL logs, without W&B."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from training.metrics import RunLogger, router_metrics
from training.metrics.router import bucket_experts
from training.tools.report import build_report, dedupe_by_step, main, pick_steps

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory):
    """A 40-step run logged through the real RunLogger (W&B disabled), killed and resumed at step 30."""
    run_dir = tmp_path_factory.mktemp("run")
    g = torch.Generator().manual_seed(0)
    layer_ids = [1, 2, 3, 5]

    def session(steps, resume):
        with RunLogger(run_dir, {}, "disabled", "p", None, 40, True, 10, resume, progress=False) as lg:
            for s in steps:
                skew = torch.linspace(1.0, 1.0 + 4.0 / s, 16)
                counts = (torch.rand(4, 16, generator=g) * 100 * skew).round()
                counts[0, 0] = 0
                lg.log(
                    s,
                    {
                        "loss": 6.0 * math.exp(-s / 20),
                        "lr": 1e-3,
                        "grad_norm": 1.0 / s,
                        "tokens_per_s": 1000.0 + s,
                        "mfu": 0.02,
                        **router_metrics(counts, None, layer_ids),
                    },
                )
                lg.log_heatmap(s, counts, layer_ids)

    session(range(1, 35), False)
    session(range(31, 41), True)  # the resume re-logs 31..34
    return run_dir


def test_report_renders_every_plot_and_an_index(synthetic_run, tmp_path):
    files = build_report(synthetic_run, tmp_path / "rep")
    names = {p.name for p in files.values()}
    for expected in (
        "loss.png",
        "lr.png",
        "grad_norm.png",
        "tokens_per_s.png",
        "mfu.png",
        "router_maxvio.png",
        "router_load_cv.png",
        "router_dead_frac.png",
        "index.html",
    ):
        assert expected in names
    heat = sorted(n for n in names if n.startswith("expert_load_step"))
    assert heat == ["expert_load_step1.png", "expert_load_step21.png", "expert_load_step31.png"]
    for p in files.values():
        if p.suffix == ".png":
            assert p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 2000
    index = files["index"].read_text()
    assert all(f'src="{p.name}"' in index for p in files.values() if p.suffix == ".png")


def test_cli_writes_report_next_to_the_run(synthetic_run):
    r = subprocess.run(
        [sys.executable, "-m", "training.report", str(synthetic_run), "steps=12"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert (synthetic_run / "report" / "index.html").is_file()
    assert (synthetic_run / "report" / "expert_load_step11.png").is_file()  # nearest logged step


def test_missing_metrics_is_a_one_line_error(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "metrics.jsonl not found" in err and len(err.splitlines()) == 1


def test_resumed_steps_keep_the_last_written_record():
    recs = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}, {"step": 2, "loss": 1.5}, {"step": 3, "loss": 1.0}]
    assert [r["loss"] for r in dedupe_by_step(recs)] == [3.0, 1.5, 1.0]


def test_heatmap_steps_snap_to_logged_steps():
    assert pick_steps([10, 20, 30, 40], None) == [10, 30, 40]
    assert pick_steps([10, 20, 30], [14, 16, 1000]) == [10, 20, 30]
    assert pick_steps([], [5]) == []


def test_heatmap_columns_are_capped_for_k3_width():
    assert bucket_experts(torch.ones(92, 896), 256).shape == (92, 224)


def test_report_renders_a_real_training_run(real_run, tmp_path):
    files = build_report(real_run, tmp_path / "rep")
    names = {p.name for p in files.values()}
    assert {
        "loss.png",
        "lr.png",
        "grad_norm.png",
        "tokens_per_s.png",
        "mfu.png",
        "router_maxvio.png",
        "router_dead_frac.png",
        "index.html",
    } <= names
    assert any(n.startswith("expert_load_step") for n in names)

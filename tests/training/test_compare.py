"""Runs side by side (`python -m training.report runs/a runs/b ...`): one self-contained HTML page with the runs'
curves against tokens, their final and best metrics and the config keys that differ. Synthetic runs are written as
the trainer and the evaluator write them (metrics.jsonl with eval records of their own at training steps,
config.yaml, summary.json); one case reads a real training run."""

from __future__ import annotations

import base64
import json
import math
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

from training.tools.compare import build_comparison, default_out, table_keys
from training.tools.report import build_report, main
from training.tools.runs import differing_keys, direction, find_runs, flatten, load_run, merge_by_step

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(path: Path, lr: float, rows: int = 4, steps: int = 40, every: int = 10, tokens: bool = True) -> Path:
    """A run as training.train and the evaluator leave it: training records every step, eval records (held-out
    loss set, a choice task, passkey) every `every` steps as records of their own at that step."""
    path.mkdir(parents=True)
    seq = 64
    cfg = {
        "name": "tiny_ci",
        "run_dir": str(path),
        "optim": {"lr": lr, "betas": [0.9, 0.95]},
        "train": {"steps": steps, "seq_len": seq, "micro_batch_size": rows, "grad_accum": 1},
        "eval": {"every": every, "sets": []},
    }
    (path / "config.yaml").write_text(yaml.safe_dump(cfg))
    lines = []
    for s in range(1, steps + 1):
        rec = {"step": s, "time": 1.0e9 + s, "loss": 8.0 * math.exp(-lr * 30 * s / steps) + 0.05 * (s % 3)}
        rec |= {"tokens_per_s": 1000.0 + s, "mfu": 0.01, "router/maxvio": 1.0 / s, "router/load_cv": 0.1}
        rec |= {"router/dead_frac": 0.0, "router/layer1/maxvio": 1.0 / s}
        if tokens:
            rec |= {"tokens": rows * seq, "tokens_seen": rows * seq * s}
        lines.append(rec)
        if s % every == 0:
            ev = {"step": s, "time": 1.0e9 + s + 0.5, "tokens_seen": rows * seq * s}
            ev |= {"eval/heldout/loss": 7.0 - lr * 100 * s / steps, "eval/heldout/ppl": 1000.0 / s}
            ev |= {"eval/heldout/bpb": 3.0 - s / 100, "eval/heldout/time_s": 0.2}
            ev |= {"eval/heldout/loss_pos/0-32": 7.5 - s / 20, "eval/heldout/loss_pos/32-64": 7.0 - s / 10}
            ev |= {"eval/code_choice/acc": 0.25 + lr * 5 * min(s, 40 - s) / steps, "eval/code_choice/acc_norm": 0.3}
            ev |= {"eval/passkey/acc@256": min(1.0, s / steps), "eval/passkey/acc@1024": 0.1}
            lines.append(ev if tokens else {k: v for k, v in ev.items() if k != "tokens_seen"})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    if not tokens:
        (path / "summary.json").write_text(json.dumps({"steps": steps, "tokens_seen": rows * seq * steps}))
    return path


class Page(HTMLParser):
    """What a browser would load: every src/href, every element name, the text of the table cells."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.refs, self.tags, self.cells = [], [], []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.refs += [v for k, v in attrs if k in ("src", "href")]

    def handle_data(self, data):
        if self.tags and self.tags[-1] in ("td", "th", "small", "br"):
            self.cells.append(data)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cmp") / "runs"
    return write_run(root / "lr-0.1", 0.1), write_run(root / "lr-0.03", 0.03, rows=8)


@pytest.fixture(scope="module")
def page(two_runs):
    """The page of the two runs' folder, written once for the tests that read it: (its path, its text)."""
    path, runs = build_comparison([two_runs[0].parent])
    assert [r.name for r in runs] == ["lr-0.03", "lr-0.1"]
    return path, path.read_text()


def test_page_is_one_self_contained_file(page, two_runs):
    path, text = page
    assert sorted(p.name for p in path.parent.iterdir()) == ["compare.html", "lr-0.03", "lr-0.1"]  # nothing beside
    doc = Page(text)
    assert doc.refs and all(r.startswith("data:image/png;base64,") for r in doc.refs)  # no file, no URL
    assert not {"script", "link", "iframe"} & set(doc.tags)
    for r in doc.refs:
        png = base64.b64decode(r.split(",", 1)[1])
        assert png[:8] == PNG_MAGIC and len(png) > 3000


def test_page_shows_every_curve_family(page):
    text = page[1]
    for caption in (
        "training loss",
        "eval/heldout",
        "eval/heldout: loss by position",
        "eval/code_choice",
        "eval/passkey",
        "router health (mean over MoE layers)",
        "throughput",
    ):
        assert f"<figcaption>{caption}</figcaption>" in text


def test_table_has_final_and_best_with_the_metric_direction(page, two_runs):
    cells = Page(page[1]).cells
    # lr 0.1 reaches held-out loss 7.0 - 10 = -3.0 at step 40; lr 0.03 reaches 7.0 - 3 = 4.0: the first wins
    assert "eval/heldout/loss (lower is better)" in cells and "eval/code_choice/acc (higher is better)" in cells
    assert "best -3 @ step 40 ★" in cells and "best 4 @ step 40" in cells
    # accuracy: higher is better; lr 0.1 peaks at 0.25 + 0.5 x 20/40 = 0.5 at step 20, then falls back to 0.25
    assert "best 0.5 @ step 20 ★" in cells and "best 0.325 @ step 20" in cells
    assert "eval/passkey/acc@256 (higher is better)" in cells
    assert "tokens_per_s" in cells and "router/maxvio" in cells  # final only: no side is better
    # the training loss is noisy: its best is not its final (8 exp(-3 s/40) + 0.05 (s mod 3))
    run = load_run(two_runs[0])
    assert run.best("loss") != run.final("loss") and run.best("loss")[1] == 39


def test_differing_config_keys_only(page):
    cells = Page(page[1]).cells
    assert "optim.lr" in cells and "train.micro_batch_size" in cells
    assert "train.seq_len" not in cells and "optim.betas" not in cells  # equal in both runs
    assert "run_dir" not in cells  # always differs, says nothing


def test_runs_line_up_on_tokens_not_steps(two_runs):
    a, b = (load_run(p) for p in two_runs)
    assert a.series("eval/heldout/loss")[0].tolist() == [2560.0, 5120.0, 7680.0, 10240.0]  # 4 rows x 64 x step
    assert b.series("eval/heldout/loss")[0].tolist() == [5120.0, 10240.0, 15360.0, 20480.0]  # 8 rows


def test_eval_record_at_a_training_step_merges_into_it(two_runs):
    rec = {r["step"]: r for r in load_run(two_runs[0]).records}[10]
    assert "loss" in rec and "eval/heldout/loss" in rec and "tokens_per_s" in rec


def test_tokens_derived_from_the_summary_when_records_lack_them(tmp_path):
    run = load_run(write_run(tmp_path / "old", 0.1, tokens=False))
    assert run.series("eval/heldout/loss")[0].tolist() == [2560.0, 5120.0, 7680.0, 10240.0]
    assert "summary.json" in run.tokens_note


def test_folder_of_runs_expands_and_default_page_lands_in_it(page, two_runs):
    root = two_runs[0].parent
    assert find_runs([root]) == sorted(two_runs)
    assert page[0] == root / "compare.html"  # a folder given: inside it
    assert default_out(list(two_runs)) == root / "compare.html"  # run dirs given: their common folder


def test_bad_input_is_one_line(two_runs, tmp_path, capsys):
    assert main([str(two_runs[0]), str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err.strip()
    assert "metrics.jsonl not found" in err and len(err.splitlines()) == 1
    assert main([str(two_runs[0]), str(two_runs[1]), "steps=5"]) == 2
    assert "single run" in capsys.readouterr().err


def test_metric_directions():
    assert [direction(k) for k in ("loss", "eval/a/loss", "eval/a/ppl", "eval/a/bpb", "eval/a/loss_pos/0-64")] == [
        "min"
    ] * 5
    assert {direction(k) for k in ("eval/t/acc", "eval/t/acc_norm", "eval/p/acc@256", "eval/p/logprob@1024")} == {"max"}
    assert direction("eval/a/time_s") is None and direction("tokens_per_s") is None and direction("lr") is None


def test_merge_keeps_the_last_written_value_of_each_key():
    recs = [{"step": 2, "loss": 2.0, "lr": 1.0}, {"step": 2, "eval/a/loss": 3.0}, {"step": 2, "loss": 1.5}]
    assert merge_by_step(recs) == [{"step": 2, "loss": 1.5, "lr": 1.0, "eval/a/loss": 3.0}]


def test_flatten_and_differing_keys():
    a = flatten({"optim": {"lr": 1e-3, "betas": [0.9, 0.95]}, "extra": {}, "x": None})
    assert a == {"optim.lr": 1e-3, "optim.betas": [0.9, 0.95], "extra": {}, "x": None}
    b = {**a, "optim.lr": 3e-3, "new": 1}
    assert differing_keys([a, b]) == ["new", "optim.lr"]


def test_real_runs_side_by_side(real_run, two_runs, tmp_path):
    page, runs = build_comparison([real_run, two_runs[0]], tmp_path / "cmp.html")
    assert [r.records[-1]["tokens"] for r in runs] == [512.0, 10240.0]  # tiny_ci: 4 steps x 2 rows x 64 tokens
    text = page.read_text()
    assert "<figcaption>router health (mean over MoE layers)</figcaption>" in text
    assert "model.hidden_size" in Page(text).cells  # in the real run's config only: it differs


def test_single_run_report_plots_its_evals(two_runs, tmp_path):
    names = {p.name for p in build_report(two_runs[0], tmp_path / "rep").values()}
    assert {"eval_heldout.png", "eval_code_choice.png", "eval_passkey.png", "loss.png", "index.html"} <= names
    assert "eval_heldout_loss_by_position.png" in names


def test_table_lists_eval_metrics_with_a_side(two_runs):
    keys = table_keys([load_run(p) for p in two_runs])
    assert keys[:2] == ["loss", "eval/code_choice/acc"] and "eval/heldout/time_s" in keys

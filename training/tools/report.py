"""Offline run report: `python -m training.report <run_dir> [out=DIR] [steps=100,500]`; with several run dirs
(or a folder of runs, e.g. a sweep's) `python -m training.report runs/a runs/b ... [out=FILE.html]` puts them on
one self-contained page (training/tools/compare.py).

Why: a run must be readable without W&B (air-gapped clusters, CI artefacts), even without torch (numpy and
matplotlib only). Reads the run's own `metrics.jsonl` / `expert_load.jsonl` (written by RunLogger) and writes
PNGs plus an `index.html` that shows them: loss, lr, grad norm, tokens/s, MFU, router health per layer over
time, every eval set's loss and eval task's accuracies, and expert-load heatmaps (layers x experts) at chosen steps.
"""

from __future__ import annotations

import html
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.ticker
import numpy as np
from matplotlib.figure import Figure  # object API: renders with Agg, sets no global backend

from training.metrics.router import bucket_experts
from training.metrics.sinks import read_jsonl
from training.tools.cli import ToolError, parse_args, run_tool
from training.tools.runs import merge_by_step

SCALARS = (
    ("loss", "loss"),
    ("lr", "learning rate"),
    ("grad_norm", "gradient norm"),
    ("tokens_per_s", "tokens / s"),
    ("mfu", "MFU"),
)
ROUTER = (
    ("maxvio", "MaxVio (max load / mean load - 1)"),
    ("load_cv", "load CV"),
    ("dead_frac", "dead-expert fraction"),
)
_LAYER_KEY = re.compile(r"^router/layer(\d+)/(\w+)$")


def dedupe_by_step(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per step, the LAST written value of each key wins (a resumed run re-logs the steps after its
    checkpoint); an eval record logged at a training step merges into it (training/tools/runs.py)."""
    return merge_by_step(records)


def series(records: Sequence[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    if not pts:
        return np.zeros(0), np.zeros(0)
    s, v = zip(*pts)
    return np.asarray(s, dtype=np.float64), np.asarray(v, dtype=np.float64)


def _subplots(figsize: tuple[float, float]):
    fig = Figure(figsize=figsize)
    return fig, fig.add_subplot()


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def plot_scalar(records, key: str, label: str, out: Path) -> Path | None:
    s, v = series(records, key)
    if not len(s):
        return None
    fig, ax = _subplots((6, 3.5))
    ax.plot(s, v, lw=1.2)
    if key == "loss" and len(v) > 10:  # a smoothed trend on top of the raw curve
        w = max(2, len(v) // 20)
        ax.plot(s[w - 1 :], np.convolve(v, np.ones(w) / w, mode="valid"), lw=2, label=f"mean of {w}")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    return _save(fig, out / f"{key}.png")


def router_layers(records) -> list[int]:
    ids = {int(m.group(1)) for r in records for k in r if (m := _LAYER_KEY.match(k))}
    return sorted(ids)


def plot_router(records, name: str, label: str, out: Path) -> Path | None:
    """Per-layer curves (thin, coloured by depth) plus the cross-layer mean (thick black)."""
    layers = router_layers(records)
    s_mean, v_mean = series(records, f"router/{name}")
    if not layers and not len(s_mean):
        return None
    fig, ax = _subplots((6, 3.5))
    cmap = matplotlib.colormaps["viridis"]
    for j, lid in enumerate(layers):
        s, v = series(records, f"router/layer{lid}/{name}")
        ax.plot(
            s,
            v,
            lw=0.8,
            alpha=0.7,
            color=cmap(j / max(1, len(layers) - 1)),
            label=f"layer {lid}" if len(layers) <= 8 else None,
        )
    if len(s_mean):
        ax.plot(s_mean, v_mean, lw=2.2, color="black", label="mean over layers")
    ax.set_xlabel("step")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, out / f"router_{name}.png")


def plot_evals(run_dir: Path, out: Path) -> list[tuple[str, Path]]:
    """Every eval set's loss / bpb and eval task's accuracies against tokens, and the loss by position at the last
    evaluation: the multi-run page's eval plots for this one run (training/tools/compare.py)."""
    from training.tools.compare import figures
    from training.tools.runs import load_run

    made = []
    for title, fig in figures([load_run(run_dir)]):
        if title.startswith("eval/"):
            name = re.sub(r"[^A-Za-z0-9._-]+", "_", title.removeprefix("eval/")).strip("_")
            made.append((title, _save(fig, out / f"eval_{name}.png")))
    return made


def pick_steps(available: Sequence[int], wanted: Sequence[int] | None) -> list[int]:
    """Wanted steps snapped to the nearest logged heatmap step; default first, middle and last."""
    if not available:
        return []
    avail = sorted(available)
    if not wanted:
        wanted = [avail[0], avail[len(avail) // 2], avail[-1]]
    return sorted({min(avail, key=lambda a: (abs(a - w), a)) for w in wanted})


def plot_heatmap(rec: dict[str, Any], out: Path, max_columns: int = 256) -> Path:
    """Load / layer-mean on a log2 scale (white = balanced, red = hot, blue = cold); dead experts black."""
    counts_LE = np.asarray(rec["expert_load"], dtype=np.float64)
    c_LB = bucket_experts(counts_LE, max_columns)
    mean = c_LB.mean(axis=1, keepdims=True)
    ratio = np.divide(c_LB, mean, out=np.zeros_like(c_LB), where=mean > 0)
    img = np.log2(np.where(ratio > 0, ratio, np.nan))
    L, B = c_LB.shape
    fig, ax = _subplots((min(14, max(6, 3 + B / 16)), min(12, max(3, 1.5 + L / 6))))
    ax.set_facecolor("black")
    im = ax.imshow(img, aspect="auto", cmap="coolwarm", vmin=-2, vmax=2, interpolation="nearest")
    ids = rec.get("layer_ids") or list(range(L))
    tick = max(1, L // 12)
    ax.set_yticks(range(0, L, tick), [str(ids[i]) for i in range(0, L, tick)])
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    per = -(-counts_LE.shape[1] // B)
    ax.set_xlabel(f"expert{'' if per == 1 else f' bucket ({per} experts each)'}")
    ax.set_ylabel("MoE layer")
    ax.set_title(f"expert load, step {rec['step']} (black = dead)")
    fig.colorbar(im, ax=ax, label="log2(load / layer mean)")
    return _save(fig, out / f"expert_load_step{rec['step']}.png")


def _last_values(records) -> dict[str, Any]:
    keys = [
        "step",
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "mfu",
        "router/maxvio",
        "router/load_cv",
        "router/dead_frac",
    ]
    last = records[-1] if records else {}
    return {k: last[k] for k in keys if k in last}


def write_index(out: Path, run_dir: Path, images: list[tuple[str, Path]], table: dict[str, Any]) -> Path:
    rows = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{html.escape(f'{v:.6g}' if isinstance(v, float) else str(v))}</td></tr>"
        for k, v in table.items()
    )
    figs = "".join(
        f'<figure><img src="{html.escape(p.name)}" alt="{html.escape(t)}"><figcaption>'
        f"{html.escape(t)}</figcaption></figure>"
        for t, p in images
    )
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>k3-train report: {html.escape(run_dir.name)}"
        "</title><style>body{font-family:sans-serif;margin:2em}figure{display:inline-block;margin:.5em}"
        "img{max-width:640px}td{padding:0 1em}</style></head><body>"
        f"<h1>Run {html.escape(str(run_dir))}</h1><table>{rows}</table>{figs}</body></html>\n"
    )
    path = out / "index.html"
    path.write_text(page, encoding="utf-8")
    return path


def build_report(
    run_dir: str | Path, out: str | Path | None = None, heatmap_steps: Sequence[int] | None = None
) -> dict[str, Path]:
    """Render every plot the run's logs allow; returns {title: path} including 'index'."""
    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise FileNotFoundError(f"{metrics_path} not found; pass a run directory written by training.train")
    out = Path(out) if out is not None else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    records = dedupe_by_step(read_jsonl(metrics_path))
    images: list[tuple[str, Path]] = []
    for key, label in SCALARS:
        if (p := plot_scalar(records, key, label, out)) is not None:
            images.append((label, p))
    for name, label in ROUTER:
        if (p := plot_router(records, name, label, out)) is not None:
            images.append((f"router {label}", p))
    images += plot_evals(run_dir, out)
    loads_path = run_dir / "expert_load.jsonl"
    if loads_path.is_file():
        loads = {r["step"]: r for r in dedupe_by_step(read_jsonl(loads_path))}
        for s in pick_steps(list(loads), heatmap_steps):
            images.append((f"expert load, step {s}", plot_heatmap(loads[s], out)))
    table = _last_values(records)
    summary = run_dir / "summary.json"
    if summary.is_file():
        table.update({f"summary/{k}": v for k, v in json.loads(summary.read_text()).items()})
    index = write_index(out, run_dir, images, table)
    return {**dict(images), "index": index}


def _main(argv: list[str]) -> int:
    dirs = [x for x in argv if "=" not in x]  # run dirs (one: this report; several, or a folder of runs: compare)
    a = parse_args(
        [x for x in argv if "=" in x],
        {"run_dir": None, "out": None, "steps": None},
        kinds={"run_dir": str, "out": str, "steps": str},
    )
    dirs += [a["run_dir"]] if a["run_dir"] else []
    if not dirs:
        raise ToolError("run_dir=<...> is required (or give one or more run directories as arguments)")
    if len(dirs) > 1 or (Path(dirs[0]).is_dir() and not (Path(dirs[0]) / "metrics.jsonl").is_file()):
        if a["steps"]:
            raise ToolError("steps= picks one run's heatmap steps; give a single run directory with it")
        from training.tools.compare import build_comparison

        page, runs = build_comparison(dirs, a["out"])
        print(f"wrote {page} ({len(runs)} runs: {', '.join(r.name for r in runs)})")
        return 0
    steps = [int(x) for x in a["steps"].split(",") if x] if a["steps"] else None
    files = build_report(dirs[0], a["out"], steps)
    print(f"wrote {len(files) - 1} plots and {files['index']}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_tool(_main, argv, __doc__ or "")


if __name__ == "__main__":
    sys.exit(main())

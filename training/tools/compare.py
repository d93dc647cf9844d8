"""Several runs on one page: `python -m training.report runs/a runs/b ... [out=FILE.html]`.

Why: a sweep or an ablation is judged side by side, on the tokens each run has trained (runs with other batch sizes
line up), offline and without W&B. One self-contained HTML file (every plot a PNG inlined as a base64 data URI, no
external CSS or JS), so it can be mailed, attached to CI or opened on an air-gapped machine. It shows: training
loss, every eval set's loss / bits per byte and every eval task's accuracies against tokens, the loss by token
position at the last evaluation, router health (MaxVio, load CV, dead-expert fraction; mean over MoE layers) and
throughput (tokens/s, MFU); a table of each metric's final and best value per run; the config keys whose values
differ between the runs (from each run's resolved `config.yaml`).
"""

from __future__ import annotations

import base64
import html
import io
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.colors
import matplotlib.ticker
import numpy as np
from matplotlib.figure import Figure  # object API: renders with Agg, sets no global backend

from training.tools.runs import Run, differing_keys, direction, find_runs, load_run, short_names

DEFAULT_NAME = "compare.html"
ROUTER = (("router/maxvio", "MaxVio"), ("router/load_cv", "load CV"), ("router/dead_frac", "dead-expert fraction"))
THROUGHPUT = (("tokens_per_s", "tokens / s"), ("mfu", "MFU"))
FINAL_ONLY = ("tokens_per_s", "mfu", "router/maxvio", "router/load_cv", "router/dead_frac", "lr", "grad_norm")


def colours(n: int) -> list[tuple[float, ...]]:
    cmap = matplotlib.colormaps["tab10" if n <= 10 else "tab20" if n <= 20 else "viridis"]
    return [cmap(i if n <= 20 else i / max(1, n - 1)) for i in range(n)]


def png_data_uri(fig: Figure) -> str:
    """The figure as a PNG inlined in a `data:` URI (no file beside the page)."""
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _panels(n: int) -> tuple[Figure, list[Any]]:
    cols = min(n, 3)
    rows = -(-n // cols)
    fig = Figure(figsize=(4.6 * cols, 3.3 * rows))
    return fig, [fig.add_subplot(rows, cols, i + 1) for i in range(n)]


def _tokens_axis(ax: Any) -> None:
    ax.set_xlabel("tokens")
    ax.xaxis.set_major_formatter(matplotlib.ticker.EngFormatter(sep=""))
    ax.grid(alpha=0.3)


def plot_metrics(runs: Sequence[Run], metrics: Sequence[tuple[str, str]], cols: Sequence[Any]) -> Figure | None:
    """One panel per (key, label), one line per run against tokens; None when no run logged any of the keys."""
    metrics = [(k, lab) for k, lab in metrics if any(len(r.series(k)[0]) for r in runs)]
    if not metrics:
        return None
    fig, axes = _panels(len(metrics))
    for ax, (key, label) in zip(axes, metrics):
        for run, c in zip(runs, cols):
            x, y = run.series(key)
            if not len(x):
                continue
            few = len(x) <= 12  # evaluations: a few points, each one matters
            trend = _trend(run, x, y) if key == "loss" and len(x) > 1 else None
            style = {"lw": 0.8, "alpha": 0.35} if trend else {"lw": 1.4, "label": run.name}
            ax.plot(x, y, color=c, marker="o" if few else None, ms=3, **style)
            if trend:  # the noisy per-step loss thin, its trend bold
                ax.plot(*trend, lw=1.8, color=c, label=run.name)
        ax.set_ylabel(label)
        ax.set_title(label, fontsize=10)
        _tokens_axis(ax)
        ax.legend(fontsize=7)
    return fig


def _trend(run: Run, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """The training loss's trend: the trainer's window mean (`loss_avg`, over every step, not only the logged
    ones) where the run logs it, else a running mean of the logged values past 20 of them."""
    xa, ya = run.series("loss_avg")
    if len(xa):
        return xa, ya
    if len(y) <= 20:
        return None
    w = max(2, len(y) // 20)
    return x[w - 1 :], np.convolve(y, np.ones(w) / w, mode="valid")


def _bucket_lo(name: str) -> float:
    try:
        return float(name.split("-", 1)[0])
    except ValueError:
        return float("inf")


def plot_loss_by_position(runs: Sequence[Run], name: str, cols: Sequence[Any]) -> Figure | None:
    """eval/<name>/loss_pos/<lo>-<hi> at each run's last evaluation: the loss by token position."""
    prefix = f"eval/{name}/loss_pos/"
    buckets = sorted({k[len(prefix) :] for r in runs for k in r.metric_keys() if k.startswith(prefix)}, key=_bucket_lo)
    if not buckets:
        return None
    fig, (ax,) = _panels(1)
    for run, c in zip(runs, cols):
        pts = [(i, f[0]) for i, b in enumerate(buckets) if (f := run.final(prefix + b)) is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", ms=3, color=c, label=run.name)
    ax.set_xticks(range(len(buckets)), buckets, rotation=45 if len(buckets) > 6 else 0, fontsize=7)
    ax.set_xlabel("target position bucket")
    ax.set_ylabel("loss")
    ax.set_title(f"eval/{name}: loss by position, last evaluation", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def eval_names(runs: Sequence[Run]) -> list[str]:
    return sorted(
        {k.split("/")[1] for r in runs for k in r.metric_keys() if k.startswith("eval/") and k.count("/") >= 2}
    )


def eval_plot_keys(runs: Sequence[Run], name: str) -> list[str]:
    """The metrics of one eval set or task worth a curve: those with a better side, but not the perplexity (the
    loss, exponentiated) or the per-position buckets (their own plot)."""
    keys = {k for r in runs for k in r.metric_keys() if k.startswith(f"eval/{name}/")}
    keep = [k for k in keys if direction(k) and not k.endswith("/ppl") and "/loss_pos/" not in k]
    order = {"loss": 0, "bpb": 1, "acc": 2, "acc_norm": 3}
    return sorted(keep, key=lambda k: (order.get(k.rsplit("/", 1)[1], 4), _at_length(k), k))


def _at_length(key: str) -> float:
    """acc@256 < acc@1024: the lengths of a passkey grid in numeric order."""
    tail = key.rsplit("@", 1)[1] if "@" in key else ""
    return float(tail) if tail.isdigit() else 0.0


def figures(runs: Sequence[Run]) -> list[tuple[str, Figure]]:
    """(title, figure) for every plot the runs' logs allow."""
    cols = colours(len(runs))
    out: list[tuple[str, Figure | None]] = [("training loss", plot_metrics(runs, [("loss", "training loss")], cols))]
    for name in eval_names(runs):
        keys = eval_plot_keys(runs, name)
        out.append((f"eval/{name}", plot_metrics(runs, [(k, k.split("/", 1)[1]) for k in keys], cols)))
        out.append((f"eval/{name}: loss by position", plot_loss_by_position(runs, name, cols)))
    out.append(("router health (mean over MoE layers)", plot_metrics(runs, ROUTER, cols)))
    out.append(("throughput", plot_metrics(runs, THROUGHPUT, cols)))
    return [(t, f) for t, f in out if f is not None]


def table_keys(runs: Sequence[Run]) -> list[str]:
    present = set().union(*(r.metric_keys() for r in runs))
    evals = sorted((k for k in present if k.startswith("eval/") and (direction(k) or k.endswith("_s"))), key=str)
    first = [k for k in ("loss", "loss_avg") if k in present]
    return first + evals + [k for k in FINAL_ONLY if k in present]


def _fmt(v: Any) -> str:
    if isinstance(v, (int, float)) and float(v).is_integer() and abs(v) < 1e15:
        return f"{int(v):,}"  # steps, tokens: exact, with thousands separators
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"
    return str(v)


def metrics_table(runs: Sequence[Run], cols: Sequence[Any]) -> str:
    """Rows: the step and tokens reached, then each metric; a cell per run: the final value and, for a metric
    with a better side, the best value and its step. The best run of a row is marked."""
    head = "".join(f"<th>{_swatch(c)}{html.escape(r.name)}</th>" for r, c in zip(runs, cols))
    rows = [
        _row("steps", [_fmt(r.records[-1]["step"]) if r.records else "—" for r in runs]),
        _row("tokens", [_fmt(r.records[-1]["tokens"]) if r.records else "—" for r in runs]),
    ]
    for key in table_keys(runs):
        finals, bests = [r.final(key) for r in runs], [r.best(key) for r in runs]
        how = direction(key)
        scored = [b[0] for b in bests if b is not None]
        winner = (min if how == "min" else max)(scored) if how and len(scored) > 1 else None
        cells = []
        for f, b in zip(finals, bests):
            if f is None:
                cells.append("—")
                continue
            cell = html.escape(_fmt(f[0]))
            if b is not None:
                mark = " ★" if winner is not None and b[0] == winner else ""
                cell += f"<br><small>best {html.escape(_fmt(b[0]))} @ step {b[1]}{mark}</small>"
            cells.append(cell)
        label = f"{key} ({'lower' if how == 'min' else 'higher'} is better)" if how else key
        rows.append(_row(label, cells, escape=False))
    return f"<table><tr><th>metric: final</th>{head}</tr>{''.join(rows)}</table>"


def config_table(runs: Sequence[Run], cols: Sequence[Any]) -> str:
    configs = [r.config for r in runs]
    keys = differing_keys(configs) if len(runs) > 1 else []
    n_same = len(set().union(*configs) - set(keys)) if configs else 0
    if not keys:
        return f"<p>No config key differs between the runs ({n_same} keys compared).</p>"
    head = "".join(f"<th>{_swatch(c)}{html.escape(r.name)}</th>" for r, c in zip(runs, cols))
    rows = [_row(k, [json.dumps(c[k], default=str) if k in c else "—" for c in configs]) for k in keys]
    differ = f"{len(keys)} key differs" if len(keys) == 1 else f"{len(keys)} keys differ"
    note = f"<p>{differ}; {n_same} are the same in every run (run_dir not compared).</p>"
    return f"{note}<table><tr><th>config key</th>{head}</tr>{''.join(rows)}</table>"


def _swatch(c: Sequence[float]) -> str:
    return f'<span class="sw" style="background:{matplotlib.colors.to_hex(c)}"></span>'


def _row(label: str, cells: Sequence[str], escape: bool = True) -> str:
    tds = "".join(f"<td>{html.escape(c) if escape else c}</td>" for c in cells)
    return f"<tr><th>{html.escape(label)}</th>{tds}</tr>"


STYLE = (
    "body{font-family:sans-serif;margin:1.5em;color:#222}table{border-collapse:collapse;margin:.5em 0 1.5em}"
    "td,th{border:1px solid #ccc;padding:.2em .6em;text-align:left;vertical-align:top;font-size:90%}"
    "th{background:#f4f4f4}small{color:#555}figure{margin:.5em 0}img{max-width:100%}"
    ".sw{display:inline-block;width:.8em;height:.8em;margin-right:.3em;border-radius:2px}"
)


def render_page(runs: Sequence[Run]) -> str:
    cols = colours(len(runs))
    lst = "".join(
        f"<li>{_swatch(c)}<b>{html.escape(r.name)}</b>: {html.escape(str(r.path))}"
        + (f" <small>({html.escape(r.tokens_note)})</small>" if r.tokens_note else "")
        + "</li>"
        for r, c in zip(runs, cols)
    )
    figs = "".join(
        f'<figure><img src="{png_data_uri(fig)}" alt="{html.escape(t)}"><figcaption>{html.escape(t)}'
        "</figcaption></figure>"
        for t, fig in figures(runs)
    )
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>k3-train: {html.escape(', '.join(r.name for r in runs))}</title><style>{STYLE}</style></head><body>"
        f"<h1>{len(runs)} runs side by side</h1><ul>{lst}</ul>"
        f"<h2>Final and best</h2>{metrics_table(runs, cols)}"
        f"<h2>Curves</h2>{figs}"
        f"<h2>Config keys that differ</h2>{config_table(runs, cols)}</body></html>\n"
    )


def default_out(run_dirs: Sequence[Path]) -> Path:
    """`compare.html` in the runs' deepest common folder (runs/a runs/b: runs/compare.html; a sweep's folder:
    inside it)."""
    common = os.path.commonpath([os.path.abspath(p) for p in run_dirs])
    if len(run_dirs) == 1:
        common = os.path.dirname(common)
    rel = os.path.relpath(common)
    return Path(common if rel.startswith("..") else rel) / DEFAULT_NAME


def resolve_out(out: str | Path | None, run_dirs: Sequence[Path], given: Sequence[Path]) -> Path:
    """`out=FILE.html` as given; `out=DIR` (an existing folder, or a name without .html): DIR/compare.html;
    default: `default_out` (a single sweep folder given: inside it)."""
    if out is None:
        if len(given) == 1 and given[0].is_dir() and not (given[0] / "metrics.jsonl").is_file():
            return given[0] / DEFAULT_NAME
        return default_out(run_dirs)
    out = Path(out)
    return out if out.suffix.lower() in (".html", ".htm") else out / DEFAULT_NAME


def build_comparison(paths: Sequence[str | Path], out: str | Path | None = None) -> tuple[Path, list[Run]]:
    """Read the runs (each path a run dir or a folder of them), write the page; returns (its path, the runs)."""
    given = [Path(p) for p in paths]
    run_dirs = find_runs(given)
    runs = [load_run(p, n) for p, n in zip(run_dirs, short_names(run_dirs))]
    target = resolve_out(out, run_dirs, given)
    target.parent.mkdir(parents=True, exist_ok=True)
    page = render_page(runs)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, target)  # a reader never sees half a page
    return target, runs

"""The house rules the layout promises: no import cycle among the project's modules, no file over 500 lines,
`model/` never imports DeepSpeed or the packages above it, `data/` never imports `model/` or `training/`."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("model", "data", "training")


def project_files(root: Path = ROOT, suffix: str = ".py") -> list[Path]:
    """The project's own files: tracked, or new and not ignored (git's view), never what a job wrote (runs/,
    caches, DeepSpeed's copied zero_to_fp32.py in a checkpoint) or the virtualenv."""
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, capture_output=True, check=True
    ).stdout.decode()
    return [root / f for f in out.split("\0") if f.endswith(suffix) and (root / f).is_file()]


def _modules() -> dict[str, Path]:
    out = {}
    for f in project_files():
        if f.relative_to(ROOT).parts[0] in PACKAGES:
            name = ".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            out[name] = f
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Project modules `name` imports anywhere in the file (function-local imports count too)."""
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for n in names:
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n and n != name and not name.startswith(n + "."):
                found.add(n)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, set(mods)) for m, p in mods.items()}


def test_no_import_cycles_among_project_modules():
    g = _graph()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(g[m]):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n) :] + [n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def over_500_lines(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): n for p in project_files(root) if (n := len(p.read_text().splitlines())) > 500}


def test_no_file_over_500_lines():
    assert over_500_lines(ROOT) == {}


def test_what_a_job_writes_is_not_a_project_file(tmp_path):
    """A run dir in the checkout (the README's `make smoke` leaves runs/smoke/checkpoints/.../zero_to_fp32.py, 800+
    lines) does not count; a new source file does."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("runs/\n")
    job = tmp_path / "runs" / "smoke" / "checkpoints"
    job.mkdir(parents=True)
    (job / "zero_to_fp32.py").write_text("x = 1\n" * 600)
    assert over_500_lines(tmp_path) == {}
    (tmp_path / "big.py").write_text("x = 1\n" * 501)
    assert over_500_lines(tmp_path) == {"big.py": 501}


@pytest.mark.parametrize(
    "pkg,forbidden", [("model", ("training", "data", "deepspeed")), ("data", ("training", "model", "deepspeed"))]
)
def test_lower_layers_never_import_upper_ones(pkg, forbidden):
    bad = []
    for f in (p for p in project_files() if p.relative_to(ROOT).parts[0] == pkg):
        for node in ast.walk(ast.parse(f.read_text())):
            mods = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            bad += [f"{f.relative_to(ROOT)}: {m}" for m in mods if m.split(".")[0] in forbidden]
    assert bad == []

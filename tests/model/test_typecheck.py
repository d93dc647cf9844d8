"""model/ type-checks clean under mypy with the pyproject `[tool.mypy]` settings (mypy is a dev dependency).

Cold (no .cache/mypy) it takes ~30 s on one core, almost all of it reading torch's annotations; warm ~1 s.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_model_package_passes_mypy():
    result = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr

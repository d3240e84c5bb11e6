"""The tree stays ruff- and mypy-clean (configuration in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*argv: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_ruff() -> None:
    _run("ruff", "check", "--no-cache", ".")
    _run("ruff", "format", "--check", "--no-cache", ".")


def test_mypy() -> None:
    _run("mypy")

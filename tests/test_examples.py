"""Every runnable example runs to completion (the trainer loop is covered in test_controller)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CASES = {
    "rollout_worker.py": (["--seconds", "1", "--flows", "8"], "bye acknowledged: True"),
    "rollout_only.py": (["--workers", "2", "--seconds", "1"], "workers 2 events"),
    "ppo_diagnostics.py": ([], "ppo_actor/train_infer/kl_k3"),
    "stats_logger_inprocess.py": (["--steps", "2"], "rollout/reward="),
}


def test_every_example_is_covered() -> None:
    scripts = {p.name for p in (ROOT / "examples").glob("*.py")}
    assert scripts == set(CASES) | {"trainer_loop.py"}


@pytest.mark.parametrize("script", sorted(CASES))
def test_example_runs(script: str, tmp_path: Path) -> None:
    args, marker = CASES[script]
    if script == "stats_logger_inprocess.py":
        args = [*args, "--fileroot", str(tmp_path)]
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert marker in out.stdout

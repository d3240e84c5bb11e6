"""The main job end to end: real controller, worker processes and gloo trainers."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

TRAIN_KEYS = (
    "ppo_actor/advantages/avg",
    "ppo_actor/n_valid_tokens",
    "ppo_actor/update/loss/avg",
    "ppo_actor/train_infer/kl_k3",
    "ppo_actor/advantage_positive_fraction",
    "ppo_actor/update/version_stats/sample_staleness_theta_avg",
    "train_perf/tokens",
    "train_perf/estimated_flops_per_second",
    "moe_balance/layer_0/max_over_ideal",
    "learning_rate",
)


def _journal(root: Path) -> list[dict[str, object]]:
    (path,) = glob.glob(str(root / "logs" / "*" / "*" / "*" / "stats.jsonl"))
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_demo_runs_every_part(tmp_path: Path) -> None:
    argv = [
        sys.executable, "-m", "areal_stream.demo", "--steps", "3", "--workers", "2",
        "--workflows-per-worker", "8", "--fileroot", str(tmp_path), "--eval-before-train",
        "--step-seconds", "0.2", "--trial-name", "t", "--eval-fraction", "0",
    ]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # The printed viewing command runs as printed (the tool is found, the directory exists).
    (line,) = [ln for ln in out.stdout.splitlines() if "TensorBoard:" in ln]
    tool, flag, logdir = line.split()[1:]
    assert flag == "--logdir" and os.path.basename(tool) == "tensorboard"
    assert shutil.which(tool) or os.access(tool, os.X_OK), tool
    assert os.path.isdir(logdir) and os.path.isfile(os.path.join(logdir, "stats.jsonl"))
    rows = _journal(tmp_path)
    train_rows = [r for r in rows if "ppo_actor/update/loss/avg" in r["stats"]]  # type: ignore[operator]
    assert [r["global_step"] for r in train_rows] == [0, 1, 2]
    for r in train_rows:
        stats = r["stats"]
        assert isinstance(stats, dict)
        for k in TRAIN_KEYS:
            assert k in stats, k
        assert stats["bus/missing_workers"] == 0
        assert not any(k.endswith("__count") for k in stats)
    # With no eval workflows during training, eval metrics come only from the evaluation
    # round before training, and arrive with step 0.
    first = train_rows[0]["stats"]
    assert isinstance(first, dict)
    assert 0.0 <= first["eval-rollout/reward"] <= 1.0
    assert all("eval-rollout/reward" not in r["stats"] for r in rows[1:])  # type: ignore[operator]
    assert glob.glob(
        str(tmp_path / "logs" / "*" / "*" / "t" / "**" / "events.out.tfevents.*"), recursive=True
    )


def _children(pid: int) -> list[int]:
    """Direct children of ``pid``, from /proc."""
    found = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                found.append(int(stat.split("/")[2]))
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_demo_ctrl_c_stops_everything(tmp_path: Path) -> None:
    argv = [
        sys.executable, "-m", "areal_stream.demo", "--steps", "200", "--workers", "2",
        "--workflows-per-worker", "4", "--fileroot", str(tmp_path), "--step-seconds", "0.2",
        "--trial-name", "t",
    ]  # fmt: skip
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    pgid = os.getpgid(proc.pid)
    children: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not (glob.glob(str(tmp_path / "logs/*/*/t/stats.jsonl")) and _journal(tmp_path)):
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            assert time.monotonic() < deadline, "no step committed in time"
            time.sleep(0.1)
        children = _children(proc.pid)
        assert len(children) == 5, children  # controller, 2 workers, 2 trainers
        os.killpg(pgid, signal.SIGINT)  # what Ctrl-C in a terminal does
        out, _ = proc.communicate(timeout=60)
        text = out.decode()
        assert proc.returncode == 130, text
        # Quiet: no child spews a traceback, workers' goodbyes reach the controller.
        assert "Traceback" not in text and "did not acknowledge" not in text, text
        assert "[demo] interrupted" in text and "Logs so far:" in text, text
        # The demo reaped every child before exiting: no orphan is left.
        assert [c for c in children if _alive(c)] == []
    finally:
        for pid in [proc.pid, *children]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if proc.stdout:
            proc.stdout.close()
        proc.wait(timeout=10)


def test_demo_bad_flags_are_one_line_errors(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    for flags, message in (
        (["--steps", "0"], "--steps must be at least 1"),
        (["--fileroot", str(afile)], "is not a directory"),
        (["--eval-fraction", "1.5"], "--eval-fraction must be between 0 and 1"),
    ):
        out = subprocess.run(
            [sys.executable, "-m", "areal_stream.demo", *flags],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2, out.stderr
        assert message in out.stderr.splitlines()[-1]
        assert "Traceback" not in out.stderr

"""python -m areal_stream.replay: a journal sent to backends afterwards, read back value by
value (TensorBoard and Trackio for real, in a child process as trackio needs TRACKIO_DIR)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from readback import (
    nan_equal,
    read_jsonl,
    read_tensorboard_images,
    read_tensorboard_scalars,
    read_trackio_logs,
)

from areal_stream import StatsLogger, Table
from areal_stream._backends import Backend, StepRecord, register_backend, unregister_backend
from areal_stream.replay import main

ROOT = Path(__file__).resolve().parent.parent
HEAT = Table(
    ["layer", "expert", "load"],
    [[0, 0, 1.0], [0, 1, 3.0], [1, 0, 2.0]],
    index=["layer", "expert"],
    heatmap="load",
)


def _journal(tmp: Path) -> Path:
    """A run whose only output is the journal (every backend was 'down')."""
    config = {
        "experiment_name": "exp",
        "trial_name": "t",
        "fileroot": str(tmp / "run"),
        "tensorboard": {"path": None},
        "console": {"enabled": False},
    }
    with StatsLogger(config) as logger:
        logger.commit(0, 0, 0, {"loss": 0.5, "n": 3, "bad": float("nan")})
        logger.commit(0, 1, 1, [{"loss": 0.25, "moe/loads": HEAT}, {"loss": float("inf")}])
        logger.commit(0, 2, 7, {"loss": 0.125})
        path = logger.journal_path
    assert path is not None
    return Path(path)


def test_cli_replays_to_tensorboard_and_trackio(tmp_path: Path) -> None:
    journal = _journal(tmp_path)
    other = tmp_path / "other.yaml"
    other.write_text(
        yaml.safe_dump(
            {
                "stats_logger": {
                    "experiment_name": "exp",
                    "trial_name": "t",
                    "fileroot": str(tmp_path / "replayed"),
                    "tensorboard": {"path": str(tmp_path / "tb")},
                    "trackio": {"mode": "local", "project": "rp"},
                }
            }
        )
    )
    env = dict(
        os.environ,
        TRACKIO_DIR=str(tmp_path / "trackio"),
        TRACKIO_STORAGE_MODE="sqlite",
        HOME=str(tmp_path),
        PYTHONPATH=str(ROOT),
    )
    proc = subprocess.run(
        [sys.executable, "-m", "areal_stream.replay", str(journal), "--config", str(other)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tensorboard: logged 4, errors 0, dropped 0" in proc.stdout
    assert "trackio: logged 4, errors 0, dropped 0" in proc.stdout
    lines = read_jsonl(journal)
    want_tb: dict[str, dict[int, float]] = {}
    for line in lines:
        for k, v in line["stats"].items():
            if not isinstance(v, dict):
                want_tb.setdefault(k, {})[line["step"]] = float(np.float32(v))
    assert nan_equal(read_tensorboard_scalars(tmp_path / "tb"), want_tb)
    img = read_tensorboard_images(tmp_path / "tb")["moe/loads"][1]
    np.testing.assert_array_equal(img, np.array([[85, 255], [170, 0]], dtype=np.uint8))
    rows = read_trackio_logs(tmp_path / "trackio", "rp", "t")
    got = {r.pop("step"): {k: v for k, v in r.items() if k != "timestamp"} for r in rows}
    assert nan_equal(
        got,
        {
            0: {"loss": 0.5, "n": 3, "bad": float("nan")},
            1: {
                "loss": 0.25,
                "moe/layer_0/expert_0/load": 1.0,
                "moe/layer_0/expert_1/load": 3.0,
                "moe/layer_1/expert_0/load": 2.0,
            },
            2: {"loss": float("inf")},
            7: {"loss": 0.125},
        },
    )
    # the replay wrote no journal and nothing under its own log dir
    assert not (tmp_path / "replayed").exists()


def test_torn_last_line_from_a_killed_writer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """A process killed mid-line leaves a torn last line: replay skips it and says so; a
    resumed logger cuts it off so its own first record stays whole."""
    journal = _journal(tmp_path)
    whole = journal.read_text()
    lines = whole.splitlines(keepends=True)
    torn = lines[-1][: len(lines[-1]) // 2]  # the last record, half written, no newline
    journal.write_text("".join(lines[:-1]) + torn)
    cfg = tmp_path / "c.yaml"
    base = {"experiment_name": "exp", "trial_name": "t", "fileroot": str(tmp_path / "run")}
    cfg.write_text(yaml.safe_dump({"stats_logger": base}))
    assert main([str(journal), "--config", str(cfg), "--console"]) == 0
    out, err = capsys.readouterr()
    assert "console: logged 3, errors 0, dropped 0" in out  # the 3 complete records
    assert f"{journal}:4: torn last line ({len(torn)} chars, no newline) skipped" in err
    # a torn line that is not the last one is still an error with its line number
    middle = tmp_path / "middle.jsonl"
    middle.write_text("".join(lines[:-1]) + torn + "\n" + lines[-1])
    assert main([str(middle), "--config", str(cfg), "--console"]) == 2
    assert f"{middle}:4: not JSON" in capsys.readouterr().err
    # resume on the torn journal: the torn bytes are cut, the new record is a line of its own
    config = {**base, "tensorboard": {"path": None}, "console": {"enabled": False}}
    with caplog.at_level("WARNING", logger="areal_stream.stats_logger"), StatsLogger(config) as lg:
        assert lg.journal_path == str(journal)
        lg.load_state_dict({"last_commit_step": 2})
        lg.commit(0, 3, 3, {"loss": 1.0})
    assert f"cut off a torn last line of {len(torn)} bytes" in caplog.text
    assert journal.read_text() == "".join(lines[:-1]) + (
        '{"global_step":3,"step":3,"epoch":0,"epoch_step":3,"stats":{"loss":1.0}}\n'
    )
    # a complete record that only lost its newline is kept, and the next one starts a line
    journal.write_text(whole.rstrip("\n"))
    with StatsLogger(config) as logger:
        logger.load_state_dict({"last_commit_step": 7})
        logger.commit(0, 3, 8, {"loss": 2.0})
    assert [x["step"] for x in read_jsonl(journal)] == [0, 1, 2, 7, 8]


class _Failing(Backend):
    def log(self, record: StepRecord) -> None:
        raise OSError("service down")


def test_replay_exit_codes_and_defaults(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    journal = _journal(tmp_path)
    base: dict[str, Any] = {"experiment_name": "exp", "trial_name": "t", "fileroot": str(tmp_path)}
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"stats_logger": base}))
    # no tensorboard block: the embedded default is not used by a replay -> nothing enabled
    assert main([str(journal), "--config", str(cfg)]) == 2
    assert "enables no backend" in capsys.readouterr().err
    assert not (Path(journal).parent / "tensorboard").exists()
    # --console prints every step
    assert main([str(journal), "--config", str(cfg), "--console"]) == 0
    out = capsys.readouterr().out
    assert "step 7  (global_step 7, epoch 0, epoch_step 2)  1 stats" in out
    assert "console: logged 4, errors 0, dropped 0" in out
    # a failing backend: counted, exit status 1
    register_backend("flaky", lambda c, d: _Failing())
    try:
        assert main([str(journal), "--config", str(cfg), "--only", "flaky"]) == 1
        assert "flaky: logged 0, errors 4, dropped 0" in capsys.readouterr().out
    finally:
        unregister_backend("flaky")
    # --only naming a backend the config does not enable
    assert main([str(journal), "--config", str(cfg), "--only", "wandb"]) == 2
    assert "does not enable: wandb" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main([str(journal), "--config", str(cfg), "--only", "nosuch"])
    assert info.value.code == 2
    # a bad journal line is reported with its line number, nothing sent
    broken = tmp_path / "broken.jsonl"
    broken.write_text(Path(journal).read_text() + '{"global_step": 1}\n')
    assert main([str(broken), "--config", str(cfg), "--console"]) == 2
    captured = capsys.readouterr()
    assert f"{broken}:5:" in captured.err and "step" not in captured.out
    # a bad config is refused with the key named
    cfg.write_text(yaml.safe_dump({"stats_logger": {**base, "wandb": {"mode": "x"}}}))
    assert main([str(journal), "--config", str(cfg)]) == 2
    assert "stats_logger.wandb.mode" in capsys.readouterr().err

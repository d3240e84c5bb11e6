"""Real backends, real files: W&B offline, SwanLab offline, TensorBoard, Trackio local and
the JSONL journal all receive the same committed steps; each is read back and compared value
by value. The run happens in a child process (trackio reads TRACKIO_DIR at import; wandb-core
and swanlab state stay out of the test process), with HOME pointed at a temp dir."""

from __future__ import annotations

import json
import math
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
    read_swanlab_config,
    read_swanlab_scalars,
    read_tensorboard_images,
    read_tensorboard_scalars,
    read_trackio_logs,
    read_wandb_artifact_table,
    read_wandb_config,
    read_wandb_history,
    read_wandb_run,
    read_wandb_table,
)

from areal_stream import Table

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
SECRETS = ("WANDB-SECRET-123", "SWAN-SECRET-456", "HF-SECRET-789")
# credentials the child only has in its environment (wandb and swanlab read these themselves)
ENV_SECRETS = {
    "WANDB_API_KEY": "ENVWANDBSECRET" + "0" * 26,
    "SWANLAB_API_KEY": "ENV-SWAN-SECRET-321",
}

MOE = Table(
    ["layer", "expert", "tokens", "load_percent"],
    [
        [0, 0, 10, 12.5],
        [0, 1, 30, 37.5],
        [0, 2, 40, 50.0],
        [1, 0, 0, 0.0],
        [1, 1, 20, 25.0],
        [1, 2, 60, 75.0],
    ],
    index=["layer", "expert"],
    heatmap="load_percent",
)
PLAIN = Table(["a", "b"], [[1, 2.5], [3, float("nan")]])
# more rows than W&B's default cap (wandb.Table.MAX_ROWS = 10,000): all must arrive
LONG = Table(["v"], [[i * 0.5] for i in range(10_001)])


def commits() -> list[tuple[int, int, int, Any]]:
    """(epoch, epoch_step, global_step, data) in commit order; used by the child too."""
    return [
        (
            0,
            0,
            0,
            {
                "loss": 0.5,
                "reward": 1.0,
                "n": 7,
                "flag": True,
                "reward__count": 12,
                "x/nan": float("nan"),
                "x/inf": float("inf"),
                "x/ninf": float("-inf"),
                "np32": np.float32(0.25),
            },
        ),
        (0, 1, 1, [{"loss": 0.25, "moe_balance/expert_loads": MOE, "plain": PLAIN}, {"loss": 2}]),
        (0, 2, 2, {"loss": 0.0625, "long": LONG}),
    ]


# step logged for each committed dict, with __count dropped and values normalised
EXPECTED: dict[int, dict[str, Any]] = {
    0: {
        "loss": 0.5,
        "reward": 1.0,
        "n": 7,
        "flag": 1,
        "x/nan": float("nan"),
        "x/inf": float("inf"),
        "x/ninf": float("-inf"),
        "np32": 0.25,
    },
    1: {"loss": 0.25, "moe_balance/expert_loads": MOE, "plain": PLAIN},
    2: {"loss": 2},
    3: {"loss": 0.0625, "long": LONG},
}


def config(tmp: Path) -> dict[str, Any]:
    return {
        "stats_logger": {
            "experiment_name": "exp",
            "trial_name": "t1",
            "fileroot": str(tmp / "root"),
            "wandb": {
                "mode": "offline",
                "project": "proj",
                "wandb_api_key": SECRETS[0],
                "config": {"lr": 0.1, "hf_token": SECRETS[2]},
                "tags": ["a", "b"],
            },
            "swanlab": {"mode": "offline", "api_key": SECRETS[1]},
            "trackio": {"mode": "local", "project": "tproj"},
            "console": {"enabled": True, "max_rows": 3},
        }
    }


CHILD = r"""
import json, logging, sys
sys.path.insert(0, sys.argv[1])
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(message)s")
import threading
import wandb
assert wandb.Table.MAX_ROWS == 10_000  # the cap LONG exceeds
wandb.Table.MAX_ARTIFACT_ROWS = 10_000  # stands in for the artifact cap of 200,000
from test_backends import commits
from areal_stream import StatsLogger
from areal_stream.config import load_config
cfg = load_config(sys.argv[2])  # a file: secrets on argv would be recorded by wandb/swanlab
# a wandb.init that fails (online, no API key: refused before any network use) leaves no
# wandb thread behind
import dataclasses, os
from areal_stream._backends.wandb_backend import WandbBackend
saved = {k: os.environ.pop(k, "") for k in ("WANDB_MODE", "WANDB_API_KEY")}
online = dataclasses.replace(cfg, wandb=dataclasses.replace(cfg.wandb, mode="online",
                                                            wandb_api_key=None))
try:
    WandbBackend(online, "online").open()
    print("FAILED_OPEN none")
except Exception as e:
    print("FAILED_OPEN " + json.dumps([type(e).__name__] + [t.name for t in threading.enumerate()
                                                          if t is not threading.main_thread()]))
os.environ.update({k: v for k, v in saved.items() if v})
user = wandb.init(dir="user", project="mine", id="user_run")  # the user's own run, left open
user.log({"u": 1}, step=0)
logger = StatsLogger(cfg)
for epoch, step, gstep, data in commits():
    logger.commit(epoch, step, gstep, data)
assert logger.flush(timeout=60)
stats = {k: v.__dict__ for k, v in logger.statistics().items()}
logger.close()
print("STATS " + json.dumps(stats))
user.log({"u": 2}, step=1)  # still usable: the logger neither wrote to it nor finished it
user.finish()
# W&B drops a step below its current one with a warning WANDB_SILENT hides: refused instead
from areal_stream._backends import StepRecord
order = dataclasses.replace(cfg, wandb=dataclasses.replace(cfg.wandb, id_suffix="order"))
wb = WandbBackend(order, "order")
wb.open()
wb.log(StepRecord(5, 5, 0, 0, {"a": 1.0}))
wb.log(StepRecord(5, 5, 0, 0, {"b": 2.0}))  # the same step again is fine (merged)
try:
    wb.log(StepRecord(4, 4, 0, 0, {"a": 3.0}))
    print("ORDER none")
except ValueError as e:
    print("ORDER " + str(e))
wb.close()
def live_children():  # wandb-core must be gone once close() returned
    import os
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                comm, rest = f.read().rsplit(")", 1)
        except OSError:
            continue
        state, ppid = rest.split()[:2]
        if int(ppid) == os.getpid() and state != "Z":
            out.append(comm.split("(", 1)[1])
    return out
print("CHILDREN " + json.dumps(live_children()))
print("THREADS " + json.dumps([f"{type(t).__module__}.{type(t).__name__}"
                               for t in threading.enumerate() if t is not threading.main_thread()]))
"""


def _child_env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    home = tmp / "home"
    home.mkdir()
    env.update(
        HOME=str(home),
        TRACKIO_DIR=str(tmp / "trackio"),
        TRACKIO_STORAGE_MODE="sqlite",
        WANDB_CACHE_DIR=str(tmp / "wandb_cache"),
        WANDB_DATA_DIR=str(tmp / "wandb_data"),
        WANDB_CONFIG_DIR=str(tmp / "wandb_config"),
        PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""),
    )
    env.update(ENV_SECRETS)
    return env


@pytest.fixture(scope="module")
def run_all(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("allbackends")
    cfg_file = tmp / "run.yaml"
    cfg_file.write_text(yaml.safe_dump(config(tmp)))
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, TESTS, str(cfg_file)],
        env=_child_env(tmp),
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    log_dir = next((tmp / "root" / "logs").glob("*/exp/t1"))
    stats_line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("STATS "))
    children = next(ln for ln in proc.stdout.splitlines() if ln.startswith("CHILDREN "))
    threads = next(ln for ln in proc.stdout.splitlines() if ln.startswith("THREADS "))
    order = next(ln for ln in proc.stdout.splitlines() if ln.startswith("ORDER "))
    failed = next(ln for ln in proc.stdout.splitlines() if ln.startswith("FAILED_OPEN "))
    return {
        "tmp": tmp,
        "log_dir": log_dir,
        "stdout": proc.stdout,
        "stderr": proc.stderr,
        "stats": json.loads(stats_line[6:]),
        "children": json.loads(children[9:]),
        "threads": json.loads(threads[8:]),
        "order": order[6:],
        "failed_open": json.loads(failed[12:]),
    }


def _scalars(step: int) -> dict[str, Any]:
    return {k: v for k, v in EXPECTED[step].items() if not isinstance(v, Table)}


def _expanded(step: int) -> dict[str, Any]:
    """Scalars plus the per-cell keys SwanLab/Trackio get for Tables."""
    out = _scalars(step)
    if step == 1:
        for layer, expert, tokens, pct in MOE.rows:
            out[f"moe_balance/layer_{layer}/expert_{expert}/tokens"] = tokens
            out[f"moe_balance/layer_{layer}/expert_{expert}/load_percent"] = pct
        for n, (a, b) in enumerate(PLAIN.rows):
            out[f"plain/{n}/a"] = a
            out[f"plain/{n}/b"] = b
    if step == 3:
        out.update({f"long/{n}/v": row[0] for n, row in enumerate(LONG.rows)})
    return out


def test_every_backend_ran_clean(run_all: dict[str, Any]) -> None:
    stats = run_all["stats"]
    assert set(stats) == {"tensorboard", "wandb", "swanlab", "trackio", "console"}
    for name, s in stats.items():
        assert (s["logged"], s["errors"], s["dropped"], s["queued"]) == (4, 0, 0, 0), name
    assert run_all["children"] == []  # wandb-core exited (wandb.teardown() on close)
    # no backend thread is left: wandb's and trackio's are gone, swanlab's file watcher is
    # stopped; only watchdog's process-wide inotify reader (shared by every watchdog observer
    # in the process, never stopped by watchdog itself) stays, at most one
    assert run_all["threads"] in ([], ["watchdog.observers.inotify_c.InotifyFD"])
    assert run_all["failed_open"] == ["UsageError"]  # and no wandb thread left after it


def test_journal(run_all: dict[str, Any]) -> None:
    lines = read_jsonl(run_all["log_dir"] / "stats.jsonl")
    assert [(ln["global_step"], ln["step"], ln["epoch"], ln["epoch_step"]) for ln in lines] == [
        (0, 0, 0, 0),
        (1, 1, 0, 1),
        (1, 2, 0, 1),
        (2, 3, 0, 2),
    ]
    for ln in lines:
        want = {
            k: (
                {
                    "__table__": {
                        "columns": list(v.columns),
                        "rows": [list(r) for r in v.rows],
                        "index": list(v.index),
                        "heatmap": v.heatmap,
                    }
                }
                if isinstance(v, Table)
                else v
            )
            for k, v in EXPECTED[ln["step"]].items()
        }
        assert nan_equal(ln["stats"], want), ln
    raw = (run_all["log_dir"] / "stats.jsonl").read_text()
    assert "NaN" in raw and "-Infinity" in raw and "__count" not in raw


def test_tensorboard(run_all: dict[str, Any]) -> None:
    tb = run_all["log_dir"] / "tensorboard"
    scalars = read_tensorboard_scalars(tb)
    want: dict[str, dict[int, float]] = {}
    for step in EXPECTED:
        for k, v in _scalars(step).items():
            want.setdefault(k, {})[step] = float(np.float32(v))
    assert nan_equal(scalars, want)
    images = read_tensorboard_images(tb)
    assert set(images) == {"moe_balance/expert_loads"}  # plain/long have no heatmap: skipped
    pixels = images["moe_balance/expert_loads"][1]
    # load_percent, rows = layer, columns = expert, round(255 * v / 75)
    expected = np.array(
        [[round(255 * v / 75.0) for v in (12.5, 37.5, 50.0)], [0, 85, 255]], dtype=np.uint8
    )
    assert pixels.dtype == np.uint8
    np.testing.assert_array_equal(pixels, expected)
    assert "TensorBoard skips it" in run_all["stderr"]
    assert run_all["stderr"].count("Table 'plain' has no heatmap") == 1


def test_wandb(run_all: dict[str, Any]) -> None:
    log_dir = run_all["log_dir"]
    run = read_wandb_run(log_dir)
    assert run == {"id": "exp_t1_train", "project": "proj", "name": "t1", "group": "exp_t1"}
    history = read_wandb_history(log_dir)
    assert sorted(history) == [0, 1, 2, 3]
    for step, row in history.items():
        scalars = {k: v for k, v in row.items() if not any(k.startswith(t) for t in _TABLE_KEYS)}
        assert nan_equal(scalars, _scalars(step)), (step, row)
    for step, key in ((1, "moe_balance/expert_loads"), (1, "plain"), (3, "long")):
        table = read_wandb_table(log_dir, history[step], key)
        source: Table = EXPECTED[step][key]
        assert table["columns"] == list(source.columns)
        assert nan_equal(table["data"], [list(r) for r in source.rows]), key
    # the run_table artifact holds every row too (its cap is lowered below LONG in the child)
    artifact = read_wandb_artifact_table(log_dir, "run-exp_t1_train-long")
    assert nan_equal(artifact["data"], [list(r) for r in LONG.rows])
    assert run_all["order"] == (
        "W&B run 'exp_t1_order' is already at step 5; W&B ignores the lower step 4 "
        "(replay into another run: set wandb.id_suffix)"
    )
    assert read_wandb_history(run_all["tmp"] / "order") == {5: {"a": 1, "b": 2}}
    # the user's own run, open in the same process all along, got only the user's values
    assert read_wandb_history(run_all["tmp"] / "user") == {0: {"u": 1}, 1: {"u": 2}}
    cfg = read_wandb_config(log_dir)
    assert cfg["lr"] == 0.1 and cfg["hf_token"] == "<redacted>"
    assert cfg["stats_logger"]["wandb"]["wandb_api_key"] == "<redacted>"
    assert cfg["stats_logger"]["swanlab"]["api_key"] == "<redacted>"


_TABLE_KEYS = ("moe_balance/expert_loads/", "plain/", "long/")


def test_swanlab(run_all: dict[str, Any]) -> None:
    scalars = read_swanlab_scalars(run_all["log_dir"])
    want: dict[str, dict[int, float]] = {}
    for step in EXPECTED:
        for k, v in _expanded(step).items():
            want.setdefault(k, {})[step] = float(v)
    assert nan_equal(scalars, want)
    cfg = read_swanlab_config(run_all["log_dir"])
    flat = json.dumps(cfg)
    assert "<redacted>" in flat and "exp" in flat


def test_trackio(run_all: dict[str, Any]) -> None:
    rows = read_trackio_logs(run_all["tmp"] / "trackio", "tproj", "t1")
    got = {r["step"]: {k: v for k, v in r.items() if k not in ("step", "timestamp")} for r in rows}
    assert sorted(got) == [0, 1, 2, 3]
    for step in EXPECTED:
        assert nan_equal(got[step], _expanded(step)), step


def test_console_table(run_all: dict[str, Any]) -> None:
    out = run_all["stdout"]
    assert "step 0  (global_step 0, epoch 0, epoch_step 0)  8 stats" in out
    assert "step 3  (global_step 2, epoch 0, epoch_step 2)  1 stats" in out
    assert "  ... 5 more" in out  # max_rows 3 of 8
    assert "  flag  1" in out  # sorted keys: flag, loss, n shown
    assert "Table 'moe_balance/expert_loads' is not printed" in run_all["stderr"]


def test_no_secret_in_any_file(run_all: dict[str, Any]) -> None:
    secrets = [*SECRETS, *ENV_SECRETS.values()]
    found = []
    for path in Path(run_all["tmp"]).rglob("*"):
        if path.is_file() and path.name != "run.yaml":
            data = path.read_bytes()
            found += [(str(path), s) for s in secrets if s.encode() in data]
    assert found == []
    assert not any(s in run_all["stdout"] + run_all["stderr"] for s in secrets)


def test_missing_package_is_one_line_and_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from areal_stream import StatsLogger

    monkeypatch.setitem(sys.modules, "swanlab", None)  # `import swanlab` raises ImportError
    cfg = {
        "experiment_name": "e",
        "trial_name": "t",
        "fileroot": str(tmp_path),
        "swanlab": {"mode": "offline"},
        "tensorboard": {"path": None},
        "console": {"enabled": False},
    }
    with caplog.at_level("ERROR", logger="areal_stream.stats_logger"):
        logger = StatsLogger(cfg)
        try:
            logger.commit(0, 0, 0, {"a": 1.0})
            assert logger.flush(timeout=30)
            logger.commit(0, 1, 1, {"a": 2.0})
        finally:
            logger.close()
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == [
        "the swanlab backend is enabled but the package 'swanlab' is not installed: "
        "pip install areal-stream[swanlab]"
    ]
    assert all(r.exc_info is None for r in caplog.records)
    lines = read_jsonl(logger.journal_path or "")
    assert lines[1]["stats"] == {
        "a": 2.0,
        "committer/swanlab/errors": 1,
        "committer/swanlab/dropped": 1,
    }
    assert math.isclose(lines[0]["stats"]["a"], 1.0)

"""Import hygiene: the package is cheap to import and loads no logging backend."""

from __future__ import annotations

import json
import subprocess
import sys

BACKENDS = ("wandb", "swanlab", "tensorboard", "trackio", "torch.utils.tensorboard")


def _modules_after(code: str) -> set[str]:
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_import_areal_stream_is_light() -> None:
    mods = _modules_after("import areal_stream")
    assert "torch" not in mods and "zmq" not in mods
    assert not mods & set(BACKENDS)


def test_public_modules_load_no_backend() -> None:
    mods = _modules_after(
        "from areal_stream import stats_tracker, workflow_context, merge_worker_stats, Table\n"
        "import areal_stream.streams, areal_stream.stats_logger, areal_stream.config\n"
        "import areal_stream.training_metrics, areal_stream.flops, areal_stream.train_perf\n"
        "import areal_stream.moe_metrics\n"
        "from areal_stream import StatsLogger, RolloutStream, TrainStream"
    )
    loaded = sorted(m for m in mods if m.split(".")[0] in {"wandb", "swanlab", "trackio"})
    assert loaded == []
    assert "tensorboard" not in mods and "torch.utils.tensorboard" not in mods

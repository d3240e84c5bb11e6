"""areal_stream: AReaL-compatible metrics tracking, streamed over ZeroMQ.

``import areal_stream`` is cheap: submodules (and torch, and every logging backend) load
on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "stats_tracker": ("areal_stream.stats_tracker", None),
    "workflow_context": ("areal_stream.workflow_context", None),
    "config": ("areal_stream.config", None),
    "flops": ("areal_stream.flops", None),
    "moe_metrics": ("areal_stream.moe_metrics", None),
    "train_perf": ("areal_stream.train_perf", None),
    "training_metrics": ("areal_stream.training_metrics", None),
    "merge_worker_stats": ("areal_stream._merge", "merge_worker_stats"),
    "Table": ("areal_stream._table", "Table"),
    "StatsLogger": ("areal_stream.stats_logger", "StatsLogger"),
    "RolloutStream": ("areal_stream.streams", "RolloutStream"),
    "TrainStream": ("areal_stream.streams", "TrainStream"),
}

__all__ = [
    "RolloutStream",
    "StatsLogger",
    "Table",
    "TrainStream",
    "config",
    "flops",
    "merge_worker_stats",
    "moe_metrics",
    "stats_tracker",
    "train_perf",
    "training_metrics",
    "workflow_context",
]

if TYPE_CHECKING:  # the lazy names, for type checkers
    from areal_stream import (
        config,
        flops,
        moe_metrics,
        stats_tracker,
        train_perf,
        training_metrics,
        workflow_context,
    )
    from areal_stream._merge import merge_worker_stats
    from areal_stream._table import Table
    from areal_stream.stats_logger import StatsLogger
    from areal_stream.streams import RolloutStream, TrainStream


def __getattr__(name: str) -> Any:
    try:
        module_name, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'areal_stream' has no attribute {name!r}") from None
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value

"""AReaL-compatible statistics tracking: ``from areal_stream import stats_tracker``.

Module-level functions act on the default tracker; ``get(name)`` returns a named tracker
whose keys carry ``name/`` as prefix. Recording is synchronous and never awaits; every
statistic folds into one mergeable ``[sum, weight, min, max]`` record per key, so export
is a constant number of collectives however many keys and batches were recorded.

    stats_tracker.scalar(learning_rate=1e-3)
    stats_tracker.get(workflow_context.stat_scope()).scalar(reward=1.0)
    stats_tracker.denominator(n_valid_tokens=loss_mask)
    with stats_tracker.scope("ppo_actor"):
        stats_tracker.stat(advantages=adv, denominator="n_valid_tokens")
    stats = stats_tracker.export_all(reduce_group=dp_group)
"""

from __future__ import annotations

from areal_stream._errors import StatsInputError
from areal_stream._tracker import (
    RING_CAPACITY,
    DistributedStatsTracker,
    export_all,
    get,
    pending_events,
    project_records,
    take_records,
)
from bus import ReduceType

DEFAULT_TRACKER = get("")

scalar = DEFAULT_TRACKER.scalar
denominator = DEFAULT_TRACKER.denominator
stat = DEFAULT_TRACKER.stat
stat_compact = DEFAULT_TRACKER.stat_compact
scope = DEFAULT_TRACKER.scope
scope_func_wrapper = DEFAULT_TRACKER.scope_func_wrapper
record_timing = DEFAULT_TRACKER.record_timing
export = DEFAULT_TRACKER.export

__all__ = [
    "DEFAULT_TRACKER",
    "RING_CAPACITY",
    "DistributedStatsTracker",
    "ReduceType",
    "StatsInputError",
    "denominator",
    "export",
    "export_all",
    "get",
    "pending_events",
    "project_records",
    "record_timing",
    "scalar",
    "scope",
    "scope_func_wrapper",
    "stat",
    "stat_compact",
    "take_records",
]

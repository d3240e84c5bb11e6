"""Trackio backend.

``local`` writes SQLite at ``$TRACKIO_DIR/<project>.db`` (trackio reads ``TRACKIO_DIR`` when
it is first imported: set it before anything imports trackio); ``online`` sends to the
Hugging Face Space ``space_id``. Defaults: project = experiment_name, name = trial_name,
``resume="allow"`` (a resumed trial appends to its run), CPU/GPU auto-logging off.
Tables are expanded to one scalar per value cell (see ``areal_stream.Table``). NaN and
+-inf are kept. Trackio renames its reserved keys (``step``, ``time``, ``metrics``,
``project``, ``run``, ``timestamp``) and keys starting with ``__`` to ``__<key>``.
"""

from __future__ import annotations

from typing import Any

from areal_stream._backends._base import (
    Backend,
    NoteOnce,
    StepRecord,
    missing_package,
    with_tables_expanded,
)
from areal_stream.config import StatsLoggerConfig


class TrackioBackend(Backend):
    name = "trackio"

    def __init__(self, config: StatsLoggerConfig) -> None:
        self.config = config
        self._run: Any = None
        self._note = NoteOnce(self.name)

    def open(self) -> None:
        cfg = self.config.trackio
        try:
            import trackio
        except ImportError:
            raise missing_package(self.name, "trackio") from None
        self._run = trackio.init(
            project=cfg.project or self.config.experiment_name,
            name=cfg.name or self.config.trial_name,
            space_id=cfg.space_id if cfg.mode == "online" else None,
            config={"stats_logger": self.config.redacted()},
            resume="allow",
            auto_log_cpu=False,
            auto_log_gpu=False,
            embed=False,
        )

    def log(self, record: StepRecord) -> None:
        self._run.log(with_tables_expanded(record.stats, self._note), step=record.step)

    def close(self) -> None:
        if self._run is None:
            return
        run, self._run = self._run, None
        run.finish()

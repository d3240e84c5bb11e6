"""SwanLab backend.

Modes: ``cloud`` (AReaL's ``online``) needs an API key (config ``api_key`` or
``SWANLAB_API_KEY``), ``offline`` writes ``<logdir>/run-<ts>-<id>/run-<id>.swanlab`` with no
account, ``local`` needs the ``swanboard`` package. ``logdir`` defaults to the log dir.
Defaults as in AReaL: project = experiment_name, experiment name = ``{trial_name}_train``.
Quiet: no hardware monitor, no terminal capture, no interactive prompts, and swanlab's own
console output is muted while this backend opens and closes the run.

SwanLab keeps one run per process (a second enabled SwanLab backend in one process fails at
``open``). Tables are expanded to one scalar per value cell (see ``areal_stream.Table``).
Values are stored as doubles; NaN and +-inf are kept.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from areal_stream._backends._base import (
    Backend,
    NoteOnce,
    StepRecord,
    missing_package,
    with_tables_expanded,
)
from areal_stream.config import StatsLoggerConfig, scrub_secrets


@contextlib.contextmanager
def _muted(swanlab_console: Any) -> Iterator[None]:
    """Mute swanlab's rich console (a module-level object) for the block."""
    c = getattr(swanlab_console, "c", None)
    if c is None or os.environ.get("SWANLAB_DEBUG"):
        yield
        return
    before = c.quiet
    c.quiet = True
    try:
        yield
    finally:
        c.quiet = before


class SwanlabBackend(Backend):
    name = "swanlab"

    def __init__(self, config: StatsLoggerConfig, log_dir: str) -> None:
        self.config = config
        self.logdir = config.swanlab.logdir or log_dir
        self._run: Any = None
        self._console: Any = None
        self._note = NoteOnce(self.name)

    def open(self) -> None:
        cfg = self.config.swanlab
        try:
            import swanlab
        except ImportError:
            raise missing_package(self.name, "swanlab") from None
        try:
            from swanlab.sdk.internal.pkg import console
        except ImportError:  # layout of another swanlab version: stay as loud as it is
            console = None
        self._console = console
        run_config: dict[str, Any] = {"stats_logger": self.config.redacted()}
        if cfg.config:
            run_config.update(scrub_secrets(cfg.config))
        settings: dict[str, Any] = {
            "probe": {"monitor": False},
            "terminal": {"proxy_type": "none"},
            "interactive": False,
        }
        if cfg.api_key:
            settings["api_key"] = cfg.api_key
        mode = "online" if cfg.mode == "cloud" else cfg.mode
        os.makedirs(self.logdir, exist_ok=True)
        with _muted(console):
            self._run = swanlab.init(
                project=cfg.project or self.config.experiment_name,
                experiment_name=cfg.name or f"{self.config.trial_name}_train",
                config=run_config,
                logdir=self.logdir,
                mode=mode,
                settings=swanlab.Settings(**settings),
            )

    def log(self, record: StepRecord) -> None:
        self._run.log(with_tables_expanded(record.stats, self._note), step=record.step)

    def close(self) -> None:
        if self._run is None:
            return
        run, self._run = self._run, None
        with _muted(self._console):
            run.finish()

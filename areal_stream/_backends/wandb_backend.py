"""Weights & Biases backend.

Run id ``{experiment_name}_{trial_name}_{id_suffix}`` (``id_suffix: timestamp`` means the
start time; empty/null means no suffix) with ``resume="allow"``, so a resumed trial continues
its run. Defaults as in AReaL: project = experiment_name, name = trial_name, group =
``{experiment}_{trial}``, files under the log dir (``<log_dir>/wandb/``). The run's config is
``{"stats_logger": config.redacted(), **wandb.config}`` with credential-like keys masked.
The run is always a run of its own (``reinit="create_new"``): a W&B run the user has open
in the same process is neither reused nor finished.

Quiet by default: ``WANDB_SILENT=true`` and console capture off, unless the user set
``WANDB_SILENT`` / ``WANDB_CONSOLE``. In offline mode ``WANDB_MODE=offline`` and
``WANDB_ERROR_REPORTING=false`` are set when unset (otherwise wandb's error reporter still
tries the network). ``wandb_api_key`` / ``wandb_base_url`` are exported as ``WANDB_API_KEY``
/ ``WANDB_BASE_URL`` for online and shared modes only.

A Table becomes a ``wandb.Table`` with all its rows: wandb's default caps (10,000 rows in
the run's table file, ``wandb.Table.MAX_ROWS``; 200,000 in the ``run_table`` artifact,
``MAX_ARTIFACT_ROWS``; class attributes) are raised to the table's size when needed.
NaN and +-inf are logged as they are. A step below the run's current step (a resumed run id
that already went further, a replay into the original run) is refused with ``ValueError``
instead of being dropped by wandb without a word. ``close()`` finishes the run and, when no
other wandb run is active in the process, calls ``wandb.teardown()`` so ``wandb-core`` exits.
"""

from __future__ import annotations

import os
import time
from typing import Any, cast

from areal_stream._backends._base import Backend, StepRecord, missing_package
from areal_stream._table import Table
from areal_stream.config import StatsLoggerConfig, scrub_secrets


def wandb_run_id(config: StatsLoggerConfig) -> str:
    suffix = config.wandb.id_suffix
    if suffix == "timestamp":
        suffix = time.strftime("%Y_%m_%d_%H_%M_%S")
    base = f"{config.experiment_name}_{config.trial_name}"
    return f"{base}_{suffix}" if suffix else base


class WandbBackend(Backend):
    name = "wandb"

    def __init__(self, config: StatsLoggerConfig, log_dir: str) -> None:
        self.config = config
        self.log_dir = log_dir
        self.run_id = wandb_run_id(config)
        self._run: Any = None
        self._wandb: Any = None
        self._min_step = 0  # lowest step W&B still accepts (wandb drops lower ones)

    def open(self) -> None:
        cfg = self.config.wandb
        os.environ.setdefault("WANDB_SILENT", "true")
        if cfg.mode == "offline":
            os.environ.setdefault("WANDB_MODE", "offline")
            os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        if cfg.mode in ("online", "shared"):
            if cfg.wandb_api_key:
                os.environ["WANDB_API_KEY"] = cfg.wandb_api_key
            if cfg.wandb_base_url:
                os.environ["WANDB_BASE_URL"] = cfg.wandb_base_url
        try:
            import wandb
        except ImportError:
            raise missing_package(self.name, "wandb") from None
        self._wandb = wandb
        os.makedirs(self.log_dir, exist_ok=True)
        run_config: dict[str, Any] = {"stats_logger": self.config.redacted()}
        if cfg.config:
            run_config.update(scrub_secrets(cfg.config))
        # a run of our own even when the process has another one active (the user's): the
        # default would hand back (or, in notebooks, finish) that run
        settings: dict[str, Any] = {"reinit": "create_new"}
        if "WANDB_CONSOLE" not in os.environ:
            settings["console"] = "off"
        exp, trial = self.config.experiment_name, self.config.trial_name
        try:
            self._run = wandb.init(
                mode=cast(Any, cfg.mode),
                entity=cfg.entity,
                project=cfg.project or exp,
                name=cfg.name or trial,
                job_type=cfg.job_type,
                group=cfg.group or f"{exp}_{trial}",
                notes=cfg.notes,
                tags=cfg.tags,
                config=run_config,
                dir=self.log_dir,
                id=self.run_id,
                resume="allow",
                settings=wandb.Settings(**settings),
            )
        except BaseException:
            self._teardown()  # a failed init may have started wandb's service thread
            raise
        if cfg.mode != "shared":  # a resumed run starts where it stopped (one query, at open)
            self._min_step = int(self._run.step)

    def log(self, record: StepRecord) -> None:
        wandb = self._wandb
        data: dict[str, Any] = {}
        for key, value in record.stats.items():
            if isinstance(value, Table):
                # wandb truncates a logged table twice over: the run's table file at MAX_ROWS
                # and the run_table artifact at MAX_ARTIFACT_ROWS. Keep every row in both.
                if len(value.rows) > wandb.Table.MAX_ROWS:
                    wandb.Table.MAX_ROWS = len(value.rows)
                if len(value.rows) > wandb.Table.MAX_ARTIFACT_ROWS:
                    wandb.Table.MAX_ARTIFACT_ROWS = len(value.rows)
                data[key] = wandb.Table(
                    columns=list(value.columns), data=[list(r) for r in value.rows]
                )
            else:
                data[key] = value
        if record.step < self._min_step:
            # wandb would drop the step with a warning that WANDB_SILENT hides: make it an
            # error, so it is logged once and counted under committer/wandb/errors
            raise ValueError(
                f"W&B run {self.run_id!r} is already at step {self._min_step}; W&B ignores "
                f"the lower step {record.step} (replay into another run: set wandb.id_suffix)"
            )
        self._run.log(data, step=record.step)
        self._min_step = record.step

    def close(self) -> None:
        if self._run is None:
            return
        run, self._run = self._run, None
        try:
            run.finish()
        finally:
            self._teardown()

    def _teardown(self) -> None:
        """Stop wandb's service (``wandb-core``, its threads) unless another run is active."""
        wandb = self._wandb
        if wandb is None:
            return
        try:
            from wandb.sdk import wandb_setup

            other = wandb_setup.singleton().most_recent_active_run
        except (ImportError, AttributeError):  # another wandb layout: the global run only
            other = wandb.run
        if other is None:
            wandb.teardown()

"""The ``stats_logger:`` block of a run's YAML, as typed dataclasses.

``load_config(path_or_dict)`` accepts a YAML file (or mapping) whose top level either holds a
``stats_logger:`` block (the rest of the file, e.g. the whole experiment config, is ignored) or
*is* that block. It returns a validated ``StatsLoggerConfig``. Unknown keys, wrong types and
invalid modes raise ``ValueError`` naming the dotted key (``stats_logger.wandb.mode``).

Keys (AReaL's names, plus a few of ours marked *)::

    stats_logger:
      experiment_name: str          # required; one path component
      trial_name: str               # required; one path component
      fileroot: str                 # required; logs go to <fileroot>/logs/<user>/<exp>/<trial>/
      wandb:     {mode: online|offline|shared|disabled (default), project, entity, name,
                  job_type, group, notes, tags: [str], config: {..}, id_suffix: "train",
                  wandb_api_key, wandb_base_url}
      swanlab:   {mode: cloud|online|local|offline|disabled (default), project, name,
                  config: {..}, logdir, api_key}     # api_key defaults to $SWANLAB_API_KEY
      tensorboard: {path: auto (default) | <dir> | null}
      trackio:   {mode: local|online|disabled (default), project, name, space_id}
      console*:  {enabled: true, max_rows: 0}        # per-step table on stdout; 0 = all rows
      queue_size*: 1024        # steps buffered per backend before that backend drops steps
      close_timeout*: 60.0     # seconds (finite) per backend for close() to flush and finish

TensorBoard: a missing ``tensorboard`` block (or ``path: auto``) writes to
``<log_dir>/tensorboard`` - the embedded default, so a run with no backend configured still
gets the JSONL journal, TensorBoard and the console table. Only an explicit ``path: null``
disables TensorBoard. ``swanlab.mode: online`` is accepted as AReaL's spelling of ``cloud``.

Secrets (``wandb.wandb_api_key``, ``swanlab.api_key``) never appear in ``repr()`` (which
also leaves out the free-form ``config`` mappings) nor in ``redacted()``, the dict form that
backends log as the run's config; ``redacted()`` also masks any key of the free-form
``config`` mappings whose name looks like a credential (api_key, token, secret, password).
"""

from __future__ import annotations

import dataclasses
import getpass
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "ConsoleConfig",
    "StatsLoggerConfig",
    "SwanlabConfig",
    "TensorBoardConfig",
    "TrackioConfig",
    "WandBConfig",
    "load_config",
]

AUTO = "auto"
REDACTED = "<redacted>"

WANDB_MODES = ("online", "offline", "shared", "disabled")
SWANLAB_MODES = ("cloud", "online", "local", "offline", "disabled")
TRACKIO_MODES = ("local", "online", "disabled")

_SECRET_NAME = re.compile(r"(api[_-]?key|token|secret|password|passwd|credential)", re.I)


def _env_swanlab_key() -> str | None:
    return os.environ.get("SWANLAB_API_KEY") or None


@dataclass
class WandBConfig:
    """Weights & Biases: run id ``{experiment}_{trial}_{id_suffix}``, resumed when it exists."""

    mode: str = "disabled"
    project: str | None = None
    entity: str | None = None
    name: str | None = None
    job_type: str | None = None
    group: str | None = None
    notes: str | None = None
    tags: list[str] | None = None
    config: dict[str, Any] | None = field(default=None, repr=False)
    id_suffix: str | None = "train"
    wandb_base_url: str | None = None
    wandb_api_key: str | None = field(default=None, repr=False)


@dataclass
class SwanlabConfig:
    """SwanLab: ``cloud`` (alias ``online``) needs an API key; ``offline`` needs none."""

    mode: str = "disabled"
    project: str | None = None
    name: str | None = None
    config: dict[str, Any] | None = field(default=None, repr=False)
    logdir: str | None = None
    api_key: str | None = field(default_factory=_env_swanlab_key, repr=False)


@dataclass
class TensorBoardConfig:
    """``path``: ``"auto"`` = ``<log_dir>/tensorboard``; ``None`` disables TensorBoard."""

    path: str | None = AUTO


@dataclass
class TrackioConfig:
    """Trackio: ``local`` writes SQLite under ``$TRACKIO_DIR``; ``online`` needs ``space_id``."""

    mode: str = "disabled"
    project: str | None = None
    name: str | None = None
    space_id: str | None = None


@dataclass
class ConsoleConfig:
    """Per-step table on stdout. ``max_rows`` 0 prints every key."""

    enabled: bool = True
    max_rows: int = 0


@dataclass
class StatsLoggerConfig:
    """The ``stats_logger:`` block. Build it with ``load_config`` to get validation."""

    experiment_name: str
    trial_name: str
    fileroot: str
    wandb: WandBConfig = field(default_factory=WandBConfig)
    swanlab: SwanlabConfig = field(default_factory=SwanlabConfig)
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    trackio: TrackioConfig = field(default_factory=TrackioConfig)
    console: ConsoleConfig = field(default_factory=ConsoleConfig)
    queue_size: int = 1024
    close_timeout: float = 60.0

    def log_dir(self) -> str:
        """``<fileroot>/logs/<user>/<experiment_name>/<trial_name>`` (not created here)."""
        return os.path.join(
            self.fileroot, "logs", getpass.getuser(), self.experiment_name, self.trial_name
        )

    def tensorboard_dir(self) -> str | None:
        """Where TensorBoard events go, or ``None`` when TensorBoard is disabled."""
        path = self.tensorboard.path
        if path is None:
            return None
        return os.path.join(self.log_dir(), "tensorboard") if path == AUTO else path

    def redacted(self) -> dict[str, Any]:
        """This config as plain data with every secret masked (safe to log anywhere)."""
        out = dataclasses.asdict(self)
        for block, key in (("wandb", "wandb_api_key"), ("swanlab", "api_key")):
            if out[block].get(key):
                out[block][key] = REDACTED
        for block in ("wandb", "swanlab"):
            if out[block].get("config") is not None:
                out[block]["config"] = scrub_secrets(out[block]["config"])
        return out


def scrub_secrets(value: Any) -> Any:
    """Copy of ``value`` with mapping entries whose key names a credential masked."""
    if isinstance(value, Mapping):
        return {
            k: (REDACTED if isinstance(k, str) and _SECRET_NAME.search(k) else scrub_secrets(v))
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [scrub_secrets(v) for v in value]
    return value


# ----------------------------------------------------------------------------- validation

_PREFIX = "stats_logger"


def _fail(key: str, msg: str) -> ValueError:
    return ValueError(f"{key}: {msg}")


# Fields whose value must never be echoed, even in an error message about its type.
_SECRET_FIELDS = frozenset({"wandb_api_key", "api_key"})


def _shown(value: Any, key: str) -> str:
    """``repr(value)`` for an error message, or a placeholder when ``key`` names a secret."""
    return REDACTED if key.rsplit(".", 1)[-1] in _SECRET_FIELDS else repr(value)


def _check_str(value: Any, key: str, *, optional: bool) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str):
        want = "a string or null" if optional else "a string"
        raise _fail(key, f"expected {want}, got {type(value).__name__} {_shown(value, key)}")


def _check_field(value: Any, key: str, annotation: str) -> None:
    """Type-check one dataclass field against its (string) annotation."""
    nested = _NESTED_BY_NAME.get(annotation)
    if nested is not None:  # a nested block set programmatically to something else
        if not isinstance(value, nested):
            raise _fail(key, f"expected a {nested.__name__}, got {type(value).__name__}")
    elif annotation == "str":
        _check_str(value, key, optional=False)
    elif annotation == "str | None":
        _check_str(value, key, optional=True)
    elif annotation == "list[str] | None":
        if value is None:
            return
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise _fail(key, f"expected a list of strings or null, got {value!r}")
    elif annotation == "dict[str, Any] | None":
        if value is not None and not isinstance(value, Mapping):
            raise _fail(key, f"expected a mapping or null, got {type(value).__name__}")
    elif annotation == "bool":
        if not isinstance(value, bool):
            raise _fail(key, f"expected true or false, got {value!r}")
    elif annotation == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(key, f"expected an integer, got {value!r}")
    elif annotation == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _fail(key, f"expected a number, got {value!r}")
        if not math.isfinite(value):
            raise _fail(key, f"expected a finite number, got {value!r}")
    else:
        raise AssertionError(f"{key}: no check for annotation {annotation!r}")


def _check_mode(value: str, key: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise _fail(key, f"invalid mode {value!r}; expected one of {', '.join(allowed)}")


def _check_component(value: str, key: str) -> None:
    if not value or value in (".", "..") or "/" in value or os.sep in value:
        raise _fail(key, f"must be a non-empty single path component, got {value!r}")


def validate(config: StatsLoggerConfig) -> StatsLoggerConfig:
    """Check every field of ``config`` (types, modes, ranges); raise ``ValueError`` naming the
    dotted key of the first problem. Returns ``config`` for chaining."""
    if not isinstance(config, StatsLoggerConfig):
        raise TypeError(f"expected a StatsLoggerConfig, got {type(config).__name__}")
    _check_dataclass(config, _PREFIX)
    _check_component(config.experiment_name, f"{_PREFIX}.experiment_name")
    _check_component(config.trial_name, f"{_PREFIX}.trial_name")
    if not config.fileroot:
        raise _fail(f"{_PREFIX}.fileroot", "must be a non-empty path")
    _check_mode(config.wandb.mode, f"{_PREFIX}.wandb.mode", WANDB_MODES)
    _check_mode(config.swanlab.mode, f"{_PREFIX}.swanlab.mode", SWANLAB_MODES)
    _check_mode(config.trackio.mode, f"{_PREFIX}.trackio.mode", TRACKIO_MODES)
    if config.trackio.mode == "online" and not config.trackio.space_id:
        raise _fail(f"{_PREFIX}.trackio.space_id", "is required when trackio.mode is online")
    if config.tensorboard.path == "":
        raise _fail(f"{_PREFIX}.tensorboard.path", "must be a directory, 'auto' or null")
    if config.console.max_rows < 0:
        raise _fail(f"{_PREFIX}.console.max_rows", "must be >= 0")
    if config.queue_size < 1:
        raise _fail(f"{_PREFIX}.queue_size", "must be >= 1")
    if config.close_timeout <= 0:
        raise _fail(f"{_PREFIX}.close_timeout", "must be > 0")
    return config


def _check_dataclass(obj: Any, prefix: str) -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}.{f.name}"
        _check_field(value, key, str(f.type))
        if str(f.type) in _NESTED_BY_NAME:
            _check_dataclass(value, key)


def _build(cls: type, raw: Any, prefix: str) -> Any:
    """Make dataclass ``cls`` from mapping ``raw``, refusing unknown keys by dotted name."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise _fail(prefix, f"expected a mapping, got {type(raw).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for k in raw:
        if k not in fields:
            known = ", ".join(fields)
            raise _fail(f"{prefix}.{k}", f"unknown key (known keys: {known})")
    kwargs: dict[str, Any] = {}
    for name, value in raw.items():
        key = f"{prefix}.{name}"
        f = fields[name]
        sub = _NESTED.get((cls, name))
        if sub is not None:
            if value is None and sub is TensorBoardConfig:
                value = {"path": None}  # `tensorboard: null` disables it, like `path: null`
            kwargs[name] = _build(sub, value, key)
        else:
            _check_field(value, key, str(f.type))
            if isinstance(value, tuple):
                value = list(value)
            if isinstance(value, Mapping):
                value = dict(value)
            if str(f.type) == "float" and isinstance(value, int):
                value = float(value)
            kwargs[name] = value
    return cls(**kwargs)


_NESTED: dict[tuple[type, str], type] = {
    (StatsLoggerConfig, "wandb"): WandBConfig,
    (StatsLoggerConfig, "swanlab"): SwanlabConfig,
    (StatsLoggerConfig, "tensorboard"): TensorBoardConfig,
    (StatsLoggerConfig, "trackio"): TrackioConfig,
    (StatsLoggerConfig, "console"): ConsoleConfig,
}
_NESTED_BY_NAME: dict[str, type] = {cls.__name__: cls for cls in _NESTED.values()}


def load_config(
    source: str | os.PathLike[str] | Mapping[str, Any] | StatsLoggerConfig,
) -> StatsLoggerConfig:
    """Read and validate the ``stats_logger:`` block from a YAML path or a mapping.

    A ``StatsLoggerConfig`` passed in is validated and returned as is.
    """
    if isinstance(source, StatsLoggerConfig):
        return validate(source)
    if isinstance(source, (str, os.PathLike)):
        import yaml  # type: ignore[import-untyped,unused-ignore]

        path = Path(source)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"cannot read config file {str(path)!r}: {e}") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"config file {str(path)!r} is not valid YAML: {e}") from None
    elif isinstance(source, Mapping):
        data = source
    else:
        raise TypeError(
            f"load_config expects a path, a mapping or a StatsLoggerConfig, "
            f"got {type(source).__name__}"
        )
    if not isinstance(data, Mapping):
        raise ValueError(f"{_PREFIX}: expected a mapping at the top level, got {data!r}")
    block = data.get(_PREFIX, data)
    if not isinstance(block, Mapping):
        raise _fail(_PREFIX, f"expected a mapping, got {type(block).__name__}")
    for required in ("experiment_name", "trial_name", "fileroot"):
        if block.get(required) is None:
            raise _fail(f"{_PREFIX}.{required}", "is required")
    config: StatsLoggerConfig = _build(StatsLoggerConfig, block, _PREFIX)
    return validate(config)

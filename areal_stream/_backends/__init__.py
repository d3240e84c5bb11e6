"""Logging backends behind ``StatsLogger`` and a small registry of backend factories.

A factory is ``factory(config, log_dir) -> Backend | None`` (``None``: not enabled by this
config). Built-in factories, in fan-out order: tensorboard, wandb, swanlab, trackio, console.
``register_backend(name, factory)`` adds one (e.g. an in-house tracker, or a test double);
``unregister_backend(name)`` removes it. Factories only construct objects: each backend
imports its library in ``Backend.open()``, on its own worker thread.
"""

from __future__ import annotations

from collections.abc import Callable

from areal_stream._backends._base import Backend, BackendUnavailable, StepRecord, Value
from areal_stream.config import StatsLoggerConfig

__all__ = [
    "Backend",
    "BackendFactory",
    "BackendUnavailable",
    "StepRecord",
    "Value",
    "create_backends",
    "register_backend",
    "registered_backends",
    "unregister_backend",
]

BackendFactory = Callable[[StatsLoggerConfig, str], "Backend | None"]


def _tensorboard(config: StatsLoggerConfig, log_dir: str) -> Backend | None:
    path = config.tensorboard_dir()
    if path is None:
        return None
    from areal_stream._backends.tensorboard_writer import TensorBoardBackend

    return TensorBoardBackend(path)


def _wandb(config: StatsLoggerConfig, log_dir: str) -> Backend | None:
    if config.wandb.mode == "disabled":
        return None
    from areal_stream._backends.wandb_backend import WandbBackend

    return WandbBackend(config, log_dir)


def _swanlab(config: StatsLoggerConfig, log_dir: str) -> Backend | None:
    if config.swanlab.mode == "disabled":
        return None
    from areal_stream._backends.swanlab_backend import SwanlabBackend

    return SwanlabBackend(config, log_dir)


def _trackio(config: StatsLoggerConfig, log_dir: str) -> Backend | None:
    if config.trackio.mode == "disabled":
        return None
    from areal_stream._backends.trackio_backend import TrackioBackend

    return TrackioBackend(config)


def _console(config: StatsLoggerConfig, log_dir: str) -> Backend | None:
    if not config.console.enabled:
        return None
    from areal_stream._backends.console import ConsoleBackend

    return ConsoleBackend(config.console.max_rows)


_REGISTRY: dict[str, BackendFactory] = {
    "tensorboard": _tensorboard,
    "wandb": _wandb,
    "swanlab": _swanlab,
    "trackio": _trackio,
    "console": _console,
}
BUILTIN = tuple(_REGISTRY)


def register_backend(name: str, factory: BackendFactory) -> None:
    """Add a backend factory under ``name`` (``ValueError`` if the name is taken)."""
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(f"backend name must be a non-empty string without '/', got {name!r}")
    if name in _REGISTRY:
        raise ValueError(f"a backend named {name!r} is already registered")
    if not callable(factory):
        raise TypeError(f"factory for {name!r} must be callable")
    _REGISTRY[name] = factory


def unregister_backend(name: str) -> None:
    """Remove a backend added with ``register_backend`` (built-ins cannot be removed)."""
    if name in BUILTIN:
        raise ValueError(f"{name!r} is a built-in backend")
    _REGISTRY.pop(name, None)


def registered_backends() -> list[str]:
    return list(_REGISTRY)


def create_backends(
    config: StatsLoggerConfig, log_dir: str, only: set[str] | None = None
) -> list[tuple[str, Backend]]:
    """``(name, backend)`` for every registered backend this config enables (restricted to
    ``only`` when given), in registry order."""
    out: list[tuple[str, Backend]] = []
    for name, factory in list(_REGISTRY.items()):
        if only is not None and name not in only:
            continue
        backend = factory(config, log_dir)
        if backend is not None:
            out.append((name, backend))
    return out

"""Estimated training FLOPs per sequence, by model architecture (``areal.utils.flops``).

A *factory* takes a model config and returns ``f(sequence_length: int) -> float``: the
training FLOPs (forward + backward) of one sequence of that many tokens. A packed batch
sums ``f(L_i)`` over its sequences; never call ``f`` once with the total length, since
attention grows with ``L * (L + 1)``.

Built in: ``qwen3_moe`` (Qwen3-30B-A3B) and ``qwen3_5_moe`` / ``qwen3_5_moe_text``
(Qwen3.5-35B-A3B); see :mod:`areal_stream._flops_qwen` for what is counted. Register
custom factories on every training worker before its engine starts::

    from areal_stream.flops import register_flops_estimator
    register_flops_estimator("my_model_type", my_factory)
"""

from __future__ import annotations

import json
import math
import numbers
import os
import threading
from collections.abc import Callable
from typing import Any

from areal_stream._flops_qwen import cfg_get, qwen3_5_moe_factory, qwen3_moe_factory

FlopsEstimator = Callable[[int], float]
FlopsFactory = Callable[[Any], FlopsEstimator]

__all__ = [
    "FlopsEstimator",
    "FlopsFactory",
    "check_flops_value",
    "check_sequence_length",
    "get_flops_estimator",
    "register_flops_estimator",
    "registered_model_types",
]

_lock = threading.Lock()
_FACTORIES: dict[str, FlopsFactory] = {
    "qwen3_moe": qwen3_moe_factory,
    "qwen3_5_moe": qwen3_5_moe_factory,
    "qwen3_5_moe_text": qwen3_5_moe_factory,
}


def register_flops_estimator(model_type: str, factory: FlopsFactory) -> None:
    """Register ``factory`` for configs whose ``model_type`` is ``model_type``.

    Registering a name again replaces the previous factory (built-ins included).
    """
    if not isinstance(model_type, str) or not model_type:
        raise TypeError(f"model_type must be a non-empty str, got {model_type!r}")
    if not callable(factory):
        raise TypeError(f"factory for {model_type!r} must be callable, got {factory!r}")
    with _lock:
        _FACTORIES[model_type] = factory


def registered_model_types() -> list[str]:
    """The model types that currently have a factory, sorted."""
    with _lock:
        return sorted(_FACTORIES)


def check_sequence_length(sequence_length: Any) -> int:
    """Return ``sequence_length`` as an int; it must be a non-negative integer, not a bool."""
    if isinstance(sequence_length, bool) or not isinstance(sequence_length, numbers.Integral):
        raise TypeError(
            f"sequence_length must be a non-negative int, got {type(sequence_length).__name__} "
            f"{sequence_length!r}"
        )
    length = int(sequence_length)
    if length < 0:
        raise ValueError(f"sequence_length must be >= 0, got {length}")
    return length


def check_flops_value(value: Any, sequence_length: int) -> float:
    """Return an estimate as a float; non-numbers, NaN, inf and negatives are errors."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"FLOPs estimate for sequence length {sequence_length} must be a real number, "
            f"got {type(value).__name__} {value!r}"
        )
    flops = float(value)
    if not math.isfinite(flops) or flops < 0:
        raise ValueError(
            f"FLOPs estimate for sequence length {sequence_length} must be finite and >= 0, "
            f"got {flops!r}"
        )
    return flops


def _load_config(config: Any) -> Any:
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"no model config at {path!r} (expected a model directory "
                "holding config.json, or a config.json file)"
            )
        with open(path, encoding="utf-8") as f:
            loaded = json.load(f)
        if not isinstance(loaded, dict):
            raise ValueError(f"{path!r} does not hold a JSON object")
        return loaded
    if config is None or isinstance(config, (bytes, int, float, bool)):
        raise TypeError(
            "config must be a dict, a config object with attributes, or a path to a model "
            f"directory; got {type(config).__name__}"
        )
    return config


def get_flops_estimator(config: Any) -> FlopsEstimator | None:
    """The training-FLOPs function for ``config``, or None when its model type is unregistered.

    ``config`` may be a dict, an object with attributes (e.g. a transformers config) or a
    path to a local model directory holding ``config.json`` (any directory name). The
    factory is looked up by the top-level ``model_type``, then by ``text_config``'s; it is
    given ``text_config`` when present (the text backbone is what is estimated), else the
    config itself. The returned function checks its argument (a non-negative int; bool
    refused) and its result (a finite, non-negative number).
    """
    cfg = _load_config(config)
    text = cfg_get(cfg, "text_config", None)
    candidates = [cfg_get(cfg, "model_type", None)]
    if text is not None:
        candidates.append(cfg_get(text, "model_type", None))
    with _lock:
        factory = next((_FACTORIES[t] for t in candidates if t in _FACTORIES), None)
    if factory is None:
        return None
    raw = factory(text if text is not None else cfg)
    if not callable(raw):
        raise TypeError(f"FLOPs factory for {candidates[0]!r} returned {raw!r}, not a function")

    def estimate(sequence_length: int) -> float:
        length = check_sequence_length(sequence_length)
        return check_flops_value(raw(length), length)

    estimate.__doc__ = f"Training FLOPs of one sequence ({candidates[0]})."
    return estimate

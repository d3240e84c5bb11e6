"""Independent float64 reference for ``areal_stream.training_metrics`` (test helper).

Written from the issue text with plain Python loops over numpy arrays and ``math``, sharing
no code with the implementation: each function takes a list of batches (pooled as one
export window, across batches and ranks) and returns the exported dict (relative keys).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

THRESHOLDS = ("1.5", "2", "3", "5", "10")

Batch = tuple[np.ndarray, ...]


def _isfinite(x: float) -> bool:
    return not (math.isnan(x) or math.isinf(x))


def _k3(d: float) -> float:
    try:
        return math.expm1(d) - d
    except OverflowError:
        return math.inf


def _mean(xs: list[float]) -> float:
    return math.fsum(xs) / len(xs) if not any(math.isinf(x) for x in xs) else sum(xs) / len(xs)


def train_infer(batches: Iterable[Batch]) -> dict[str, float]:
    """Batches of ``(trainer_logp, rollout_logp, mask)`` as float64/bool numpy arrays."""
    n_valid = 0
    diffs: list[float] = []
    t_nll: list[float] = []
    r_nll: list[float] = []
    n_bad = 0
    n_overflow = 0
    tails = dict.fromkeys(THRESHOLDS, 0)
    for t_arr, r_arr, m_arr in batches:
        for t, r, m in zip(t_arr.ravel().tolist(), r_arr.ravel().tolist(), m_arr.ravel().tolist()):
            if not m:
                continue
            n_valid += 1
            if not (_isfinite(t) and _isfinite(r)):
                n_bad += 1
                continue
            d = t - r
            diffs.append(d)
            t_nll.append(-t)
            r_nll.append(-r)
            if math.isinf(_k3(d)):
                n_overflow += 1
            for name in THRESHOLDS:
                if abs(d) > math.log(float(name)):
                    tails[name] += 1
    out: dict[str, float] = {
        "train_infer/n_valid_tokens": float(n_valid),
        "train_infer/n_finite_tokens": float(len(diffs)),
    }
    if diffs:
        absd = [abs(d) for d in diffs]
        out.update(
            {
                "train_infer/logp_diff/avg": _mean(diffs),
                "train_infer/logp_diff/min": min(diffs),
                "train_infer/logp_diff/max": max(diffs),
                "train_infer/logp_abs_diff/avg": _mean(absd),
                "train_infer/logp_abs_diff/min": min(absd),
                "train_infer/logp_abs_diff/max": max(absd),
                "train_infer/logp_diff_squared": _mean([d * d for d in diffs]),
                "train_infer/trainer_nll": _mean(t_nll),
                "train_infer/rollout_nll": _mean(r_nll),
                "train_infer/kl_k1": _mean([-d for d in diffs]),
                "train_infer/kl_k2": _mean([d * d / 2 for d in diffs]),
                "train_infer/kl_k3": _mean([_k3(d) for d in diffs]),
            }
        )
    if n_valid:
        out["train_infer/nonfinite_logp_fraction"] = n_bad / n_valid
        out["train_infer/kl_k3_overflow_fraction"] = n_overflow / n_valid
        for name in THRESHOLDS:
            out[f"train_infer/ratio_outside_{name}"] = math.nan if n_bad else tails[name] / n_valid
    return out


def advantage_signs(batches: Iterable[Batch]) -> dict[str, float]:
    """Batches of ``(advantages, loss_mask)``."""
    counts = {"positive": 0, "negative": 0, "zero": 0}
    n = 0
    any_nan = False
    for a_arr, m_arr in batches:
        for a, m in zip(a_arr.ravel().tolist(), m_arr.ravel().tolist()):
            if not m:
                continue
            n += 1
            if math.isnan(a):
                any_nan = True
            elif a > 0:
                counts["positive"] += 1
            elif a < 0:
                counts["negative"] += 1
            else:
                counts["zero"] += 1
    out: dict[str, float] = {"advantage_n_valid_tokens": float(n)}
    if n:
        for k, c in counts.items():
            out[f"advantage_{k}_fraction"] = math.nan if any_nan else c / n
    return out


def version_staleness(batches: Iterable[tuple[np.ndarray, np.ndarray, int]]) -> dict[str, float]:
    """Batches of ``(versions, loss_mask, current_version)``; rows along the last axis."""
    ages: list[float] = []
    for v_arr, m_arr, current in batches:
        width = v_arr.shape[-1]
        rows_v = v_arr.reshape(-1, width).tolist()
        rows_m = m_arr.reshape(-1, width).tolist()
        for vs, ms in zip(rows_v, rows_m):
            for j in range(width):
                behaviour = vs[j + 1] if j + 1 < width else -1
                if ms[j] and behaviour >= 0:
                    ages.append(float(current - behaviour))
    out: dict[str, float] = {"version_stats/n_valid_generated_tokens": float(len(ages))}
    if ages:
        for kind in ("theta", "proximal"):
            out[f"version_stats/sample_staleness_{kind}_avg"] = _mean(ages)
            out[f"version_stats/sample_staleness_{kind}_min"] = min(ages)
            out[f"version_stats/sample_staleness_{kind}_max"] = max(ages)
        out["version_stats/stale_token_fraction"] = sum(a > 0 for a in ages) / len(ages)
        out["version_stats/future_token_fraction"] = sum(a < 0 for a in ages) / len(ages)
    return out

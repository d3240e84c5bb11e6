"""Computation behind ``areal_stream.training_metrics`` (see that module for the contract).

Everything here works on whole tensors with ``torch.where`` and elementwise ops, in float64,
and hands the tracker one masked tensor per key: no ``.item()``, no boolean-mask indexing,
no Python branch on a tensor value, so nothing waits for the device before export.
Values outside a key's population are zeroed with ``where`` before recording, so a NaN or
inf in padding cannot reach a sum even through a ``value * mask`` reduction.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from areal_stream import stats_tracker
from areal_stream.stats_tracker import ReduceType

RATIO_THRESHOLDS: tuple[float, ...] = (1.5, 2.0, 3.0, 5.0, 10.0)
"""Probability-ratio tail thresholds; key ``ratio_outside_{t:g}`` counts ``|d| > ln t``."""


def ratio_key(threshold: float) -> str:
    """``ratio_outside_1.5``, ``ratio_outside_2``, ... (``:g`` drops a trailing ``.0``)."""
    return f"ratio_outside_{threshold:g}"


# --------------------------------------------------------------------------- validation


def _require_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def require_float(name: str, value: object) -> torch.Tensor:
    """A floating-point tensor (any float dtype), else ``TypeError`` naming ``name``."""
    t = _require_tensor(name, value)
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    return t


def require_bool(name: str, value: object) -> torch.Tensor:
    """A ``torch.bool`` tensor, else ``TypeError`` (an int/float mask is ambiguous)."""
    t = _require_tensor(name, value)
    if t.dtype != torch.bool:
        raise TypeError(
            f"{name} must be a torch.bool tensor, got dtype {t.dtype} (pass {name}.bool())"
        )
    return t


def require_signed_int(name: str, value: object) -> torch.Tensor:
    """A signed integer tensor (-1 must be representable), else ``TypeError``."""
    t = _require_tensor(name, value)
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex() or not t.dtype.is_signed:
        raise TypeError(f"{name} must be a signed integer tensor, got dtype {t.dtype}")
    return t


def require_same(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
    """Shapes (and devices) must agree, else ``ValueError`` listing each argument's."""
    shapes = [tuple(t.shape) for t in tensors]
    if any(s != shapes[0] for s in shapes):
        listed = ", ".join(f"{n}={s}" for n, s in zip(names, shapes))
        raise ValueError(f"shapes must match: {listed}")
    devices = [t.device for t in tensors]
    if any(d != devices[0] for d in devices):
        listed = ", ".join(f"{n} on {d}" for n, d in zip(names, devices))
        raise ValueError(f"tensors must be on one device: {listed}")


def _flat(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """1-D views; an empty batch becomes one masked-out element (the last tensor is the mask).

    The tracker wants non-empty denominators; a single ``False`` position records the same
    thing as an empty batch (count 0, averages omitted) and keeps the key set stable.
    Only shapes are inspected, never values.
    """
    if tensors[0].numel() == 0:
        *values, mask = tensors
        return [torch.zeros(1, dtype=v.dtype, device=v.device) for v in values] + [
            torch.zeros(1, dtype=torch.bool, device=mask.device)
        ]
    return [t.detach().reshape(-1) for t in tensors]


# --------------------------------------------------------------------------- diagnostics


def train_infer(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> None:
    """Record the ``train_infer/`` group (inputs already validated)."""
    t, r, valid = _flat(trainer_logp, rollout_logp, mask)
    t = t.to(torch.float64)
    r = r.to(torch.float64)
    finite = torch.isfinite(t) & torch.isfinite(r)
    ok = valid & finite  # the population of every d-based statistic
    bad = valid & ~finite
    d = torch.where(ok, t - r, 0.0)
    abs_d = d.abs()
    d_sq = d.square()
    k3 = torch.expm1(d) - d  # 0 outside ``ok`` since d = 0 there
    overflow = ok & ~torch.isfinite(k3)
    zero = torch.zeros((), dtype=torch.float64, device=d.device)
    nan = torch.full((), math.nan, dtype=torch.float64, device=d.device)

    with stats_tracker.scope("train_infer"):
        stats_tracker.denominator(n_valid_tokens=valid, n_finite_tokens=ok)
        stats_tracker.stat_compact(
            "n_finite_tokens", ReduceType.AVG_MIN_MAX, logp_diff=d, logp_abs_diff=abs_d
        )
        stats_tracker.stat_compact(
            "n_finite_tokens",
            ReduceType.AVG,
            logp_diff_squared=d_sq,
            trainer_nll=torch.where(ok, -t, zero),
            rollout_nll=torch.where(ok, -r, zero),
            kl_k1=-d,
            kl_k2=d_sq * 0.5,
            kl_k3=k3,
        )
        tails: dict[str, torch.Tensor] = {}
        for threshold in RATIO_THRESHOLDS:
            outside = (ok & (abs_d > math.log(threshold))).to(torch.float64)
            # NaN on a valid non-finite token: a NaN comparison is False and would
            # otherwise report a corrupt batch as a healthy zero tail.
            tails[ratio_key(threshold)] = torch.where(bad, nan, outside)
        stats_tracker.stat_compact(
            "n_valid_tokens",
            ReduceType.AVG,
            nonfinite_logp_fraction=bad.to(torch.float64),
            kl_k3_overflow_fraction=overflow.to(torch.float64),
            **tails,
        )


def advantage_signs(advantages: torch.Tensor, loss_mask: torch.Tensor) -> None:
    """Record ``advantage_{positive,negative,zero}_fraction`` (inputs already validated).

    A NaN advantage on a valid token is neither positive, negative nor zero; rather than
    let the three fractions quietly sum to less than 1, it makes all three NaN (like the
    ratio tails). +-inf count as positive/negative.
    """
    a, valid = _flat(advantages, loss_mask)
    bad = valid & torch.isnan(a)
    nan = torch.full((), math.nan, dtype=torch.float64, device=a.device)

    def share(hit: torch.Tensor) -> torch.Tensor:
        return torch.where(bad, nan, (valid & hit).to(torch.float64))

    stats_tracker.denominator(advantage_n_valid_tokens=valid)
    stats_tracker.stat_compact(
        "advantage_n_valid_tokens",
        ReduceType.AVG,
        advantage_positive_fraction=share(a > 0),
        advantage_negative_fraction=share(a < 0),
        advantage_zero_fraction=share(a == 0),
    )


def shift_versions(versions: torch.Tensor) -> torch.Tensor:
    """Versions moved left one position along the last dim; the last position gets -1."""
    shifted = torch.full_like(versions, -1)
    shifted[..., :-1] = versions[..., 1:]
    return shifted


def version_staleness(
    versions: torch.Tensor, loss_mask: torch.Tensor, current_version: int
) -> None:
    """Record the ``version_stats/`` group (inputs already validated)."""
    shifted = shift_versions(versions.detach())
    v, valid = _flat(shifted, loss_mask)
    valid = valid & (v >= 0)
    staleness = torch.where(valid, float(current_version) - v.to(torch.float64), 0.0)
    with stats_tracker.scope("version_stats"):
        stats_tracker.denominator(n_valid_generated_tokens=valid)
        # The spec's names end in ``_avg``/``_min``/``_max`` (not ``/avg``), so each is
        # its own key with the matching reduce type rather than one AVG_MIN_MAX key.
        for rtype, suffix in (
            (ReduceType.AVG, "avg"),
            (ReduceType.MIN, "min"),
            (ReduceType.MAX, "max"),
        ):
            stats_tracker.stat_compact(
                "n_valid_generated_tokens",
                rtype,
                **{
                    f"sample_staleness_theta_{suffix}": staleness,
                    f"sample_staleness_proximal_{suffix}": staleness,
                },
            )
        stats_tracker.stat_compact(
            "n_valid_generated_tokens",
            ReduceType.AVG,
            stale_token_fraction=(valid & (staleness > 0)).to(torch.float64),
            future_token_fraction=(valid & (staleness < 0)).to(torch.float64),
        )

"""Training diagnostics of a PPO update, recorded through the default stats tracker.

Three functions a PPO implementation calls on its batch tensors. Each records under the
caller's current ``stats_tracker.scope`` with ``denominator`` + ``stat_compact``, so every
key keeps four float64 numbers per batch until export (never a whole tensor), streams,
all-reduces and logs like any other stat, and nothing forces a device-to-host sync before
export. All arithmetic is float64; inputs are detached. The spec's key names assume::

    with stats_tracker.scope("ppo_actor"):
        log_train_infer_diagnostics(trainer_logp, rollout_logp, generation_mask)
        log_advantage_sign_fractions(advantages, loss_mask)
        with stats_tracker.scope("update"):
            log_version_staleness(versions, loss_mask, current_version)

Keys (relative to the caller's scope)
-------------------------------------
``train_infer/`` with ``d = trainer_logp - rollout_logp``:

* ``n_valid_tokens`` (SUM): tokens in ``mask``.
* ``n_finite_tokens`` (SUM): valid tokens with both logps finite. This is the population
  of every d-based statistic below (an addition to the spec's keys: the denominator the
  tracker needs, exported so the population is visible).
* ``logp_diff/{avg,min,max}``, ``logp_abs_diff/{avg,min,max}``; token means
  ``logp_diff_squared`` (d^2), ``trainer_nll``, ``rollout_nll``, ``kl_k1`` (-d),
  ``kl_k2`` (d^2/2), ``kl_k3`` (expm1(d) - d): over the finite population. One -inf
  logprob from an engine therefore does not turn the whole window (and, after the
  all-reduce, every rank's value) into inf/NaN; it is reported by
  ``nonfinite_logp_fraction`` instead, and the ratio tails turn NaN. Using one population
  keeps ``kl_k1 == trainer_nll - rollout_nll``.
  A finite d whose float64 ``expm1(d) - d`` overflows contributes +inf to ``kl_k3`` (the
  true value is beyond float64; dropping it would understate the KL) and is counted in
  ``kl_k3_overflow_fraction``.
* ``ratio_outside_{1.5,2,3,5,10}``: fraction of valid tokens with ``|d| > ln(t)``; NaN
  when any valid token has a non-finite logp (never a healthy-looking zero).
* ``nonfinite_logp_fraction``, ``kl_k3_overflow_fraction``: fractions of valid tokens.

``advantage_{positive,negative,zero}_fraction`` over ``loss_mask`` (denominator
``advantage_n_valid_tokens``, SUM, also exported). A NaN advantage on a valid token makes
all three NaN.

``version_stats/`` (versions shifted left one position, last position -1; a token counts
when masked and its shifted version is >= 0; staleness = current_version - version):
``sample_staleness_{theta,proximal}_{avg,min,max}`` (identical: both use the latest
published checkpoint), ``stale_token_fraction`` (staleness > 0),
``future_token_fraction`` (staleness < 0), ``n_valid_generated_tokens`` (SUM).

Averages with no valid token, and min/max with none, are omitted at export (the tracker's
rule), never filled with zero; SUM counts are always exported. Masked-out positions never
contribute, whatever they hold (NaN/inf padding included). Bad types raise ``TypeError``
naming the argument; mismatched shapes or devices raise ``ValueError``.
"""

from __future__ import annotations

import numbers

import torch

from areal_stream import _training_diag as _impl

__all__ = [
    "RATIO_THRESHOLDS",
    "log_advantage_sign_fractions",
    "log_train_infer_diagnostics",
    "log_version_staleness",
]

RATIO_THRESHOLDS = _impl.RATIO_THRESHOLDS


def log_train_infer_diagnostics(
    trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor
) -> None:
    """Compare recomputed trainer logprobs with the rollout engine's, under ``train_infer/``.

    ``trainer_logp``/``rollout_logp``: floating tensors of one shape (next-token aligned);
    ``mask``: bool tensor of that shape, the generation mask before rejection/advantage
    masking.
    """
    t = _impl.require_float("trainer_logp", trainer_logp)
    r = _impl.require_float("rollout_logp", rollout_logp)
    m = _impl.require_bool("mask", mask)
    _impl.require_same(("trainer_logp", "rollout_logp", "mask"), (t, r, m))
    _impl.train_infer(t, r, m)


def log_advantage_sign_fractions(advantages: torch.Tensor, loss_mask: torch.Tensor) -> None:
    """Token fractions of positive / negative / zero advantages over ``loss_mask``."""
    a = _impl.require_float("advantages", advantages)
    m = _impl.require_bool("loss_mask", loss_mask)
    _impl.require_same(("advantages", "loss_mask"), (a, m))
    _impl.advantage_signs(a, m)


def log_version_staleness(
    versions: torch.Tensor, loss_mask: torch.Tensor, current_version: int
) -> None:
    """Checkpoint age of the behaviour policy per generated token, under ``version_stats/``.

    ``versions``: signed integer tensor of each token's behaviour-policy version in token
    positions (-1 for prompt tokens), at least 1-D; ``loss_mask``: bool tensor of that
    shape in prediction positions; ``current_version``: the latest published version.
    """
    v = _impl.require_signed_int("versions", versions)
    m = _impl.require_bool("loss_mask", loss_mask)
    if isinstance(current_version, bool) or not isinstance(current_version, numbers.Integral):
        raise TypeError(f"current_version must be an int, got {type(current_version).__name__}")
    _impl.require_same(("versions", "loss_mask"), (v, m))
    if v.dim() == 0:
        raise ValueError("versions must have at least one dimension (positions), got a 0-d tensor")
    _impl.version_staleness(v, m, int(current_version))

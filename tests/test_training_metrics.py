"""areal_stream.training_metrics against an independent float64 reference (tests/_diag_reference).

Each scenario records through the real default tracker inside the spec's scopes, exports,
and compares every key (and the exact key set) to the reference on the same data.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import _diag_reference as ref
import numpy as np
import pytest
import torch
from _dist import run_ranks

from areal_stream import _training_diag, stats_tracker
from areal_stream.training_metrics import (
    log_advantage_sign_fractions,
    log_train_infer_diagnostics,
    log_version_staleness,
)

ACTOR = "ppo_actor/"
UPDATE = "ppo_actor/update/"


@pytest.fixture(autouse=True)
def _clean_tracker() -> Iterator[None]:
    stats_tracker.export()
    yield
    stats_tracker.export()


def _np(t: torch.Tensor) -> np.ndarray:
    """Exactly the float64 values the implementation sees (after its own upcast)."""
    if t.dtype == torch.bool:
        return t.numpy().copy()
    if t.is_floating_point():
        return t.to(torch.float64).numpy().copy()
    return t.numpy().copy()


def _under(out: dict[str, Any], prefix: str, group: str) -> dict[str, float]:
    full = prefix + group
    return {k[len(prefix) :]: float(v) for k, v in out.items() if k.startswith(full)}


def assert_matches(got: dict[str, float], want: dict[str, float]) -> None:
    assert sorted(got) == sorted(want), (sorted(set(got) ^ set(want)), got, want)
    for k, w in want.items():
        g = got[k]
        if math.isnan(w):
            assert math.isnan(g), (k, g)
        elif math.isinf(w):
            assert g == w, (k, g, w)
        elif k.endswith(("/min", "/max", "_min", "_max", "n_valid_tokens", "_tokens")):
            assert g == w, (k, g, w)  # extrema and counts are exact
        else:
            assert g == pytest.approx(w, rel=1e-12, abs=1e-13), (k, g, w)


def assert_same(a: dict[str, float], b: dict[str, float]) -> None:
    """Identical dicts, NaN equal to NaN (every rank must get the same export)."""
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])), (k, a[k], b[k])


# ----------------------------------------------------------------------------- data


def logp_batch(
    gen: torch.Generator, rows: int, cols: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded batch with per-row lengths; padding holds NaN/inf garbage."""
    t = -torch.rand(rows, cols, generator=gen, dtype=torch.float64) * 6
    r = t + torch.randn(rows, cols, generator=gen, dtype=torch.float64) * 0.8
    lengths = torch.randint(0, cols + 1, (rows,), generator=gen)
    mask = torch.arange(cols)[None, :] < lengths[:, None]
    t = torch.where(mask, t, torch.tensor(math.nan, dtype=torch.float64))
    r = torch.where(mask, r, torch.tensor(-math.inf, dtype=torch.float64))
    return t.to(dtype), r.to(dtype), mask


def with_specials(
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Put non-finite logps and a k3 overflow (d = 800) on valid tokens."""
    t, r, mask = (x.clone() for x in batch)
    t = t.to(torch.float64)
    r = r.to(torch.float64)
    mask[0, :4] = True
    t[0, 0], r[0, 0] = -math.inf, -1.0
    t[0, 1], r[0, 1] = -2.0, math.nan
    t[0, 2], r[0, 2] = -1.0, -801.0  # d = 800: finite, expm1 overflows float64
    t[0, 3], r[0, 3] = -1.0, -101.0  # d = 100: large but k3 finite
    return t, r, mask


def adv_batch(gen: torch.Generator, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.randn(rows, cols, generator=gen)
    a = torch.where(torch.rand(rows, cols, generator=gen) < 0.2, 0.0, a)
    mask = torch.rand(rows, cols, generator=gen) < 0.7
    a = torch.where(mask, a, torch.tensor(math.nan))  # padding garbage
    return a, mask


def version_batch(
    gen: torch.Generator, rows: int, cols: int, prompt: int
) -> tuple[torch.Tensor, torch.Tensor]:
    v = torch.randint(0, 9, (rows, cols), generator=gen)
    v[:, :prompt] = -1
    mask = torch.zeros(rows, cols, dtype=torch.bool)
    mask[:, prompt - 1 : cols - 1] = torch.rand(rows, cols - prompt, generator=gen) < 0.9
    return v, mask


def record_all(
    seed: int, n_batches: int, specials: bool, current_version: int
) -> tuple[list[Any], list[Any], list[Any]]:
    """Record several batches of every diagnostic; return the numpy data for the reference."""
    gen = torch.Generator().manual_seed(seed)
    ti, adv, ver = [], [], []
    with stats_tracker.scope("ppo_actor"):
        for i in range(n_batches):
            rows, cols = 3 + i, 17 + 5 * i  # shapes differ between batches
            b = logp_batch(gen, rows, cols)
            if specials and i == 1:
                b = with_specials(b)
            log_train_infer_diagnostics(*b)
            ti.append(tuple(_np(x) for x in b))
            a, am = adv_batch(gen, rows, cols)
            log_advantage_sign_fractions(a, am)
            adv.append((_np(a), _np(am)))
            with stats_tracker.scope("update"):
                v, vm = version_batch(gen, rows, cols, prompt=4)
                log_version_staleness(v, vm, current_version)
                ver.append((_np(v), _np(vm), current_version))
    return ti, adv, ver


def check_all(out: dict[str, Any], ti: list[Any], adv: list[Any], ver: list[Any]) -> None:
    assert_matches(_under(out, ACTOR, "train_infer/"), ref.train_infer(ti))
    assert_matches(_under(out, ACTOR, "advantage_"), ref.advantage_signs(adv))
    assert_matches(_under(out, UPDATE, "version_stats/"), ref.version_staleness(ver))


# ----------------------------------------------------------------------------- single process


def test_every_key_matches_reference_over_several_batches() -> None:
    ti, adv, ver = record_all(seed=1, n_batches=3, specials=False, current_version=6)
    out = stats_tracker.export()
    check_all(out, ti, adv, ver)
    # The spec's full key set is present (finite data, valid tokens everywhere).
    for key in [
        "train_infer/logp_diff/avg",
        "train_infer/logp_abs_diff/max",
        "train_infer/kl_k3",
        "train_infer/ratio_outside_1.5",
        "train_infer/ratio_outside_10",
        "advantage_zero_fraction",
        "update/version_stats/sample_staleness_proximal_min",
        "update/version_stats/future_token_fraction",
    ]:
        assert ACTOR + key in out
    d = _under(out, ACTOR, "train_infer/")
    assert d["train_infer/kl_k1"] == pytest.approx(
        d["train_infer/trainer_nll"] - d["train_infer/rollout_nll"], rel=1e-12, abs=1e-12
    )
    fr = _under(out, ACTOR, "advantage_")
    assert sum(v for k, v in fr.items() if k.endswith("fraction")) == pytest.approx(1.0)
    assert 0 < d["train_infer/ratio_outside_1.5"] < 1


def test_nonfinite_logps_and_k3_overflow() -> None:
    ti, adv, ver = record_all(seed=2, n_batches=3, specials=True, current_version=3)
    out = stats_tracker.export()
    check_all(out, ti, adv, ver)
    d = _under(out, ACTOR, "train_infer/")
    assert d["train_infer/n_valid_tokens"] - d["train_infer/n_finite_tokens"] == 2
    assert d["train_infer/nonfinite_logp_fraction"] == 2 / d["train_infer/n_valid_tokens"]
    assert d["train_infer/kl_k3_overflow_fraction"] == 1 / d["train_infer/n_valid_tokens"]
    assert d["train_infer/kl_k3"] == math.inf
    assert all(math.isnan(d[f"train_infer/ratio_outside_{t}"]) for t in ref.THRESHOLDS)
    # Finite-only stats stay finite: one bad token does not erase the window.
    assert math.isfinite(d["train_infer/logp_diff/avg"])
    assert d["train_infer/logp_diff/max"] == 800.0
    assert math.isfinite(d["train_infer/kl_k2"])


def test_large_finite_gap_keeps_k3_finite() -> None:
    t = torch.tensor([-1.0, -3.0])
    r = torch.tensor([-101.0, -3.0])
    with stats_tracker.scope("ppo_actor"):
        log_train_infer_diagnostics(t, r, torch.tensor([True, True]))
    d = _under(stats_tracker.export(), ACTOR, "train_infer/")
    assert d["train_infer/kl_k3_overflow_fraction"] == 0
    assert d["train_infer/kl_k3"] == pytest.approx((math.expm1(100) - 100) / 2, rel=1e-12)
    assert d["train_infer/ratio_outside_10"] == 0.5


def test_empty_masks_omit_averages_and_count_zero() -> None:
    gen = torch.Generator().manual_seed(3)
    t, r, _ = logp_batch(gen, 2, 9)
    a, _ = adv_batch(gen, 2, 9)
    v, _ = version_batch(gen, 2, 9, prompt=3)
    none = torch.zeros(2, 9, dtype=torch.bool)
    with stats_tracker.scope("ppo_actor"):
        log_train_infer_diagnostics(t, r, none)
        log_train_infer_diagnostics(torch.empty(0, 5), torch.empty(0, 5), torch.empty(0, 5).bool())
        log_advantage_sign_fractions(a, none)
        log_advantage_sign_fractions(torch.empty(0), torch.empty(0, dtype=torch.bool))
        with stats_tracker.scope("update"):
            log_version_staleness(v, none, 5)
            # masked but every shifted version is -1 (all prompt): no valid generated token
            log_version_staleness(torch.full((2, 9), -1), ~none, 5)
            log_version_staleness(torch.empty(3, 0, dtype=torch.long), torch.empty(3, 0).bool(), 5)
    out = stats_tracker.export()
    assert _under(out, ACTOR, "train_infer/") == {
        "train_infer/n_valid_tokens": 0.0,
        "train_infer/n_finite_tokens": 0.0,
    }
    assert _under(out, ACTOR, "advantage_") == {"advantage_n_valid_tokens": 0.0}
    assert _under(out, UPDATE, "version_stats/") == {"version_stats/n_valid_generated_tokens": 0.0}


def test_empty_batch_pools_with_nonempty_batch() -> None:
    """An all-masked batch adds nothing to the weights, min or max of the window."""
    gen = torch.Generator().manual_seed(4)
    b = logp_batch(gen, 4, 11)
    v, vm = version_batch(gen, 4, 11, prompt=3)
    with stats_tracker.scope("ppo_actor"):
        log_train_infer_diagnostics(b[0], b[1], torch.zeros_like(b[2]))
        log_train_infer_diagnostics(*b)
        with stats_tracker.scope("update"):
            log_version_staleness(v, torch.zeros_like(vm), 100)
            log_version_staleness(v, vm, 9)
    out = stats_tracker.export()
    assert_matches(_under(out, ACTOR, "train_infer/"), ref.train_infer([tuple(_np(x) for x in b)]))
    assert_matches(
        _under(out, UPDATE, "version_stats/"), ref.version_staleness([(_np(v), _np(vm), 9)])
    )


def test_version_shift_and_future_tokens() -> None:
    # token positions:      0   1  2  3  4   (prompt = positions 0, 1)
    v = torch.tensor([[-1, -1, 4, 7, 2]])
    m = torch.tensor([[False, True, True, True, True]])  # prediction positions
    with stats_tracker.scope("ppo_actor"), stats_tracker.scope("update"):
        log_version_staleness(v, m, 5)
    got = _under(stats_tracker.export(), UPDATE, "version_stats/")
    # predictions at 1, 2, 3 read versions 4, 7, 2; position 4 reads the -1 pad.
    ages = [1.0, -2.0, 3.0]
    assert got["version_stats/n_valid_generated_tokens"] == 3
    assert got["version_stats/sample_staleness_theta_avg"] == pytest.approx(sum(ages) / 3)
    assert got["version_stats/sample_staleness_proximal_min"] == -2.0
    assert got["version_stats/sample_staleness_theta_max"] == 3.0
    assert got["version_stats/stale_token_fraction"] == pytest.approx(2 / 3)
    assert got["version_stats/future_token_fraction"] == pytest.approx(1 / 3)
    assert_matches(got, ref.version_staleness([(_np(v), _np(m), 5)]))


def test_one_dimensional_packed_and_three_dimensional_inputs() -> None:
    gen = torch.Generator().manual_seed(5)
    t, r, m = logp_batch(gen, 4, 10)
    v, vm = version_batch(gen, 6, 10, prompt=2)
    with stats_tracker.scope("ppo_actor"):
        log_train_infer_diagnostics(t.reshape(-1), r.reshape(-1), m.reshape(-1))
        log_train_infer_diagnostics(t.reshape(2, 2, 10), r.reshape(2, 2, 10), m.reshape(2, 2, 10))
        with stats_tracker.scope("update"):
            log_version_staleness(v.reshape(2, 3, 10), vm.reshape(2, 3, 10), 8)
            log_version_staleness(v[0], vm[0], 8)
    out = stats_tracker.export()
    np_b = tuple(_np(x) for x in (t, r, m))
    assert_matches(_under(out, ACTOR, "train_infer/"), ref.train_infer([np_b, np_b]))
    assert_matches(
        _under(out, UPDATE, "version_stats/"),
        ref.version_staleness([(_np(v), _np(vm), 8), (_np(v[0]), _np(vm[0]), 8)]),
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_low_and_high_precision_inputs_are_computed_in_float64(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(6)
    b = logp_batch(gen, 3, 13, dtype=dtype)
    with stats_tracker.scope("ppo_actor"):
        log_train_infer_diagnostics(*b)
    want = ref.train_infer([tuple(_np(x) for x in b)])
    assert_matches(_under(stats_tracker.export(), ACTOR, "train_infer/"), want)


def test_nan_advantage_on_valid_token_is_loud_and_padding_is_ignored() -> None:
    a = torch.tensor([1.0, -2.0, 0.0, math.nan, math.inf])
    with stats_tracker.scope("ppo_actor"):
        log_advantage_sign_fractions(a, torch.tensor([True, True, True, False, True]))
    got = _under(stats_tracker.export(), ACTOR, "advantage_")
    assert got == {
        "advantage_n_valid_tokens": 4.0,
        "advantage_positive_fraction": 0.5,
        "advantage_negative_fraction": 0.25,
        "advantage_zero_fraction": 0.25,
    }
    with stats_tracker.scope("ppo_actor"):
        log_advantage_sign_fractions(a, torch.ones(5, dtype=torch.bool))
    got = _under(stats_tracker.export(), ACTOR, "advantage_")
    assert all(math.isnan(v) for k, v in got.items() if k.endswith("fraction"))


class SpyTracker:
    """Stands in for the tracker module inside ``_training_diag`` to inspect what is handed
    to it (used where the real tracker cannot go: meta tensors never export)."""

    def __init__(self) -> None:
        self.denominators: dict[str, torch.Tensor] = {}
        self.stats: list[tuple[str, Any, str, torch.Tensor]] = []

    def scope(self, name: str) -> Any:
        return contextlib.nullcontext()

    def denominator(self, **kw: torch.Tensor) -> None:
        self.denominators.update(kw)

    def stat_compact(self, denominator: str, reduce_type: Any = None, **kw: torch.Tensor) -> None:
        for k, v in kw.items():
            self.stats.append((denominator, reduce_type, k, v))


def test_recorded_tensors_are_float64_detached_and_shaped_like_their_denominator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spy = SpyTracker()
    monkeypatch.setattr(_training_diag, "stats_tracker", spy)
    t = torch.randn(3, 7, requires_grad=True)
    a = torch.randn(3, 7, requires_grad=True)
    m = torch.ones(3, 7, dtype=torch.bool)
    log_train_infer_diagnostics(t * 1.0, t.detach().half(), m)
    log_advantage_sign_fractions(a * 2.0, m)
    log_version_staleness(torch.zeros(3, 7, dtype=torch.int32), m, 2)
    assert len(spy.stats) == 15 + 3 + 8
    for den, _rtype, key, value in spy.stats:
        assert value.dtype == torch.float64, key
        assert not value.requires_grad, key
        assert value.shape == spy.denominators[den].shape, key
    assert all(d.dtype == torch.bool for d in spy.denominators.values())


def test_no_host_sync_meta_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the meta device any value-dependent op (``.item()``, ``bool(t)``, ``x[mask]``)
    raises, so running the three diagnostics there shows none of them syncs."""
    spy = SpyTracker()
    monkeypatch.setattr(_training_diag, "stats_tracker", spy)
    meta = torch.device("meta")
    t = torch.empty(4, 64, device=meta)
    m = torch.empty(4, 64, dtype=torch.bool, device=meta)
    v = torch.empty(4, 64, dtype=torch.long, device=meta)
    log_train_infer_diagnostics(t, t, m)
    log_advantage_sign_fractions(t, m)
    log_version_staleness(v, m, 3)
    assert spy.stats and all(value.device == meta for *_, value in spy.stats)
    with pytest.raises((NotImplementedError, RuntimeError)):
        m[m].sum()  # the check is real: a boolean-mask index does fail on meta


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_host_sync_cuda() -> None:  # pragma: no cover - CPU-only CI
    gen = torch.Generator().manual_seed(7)
    b = [x.cuda() for x in logp_batch(gen, 8, 256)]
    v, vm = version_batch(gen, 8, 256, prompt=4)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with stats_tracker.scope("ppo_actor"):
            log_train_infer_diagnostics(*b)
            log_advantage_sign_fractions(b[0], b[2])
            with stats_tracker.scope("update"):
                log_version_staleness(v.cuda(), vm.cuda(), 4)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    out = stats_tracker.export()
    assert_matches(
        _under(out, ACTOR, "train_infer/"), ref.train_infer([tuple(_np(x.cpu()) for x in b)])
    )


# ----------------------------------------------------------------------------- validation


def test_bad_inputs_raise_naming_the_argument() -> None:
    f = torch.zeros(2, 3)
    m = torch.ones(2, 3, dtype=torch.bool)
    v = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(TypeError, match="trainer_logp"):
        log_train_infer_diagnostics(v, f, m)
    with pytest.raises(TypeError, match="rollout_logp"):
        log_train_infer_diagnostics(f, [[0.0]], m)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"mask.*bool"):
        log_train_infer_diagnostics(f, f, m.long())
    with pytest.raises(ValueError, match=r"shapes must match.*rollout_logp=\(3, 2\)"):
        log_train_infer_diagnostics(f, f.T, m)
    with pytest.raises(ValueError, match="mask"):
        log_train_infer_diagnostics(f, f, m[0])
    with pytest.raises(TypeError, match="advantages"):
        log_advantage_sign_fractions(v, m)
    with pytest.raises(TypeError, match="loss_mask"):
        log_advantage_sign_fractions(f, f)
    with pytest.raises(ValueError, match="loss_mask"):
        log_advantage_sign_fractions(f, m[:, :2])
    with pytest.raises(TypeError, match="versions"):
        log_version_staleness(f, m, 1)
    with pytest.raises(TypeError, match="versions"):
        log_version_staleness(m, m, 1)
    with pytest.raises(TypeError, match="versions must be a signed integer"):
        log_version_staleness(v.to(torch.uint8), m, 1)
    with pytest.raises(TypeError, match="current_version"):
        log_version_staleness(v, m, 1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="current_version"):
        log_version_staleness(v, m, True)
    with pytest.raises(ValueError, match="versions"):
        log_version_staleness(v, m.T, 1)
    with pytest.raises(ValueError, match="at least one dimension"):
        log_version_staleness(torch.tensor(3), torch.tensor(True), 1)
    with pytest.raises(ValueError, match="one device"):
        log_train_infer_diagnostics(f, f.to("meta"), m)
    # Nothing was recorded by the failed calls.
    assert stats_tracker.export() == {}


# ----------------------------------------------------------------------------- 2 gloo ranks


def _ranks_fn(rank: int, world: int) -> list[dict[str, float]]:
    import torch.distributed as dist

    results = []
    # 1) different data (and shapes, batch counts) per rank, pooled over the group.
    record_all(seed=100 + rank, n_batches=2 + rank, specials=False, current_version=5 + rank)
    results.append(stats_tracker.export(reduce_group=dist.group.WORLD))
    # 2) rank 1 has a non-finite logp and no valid token at all for staleness/advantages;
    #    NaN tails must reach rank 0 too, and rank 0's extrema stay the global ones.
    (t, r, m), (a, am), (v, vm) = _scenario2(rank)
    with stats_tracker.scope("ppo_actor"):
        log_train_infer_diagnostics(t, r, m)
        log_advantage_sign_fractions(a, am)
        with stats_tracker.scope("update"):
            log_version_staleness(v, vm, 4)
    results.append(stats_tracker.export(reduce_group=dist.group.WORLD))
    return [{k: float(x) for k, x in res.items()} for res in results]


def _scenario2(rank: int) -> tuple[tuple[torch.Tensor, ...], ...]:
    gen = torch.Generator().manual_seed(200 + rank)
    b = logp_batch(gen, 3, 12)
    v, vm = version_batch(gen, 3, 12, prompt=3)
    a, am = adv_batch(gen, 3, 12)
    if rank == 1:
        b = with_specials(b)
        vm = torch.zeros_like(vm)
        am = torch.zeros_like(am)
    return b, (a, am), (v, vm)


def test_two_rank_gloo_export_pools_ranks() -> None:
    per_rank = run_ranks(_ranks_fn, 2, timeout=120)
    # scenario 1: regenerate each rank's data here (recording into a scratch window).
    pooled: tuple[list[Any], list[Any], list[Any]] = ([], [], [])
    for rank in range(2):
        got = record_all(
            seed=100 + rank, n_batches=2 + rank, specials=False, current_version=5 + rank
        )
        for acc, part in zip(pooled, got):
            acc.extend(part)
    stats_tracker.export()
    for rank_out in per_rank:
        check_all(rank_out[0], *pooled)
    assert_same(per_rank[0][0], per_rank[1][0])
    # scenario 2
    pooled2: tuple[list[Any], list[Any], list[Any]] = ([], [], [])
    for rank in range(2):
        b, (a, am), (v, vm) = _scenario2(rank)
        pooled2[0].append(tuple(_np(x) for x in b))
        pooled2[1].append((_np(a), _np(am)))
        pooled2[2].append((_np(v), _np(vm), 4))
    assert_same(per_rank[0][1], per_rank[1][1])
    for rank_out in per_rank:
        check_all(rank_out[1], *pooled2)
        assert math.isnan(rank_out[1][ACTOR + "train_infer/ratio_outside_2"])

"""export_all over real gloo groups: identical dicts, differing key sets, packed collectives."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
import torch
from _dist import run_ranks


def _count_collectives() -> Counter[str]:
    import torch.distributed as dist

    from areal_stream import _export

    calls: Counter[str] = Counter()
    for name in ("all_reduce", "all_gather_object", "all_gather", "broadcast"):
        orig = getattr(dist, name)

        def wrapped(*a: Any, __orig: Any = orig, __name: str = name, **kw: Any) -> Any:
            calls[__name] += 1
            return __orig(*a, **kw)

        setattr(_export.dist, name, wrapped)
    return calls


def _rank_data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(4 + rank, 6, generator=g)
    mask = torch.rand(4 + rank, 6, generator=g) > 0.4
    return x, mask


def _scenarios(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from areal_stream import stats_tracker
    from areal_stream.stats_tracker import ReduceType

    calls = _count_collectives()
    results: dict[str, Any] = {}

    # 1. Different key sets per rank, every reduce type, several batches.
    x, mask = _rank_data(rank)
    with stats_tracker.scope("ppo_actor"):
        stats_tracker.denominator(n_valid_tokens=mask)
        stats_tracker.stat(adv=x, denominator="n_valid_tokens")
        stats_tracker.stat(adv=x * 2, denominator="n_valid_tokens")
        stats_tracker.stat(lo=x, denominator="n_valid_tokens", reduce_type=ReduceType.MIN)
        if rank == 0:
            stats_tracker.stat(only0=x, denominator="n_valid_tokens", reduce_type=ReduceType.AVG)
    stats_tracker.scalar(lr=0.1 * (rank + 1))
    stats_tracker.get("rollout").scalar(reward=float(rank))
    if rank == world - 1:
        stats_tracker.get("rollout").scalar(last=7.0, last2=1.0)
    before = Counter(calls)
    results["mixed"] = stats_tracker.export_all(reduce_group=dist.group.WORLD)
    results["mixed_calls"] = dict(calls - before)

    # 2. Same key sets on every rank: no key-set gather, constant collectives in K.
    for k_count in (10, 200):
        for i in range(k_count):
            stats_tracker.scalar(**{f"k{i}": float(rank + i)})
        before = Counter(calls)
        out = stats_tracker.export_all(reduce_group=dist.group.WORLD)
        results[f"same_{k_count}_calls"] = dict(calls - before)
        results[f"same_{k_count}_k5"] = out["k5"]

    # 3. NaN on one rank propagates; inf is kept.
    stats_tracker.denominator(m=torch.ones(2, dtype=torch.bool))
    bad = torch.tensor([math.nan, 1.0]) if rank == 1 else torch.tensor([1.0, math.inf])
    stats_tracker.stat(v=bad, denominator="m")
    results["nan"] = stats_tracker.export_all(reduce_group=dist.group.WORLD)

    # 4. A rank with nothing recorded still joins and gets the same dict.
    if rank == 0:
        stats_tracker.scalar(lonely=5.0)
    results["lonely"] = stats_tracker.export_all(reduce_group=dist.group.WORLD)

    # 5. Reduce-type disagreement is an error on every rank (no hang).
    if rank == 0:
        stats_tracker.scalar(clash=1.0)
    else:
        stats_tracker.denominator(m=torch.ones(1, dtype=torch.bool))
        stats_tracker.stat(clash=torch.ones(1), denominator="m")
    try:
        stats_tracker.export_all(reduce_group=dist.group.WORLD)
        results["clash"] = None
    except ValueError as e:
        results["clash"] = str(e)
    stats_tracker.export_all()  # drop the clash locally

    # 6. Per-key reduce-group override (ranks 0 and 1 only), default group = world.
    sub = dist.new_group([0, 1])
    if rank in (0, 1):
        stats_tracker.scalar(reduce_group=sub, pair=float(rank * 10))
    stats_tracker.scalar(everyone=1.0)
    results["override"] = stats_tracker.export_all(reduce_group=dist.group.WORLD)
    return results


@pytest.mark.parametrize("world", [2, 3])
def test_export_all_over_gloo(world: int) -> None:
    res = run_ranks(_scenarios, world, timeout=120)
    # Identical dicts on every rank.
    for key in ("mixed", "nan", "lonely"):
        for r in range(1, world):
            assert _same(res[r][key], res[0][key]), key
    mixed = res[0]["mixed"]
    xs: list[float] = []
    for r in range(world):
        x, mask = _rank_data(r)
        xs += [v for v, m in zip(x.flatten().tolist(), mask.flatten().tolist()) if m]
    both = xs + [2 * v for v in xs]
    assert mixed["ppo_actor/n_valid_tokens"] == len(xs)
    assert mixed["ppo_actor/adv/avg"] == pytest.approx(math.fsum(both) / len(both), rel=1e-12)
    assert mixed["ppo_actor/adv/min"] == min(both)
    assert mixed["ppo_actor/adv/max"] == max(both)
    assert mixed["ppo_actor/lo"] == min(xs)
    x0, m0 = _rank_data(0)
    xs0 = [v for v, m in zip(x0.flatten().tolist(), m0.flatten().tolist()) if m]
    assert mixed["ppo_actor/only0"] == pytest.approx(math.fsum(xs0) / len(xs0), rel=1e-12)
    assert mixed["lr"] == pytest.approx(sum(0.1 * (r + 1) for r in range(world)) / world)
    assert mixed["lr__count"] == world
    assert mixed["rollout/reward"] == pytest.approx((world - 1) / 2)
    assert mixed["rollout/last"] == 7.0 and mixed["rollout/last__count"] == 1
    # Differing key sets: signature check + one gather + SUM + MAX.
    assert res[0]["mixed_calls"] == {"all_reduce": 3, "all_gather_object": 1}
    # Same key sets: three all-reduces, whatever the number of keys.
    assert res[0]["same_10_calls"] == res[0]["same_200_calls"] == {"all_reduce": 3}
    assert res[0]["same_200_k5"] == pytest.approx(5 + (world - 1) / 2)
    nan = res[0]["nan"]
    assert math.isnan(nan["v/avg"]) and math.isnan(nan["v/min"]) and math.isnan(nan["v/max"])
    assert res[0]["lonely"] == {"lonely": 5.0, "lonely__count": 1}
    for r in range(world):
        assert res[r]["clash"] is not None and "clash" in res[r]["clash"]
    for r in range(world):
        ov = res[r]["override"]
        assert ov["everyone"] == 1.0 and ov["everyone__count"] == world
        if r in (0, 1):
            assert ov["pair"] == 5.0 and ov["pair__count"] == 2
        else:
            assert "pair" not in ov


def _same(a: dict[str, float], b: dict[str, float]) -> bool:
    if a.keys() != b.keys():
        return False
    return all((math.isnan(a[k]) and math.isnan(b[k])) or a[k] == b[k] for k in a)

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


def _raises(fn: Any) -> str | None:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def _consistency_scenarios(rank: int, world: int) -> dict[str, Any]:
    """Errors found on some ranks only are raised on every rank, never a hang (world 3)."""
    import torch.distributed as dist

    from areal_stream import stats_tracker
    from areal_stream.stats_tracker import ReduceType

    world_group = dist.group.WORLD
    res: dict[str, Any] = {}
    sub01 = dist.new_group([0, 1])
    sub12 = dist.new_group([1, 2])
    fresh01 = dist.new_group([0, 1])  # nobody records with it before scenario 4

    # 0. take_records (the streaming path) never communicates, even for a key with an
    #    override group: rank 0 alone takes it here while the others go on.
    if rank == 0:
        stats_tracker.scalar(reduce_group=sub01, streamed=3.0)
        res["streamed"] = stats_tracker.take_records()["streamed"][1][:2]

    # 1. A key produced by two trackers on rank 0 only: every rank raises, nothing lost.
    if rank == 0:
        with stats_tracker.scope("rollout"):
            stats_tracker.scalar(reward=1.0)
    stats_tracker.get("rollout").scalar(reward=float(rank))
    res["collision"] = _raises(lambda: stats_tracker.export_all(reduce_group=world_group))
    res["collision_kept"] = stats_tracker.get("rollout").export()
    stats_tracker.take_records()  # drop the window locally

    # 2. A reduce-type clash inside an override group: rank 2 (not in it) raises too.
    if rank == 0:
        stats_tracker.scalar(reduce_group=sub01, c=1.0)
    if rank == 1:
        stats_tracker.denominator(m=torch.ones(1, dtype=torch.bool))
        stats_tracker.stat(reduce_group=sub01, c=torch.ones(1), denominator="m")
    stats_tracker.scalar(everyone=1.0)
    res["group_clash"] = _raises(lambda: stats_tracker.export_all(reduce_group=world_group))
    stats_tracker.take_records()  # drop the window locally

    # 3. A member that recorded nothing for an override group this window joins it with
    #    identity values (it holds the group from scenario 2's window).
    if rank == 0:
        stats_tracker.scalar(reduce_group=sub01, solo=4.0)
    res["solo"] = stats_tracker.export_all(reduce_group=world_group)

    # 4. A member that never recorded with a group cannot join it: a clear error on every
    #    rank instead of rank 0 waiting forever.
    if rank == 0:
        stats_tracker.scalar(reduce_group=fresh01, fresh=1.0)
    res["no_handle"] = _raises(lambda: stats_tracker.export_all(reduce_group=world_group))
    stats_tracker.take_records()  # drop the window locally

    # 5. One key reduced within each rank's own subgroup is fine (ranks 0,1 over sub01;
    #    rank 2 alone, so locally).
    alone2 = dist.new_group([2])  # new_group is collective: every rank creates every group
    own = sub01 if rank in (0, 1) else alone2
    stats_tracker.scalar(reduce_group=own, pp=float(rank))
    res["subgroups"] = stats_tracker.export_all(reduce_group=world_group)

    # 6. No default group: a clash in the first override group must not leave rank 2
    #    waiting in the second one for rank 1; rank 2 learns of it there and raises too.
    if rank == 0:
        stats_tracker.scalar(reduce_group=sub01, x=1.0)
    if rank == 1:
        stats_tracker.denominator(m=torch.ones(1, dtype=torch.bool))
        stats_tracker.stat(
            reduce_group=sub01, x=torch.ones(1), denominator="m", reduce_type=ReduceType.SUM
        )
    if rank in (1, 2):
        stats_tracker.scalar(reduce_group=sub12, y=float(rank))
    try:
        res["no_default_out"] = stats_tracker.export_all()
        res["no_default"] = None
    except ValueError as e:
        res["no_default"] = str(e)
    stats_tracker.take_records()  # drop the window locally

    # 7. An override group wider than the export's group (DP+CP while exporting over DP):
    #    export over sub01 on ranks 0 and 1, over rank 2 alone on rank 2.
    dp = sub01 if rank in (0, 1) else alone2
    stats_tracker.scalar(narrow=float(rank))
    stats_tracker.scalar(reduce_group=world_group, wide=float(rank))
    res["wider"] = stats_tracker.export_all(reduce_group=dp)

    # 8. The same with a key produced by two trackers on rank 0 only: rank 1 learns of it
    #    in the DP agreement, rank 2 in the wide group's; nobody reduces or resets.
    stats_tracker.scalar(reduce_group=world_group, wide=float(rank))
    if rank == 0:
        with stats_tracker.scope("rollout"):
            stats_tracker.scalar(reward=1.0)
        stats_tracker.get("rollout").scalar(reward=0.0)
    res["wider_error"] = _raises(lambda: stats_tracker.export_all(reduce_group=dp))
    if rank == 0:  # resolve the clash locally; "wide" stays for the retry
        stats_tracker.get("rollout").export()
        stats_tracker.export(key="rollout/reward")
    res["wider_retry"] = stats_tracker.export_all(reduce_group=dp)

    # 9. With key_sync_group (as in the reference), a wide key recorded on rank 0 only is
    #    agreed in the wide group: ranks 1 and 2 join it with identity values.
    if rank == 0:
        stats_tracker.scalar(reduce_group=world_group, wide2=5.0)
    stats_tracker.scalar(narrow=float(rank))
    res["key_sync"] = stats_tracker.export_all(reduce_group=dp, key_sync_group=world_group)
    return res


def test_errors_are_raised_on_every_rank_without_hanging() -> None:
    res = run_ranks(_consistency_scenarios, 3, timeout=120)
    assert res[0]["streamed"] == [3.0, 1.0]
    for r in range(3):
        assert res[r]["collision"] is not None and "rollout/reward" in res[r]["collision"]
        assert res[r]["collision_kept"] == {"rollout/reward": float(r), "rollout/reward__count": 1}
        assert res[r]["group_clash"] is not None and "`c`" in res[r]["group_clash"]
        assert res[r]["no_handle"] is not None and "handle" in res[r]["no_handle"]
        assert "fresh" in res[r]["no_handle"]
    for r in (0, 1):
        assert res[r]["solo"] == {"solo": 4.0, "solo__count": 1}
        assert res[r]["subgroups"] == {"pp": 0.5, "pp__count": 2}
        assert res[r]["no_default"] is not None and "`x`" in res[r]["no_default"]
    assert res[2]["solo"] == {}
    assert res[2]["subgroups"] == {"pp": 2.0, "pp__count": 1}
    assert res[2]["no_default"] is not None and "another rank" in res[2]["no_default"]
    for r in range(3):
        assert res[r]["wider"]["wide"] == 1.0 and res[r]["wider"]["wide__count"] == 3
        assert res[r]["wider_error"] is not None
        assert res[r]["wider_retry"] == {"wide": 1.0, "wide__count": 3}
    assert "rollout/reward" in res[0]["wider_error"]
    assert "another rank" in res[2]["wider_error"]
    for r in (0, 1):
        assert res[r]["wider"]["narrow"] == 0.5 and res[r]["wider"]["narrow__count"] == 2
    assert res[2]["wider"]["narrow"] == 2.0 and res[2]["wider"]["narrow__count"] == 1
    for r in range(3):
        assert res[r]["key_sync"]["wide2"] == 5.0 and res[r]["key_sync"]["wide2__count"] == 1
        assert res[r]["key_sync"]["narrow__count"] == (2 if r < 2 else 1)

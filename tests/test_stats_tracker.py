"""The tracker's local semantics: keys, reduce types, edge cases, bad input, concurrency."""

from __future__ import annotations

import asyncio
import gc
import inspect
import math
import threading
import weakref
from collections.abc import AsyncIterator, Generator, Iterator
from typing import Any

import pytest
import torch

from areal_stream import merge_worker_stats, stats_tracker, workflow_context
from areal_stream._tracker import REGISTRY
from areal_stream.stats_tracker import ReduceType


@pytest.fixture(autouse=True)
def clean_trackers() -> Iterator[None]:
    stats_tracker.export_all()
    yield
    for t in REGISTRY.unique():
        t._ring.clear()
        t._clear()


def test_scalar_named_trackers_and_scopes() -> None:
    stats_tracker.scalar(learning_rate=0.001)
    stats_tracker.get("rollout").scalar(reward=0.5)
    stats_tracker.get("rollout").scalar(reward=1.5, num_turns=3)
    stats_tracker.get("eval-rollout").scalar(reward=0.25)
    with stats_tracker.scope("ppo_actor"), stats_tracker.scope("update"):
        stats_tracker.scalar(grad_norm=2.0)
    out = stats_tracker.export_all()
    assert out == {
        "learning_rate": 0.001,
        "learning_rate__count": 1,
        "rollout/reward": 1.0,
        "rollout/reward__count": 2,
        "rollout/num_turns": 3.0,
        "rollout/num_turns__count": 1,
        "eval-rollout/reward": 0.25,
        "eval-rollout/reward__count": 1,
        "ppo_actor/update/grad_norm": 2.0,
        "ppo_actor/update/grad_norm__count": 1,
    }
    assert stats_tracker.export_all() == {}  # reset


def test_stat_reduce_types_against_reference() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 16, generator=g)
    mask = torch.rand(8, 16, generator=g) > 0.3
    seq_mask = torch.ones(8, dtype=torch.bool)
    r = torch.rand(8, generator=g)
    stats_tracker.denominator(n_valid_tokens=mask, n_seqs=seq_mask)
    stats_tracker.stat(advantages=x, denominator="n_valid_tokens")
    stats_tracker.stat(task_reward=r, denominator="n_seqs", reduce_type=ReduceType.AVG)
    stats_tracker.stat(total=x, denominator="n_valid_tokens", reduce_type=ReduceType.SUM)
    stats_tracker.stat(lo=x, denominator="n_valid_tokens", reduce_type=ReduceType.MIN)
    stats_tracker.stat(hi=x, denominator="n_valid_tokens", reduce_type=ReduceType.MAX)
    out = stats_tracker.export()
    xs = [float(v) for v, m in zip(x.flatten().tolist(), mask.flatten().tolist()) if m]
    assert out["n_valid_tokens"] == len(xs)
    assert out["n_seqs"] == 8
    assert out["advantages/avg"] == pytest.approx(math.fsum(xs) / len(xs), rel=1e-12)
    assert out["advantages/min"] == min(xs)
    assert out["advantages/max"] == max(xs)
    assert out["task_reward"] == pytest.approx(math.fsum(r.tolist()) / 8, rel=1e-12)
    assert out["total"] == pytest.approx(math.fsum(xs), rel=1e-12)
    assert out["lo"] == min(xs) and out["hi"] == max(xs)
    assert set(out) == {
        "n_valid_tokens",
        "n_seqs",
        "advantages/avg",
        "advantages/min",
        "advantages/max",
        "task_reward",
        "total",
        "lo",
        "hi",
    }


def test_stat_pools_batches_and_pairs_with_latest_denominator() -> None:
    m1 = torch.tensor([True, False, True])
    m2 = torch.tensor([False, True])
    with stats_tracker.scope("ppo_actor"):
        stats_tracker.denominator(valid=m1)
        stats_tracker.stat(loss=torch.tensor([1.0, 100.0, 3.0]), denominator="valid")
        stats_tracker.denominator(valid=m2)
        stats_tracker.stat(loss=torch.tensor([-50.0, 8.0]), denominator="valid")
    out = stats_tracker.export()
    assert out["ppo_actor/loss/avg"] == pytest.approx(4.0)
    assert out["ppo_actor/loss/min"] == 1.0
    assert out["ppo_actor/loss/max"] == 8.0
    assert out["ppo_actor/valid"] == 3.0


def test_empty_masks_are_omitted_not_zero() -> None:
    stats_tracker.denominator(none=torch.zeros(4, dtype=torch.bool))
    stats_tracker.stat(a=torch.ones(4), denominator="none")
    stats_tracker.stat(b=torch.ones(4), denominator="none", reduce_type=ReduceType.AVG)
    stats_tracker.stat(c=torch.ones(4), denominator="none", reduce_type=ReduceType.MIN)
    stats_tracker.stat(d=torch.ones(4), denominator="none", reduce_type=ReduceType.SUM)
    assert stats_tracker.export() == {"none": 0.0, "d": 0.0}


def test_nan_and_inf_propagate_and_padding_is_ignored() -> None:
    mask = torch.tensor([True, True, False])
    stats_tracker.denominator(m=mask)
    stats_tracker.stat(padded=torch.tensor([1.0, 2.0, math.nan]), denominator="m")
    stats_tracker.stat(bad=torch.tensor([1.0, math.nan, 0.0]), denominator="m")
    stats_tracker.stat(big=torch.tensor([math.inf, 1.0, 0.0]), denominator="m")
    stats_tracker.scalar(s=math.nan)
    stats_tracker.scalar(s=1.0)
    out = stats_tracker.export()
    assert out["padded/avg"] == 1.5 and out["padded/max"] == 2.0
    assert math.isnan(out["bad/avg"]) and math.isnan(out["bad/min"]) and math.isnan(out["bad/max"])
    assert out["big/avg"] == math.inf and out["big/max"] == math.inf and out["big/min"] == 1.0
    assert math.isnan(out["s"]) and out["s__count"] == 2


def test_float64_accumulation() -> None:
    # float32 sums would lose the small values next to 1e8.
    x = torch.tensor([1e8, 1.0, 1.0, 1.0], dtype=torch.float32)
    stats_tracker.denominator(m=torch.ones(4, dtype=torch.bool))
    for _ in range(3):
        stats_tracker.stat(x=x, denominator="m", reduce_type=ReduceType.SUM)
    assert stats_tracker.export()["x"] == 3 * (1e8 + 3)


@pytest.mark.parametrize(
    ("call", "exc", "needle"),
    [
        (lambda: stats_tracker.scalar(good=1.0, bad="x"), TypeError, "bad"),
        (lambda: stats_tracker.scalar(t=torch.tensor(1.0)), TypeError, "t"),
        (lambda: stats_tracker.scalar(n=None), TypeError, "n"),
        (lambda: stats_tracker.denominator(d=torch.ones(3)), TypeError, "d"),
        (lambda: stats_tracker.denominator(d=[True]), TypeError, "d"),
        (lambda: stats_tracker.denominator(e=torch.ones(0, dtype=torch.bool)), ValueError, "e"),
        (lambda: stats_tracker.stat(x=torch.ones(3), denominator="nope"), ValueError, "nope"),
        (
            lambda: stats_tracker.stat(i=torch.ones(3, dtype=torch.long), denominator="m"),
            TypeError,
            "i",
        ),
        (lambda: stats_tracker.stat(s=torch.ones(4), denominator="m"), ValueError, "s"),
        (
            lambda: stats_tracker.stat(
                x=torch.ones(3), denominator="m", reduce_type=ReduceType.SCALAR
            ),
            ValueError,
            "SCALAR",
        ),
        (
            lambda: stats_tracker.stat(x=torch.ones(3), denominator="m", reduce_type="avg"),  # type: ignore[arg-type]
            TypeError,
            "reduce_type",
        ),
    ],
)
def test_bad_input_is_refused_naming_the_key_and_keeps_records(
    call: object, exc: type[Exception], needle: str
) -> None:
    stats_tracker.scalar(kept=1.0)
    stats_tracker.denominator(m=torch.ones(3, dtype=torch.bool))
    stats_tracker.stat(ok=torch.ones(3), denominator="m")
    with pytest.raises(exc, match=needle):
        call()  # type: ignore[operator]
    out = stats_tracker.export()
    assert out["kept"] == 1.0 and out["kept__count"] == 1
    assert out["ok/avg"] == 1.0 and out["m"] == 3.0
    assert "good" not in out  # a refused call records nothing


def test_reference_error_type_compatibility() -> None:
    # The reference raised ValueError for dtype errors; ours is also a TypeError.
    with pytest.raises(ValueError):
        stats_tracker.denominator(d=torch.ones(3))


def test_numeric_scalar_types() -> None:
    import numpy as np

    stats_tracker.scalar(a=1, b=True, c=np.float32(0.5), d=np.int64(4))
    out = stats_tracker.export()
    assert (out["a"], out["b"], out["c"], out["d"]) == (1.0, 1.0, 0.5, 4.0)


def test_kind_conflicts_are_refused() -> None:
    stats_tracker.scalar(x=1.0)
    stats_tracker.denominator(m=torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="SCALAR"):
        stats_tracker.stat(x=torch.ones(2), denominator="m")
    stats_tracker.stat(y=torch.ones(2), denominator="m")
    with pytest.raises(ValueError, match="AVG_MIN_MAX"):
        stats_tracker.scalar(y=1.0)
    with pytest.raises(ValueError, match="AVG_MIN_MAX"):
        stats_tracker.stat(y=torch.ones(2), denominator="m", reduce_type=ReduceType.MAX)
    out = stats_tracker.export()
    assert out["x"] == 1.0 and out["y/avg"] == 1.0


def test_export_all_refuses_key_produced_by_two_trackers_and_loses_nothing() -> None:
    with stats_tracker.scope("rollout"):
        stats_tracker.scalar(reward=1.0)
    stats_tracker.get("rollout").scalar(reward=0.0)
    with pytest.raises(ValueError, match="rollout/reward"):
        stats_tracker.export_all()
    assert stats_tracker.get("rollout").export() == {
        "rollout/reward": 0.0,
        "rollout/reward__count": 1,
    }
    assert stats_tracker.export() == {"rollout/reward": 1.0, "rollout/reward__count": 1}


def test_output_key_collision_within_a_tracker() -> None:
    stats_tracker.denominator(m=torch.ones(2, dtype=torch.bool))
    stats_tracker.stat(loss=torch.ones(2), denominator="m")
    stats_tracker.scalar(**{"loss/avg": 3.0})
    with pytest.raises(ValueError, match="loss/avg"):
        stats_tracker.export()


def test_export_single_key_and_no_reset() -> None:
    stats_tracker.scalar(a=1.0, b=2.0)
    assert stats_tracker.export(key="a", reset=False) == {"a": 1.0, "a__count": 1}
    assert stats_tracker.export(key="a") == {"a": 1.0, "a__count": 1}
    assert stats_tracker.export() == {"b": 2.0, "b__count": 1}


def test_record_timing_sync_async_and_decorator() -> None:
    with stats_tracker.scope("ignored"), stats_tracker.record_timing("rollout"):
        pass

    @stats_tracker.record_timing("f")
    def f() -> int:
        return 1

    @stats_tracker.record_timing("g")
    async def g() -> int:
        await asyncio.sleep(0)
        return 2

    assert f() == 1 and asyncio.run(g()) == 2
    out = stats_tracker.export()
    assert set(out) == {
        "timeperf/rollout",
        "timeperf/rollout__count",
        "timeperf/f",
        "timeperf/f__count",
        "timeperf/g",
        "timeperf/g__count",
    }
    assert all(v >= 0 for v in out.values())


async def test_scopes_are_per_task_across_awaits() -> None:
    n = 1000
    gate = asyncio.Event()
    all_in = asyncio.Event()
    arrived = 0

    async def child(i: int) -> None:
        # Created inside the parent's scope: inherits it; its own scope stays its own.
        with stats_tracker.scope("child"):
            await asyncio.sleep(0)
            stats_tracker.scalar(c=float(i))

    async def workflow(i: int) -> None:
        nonlocal arrived
        with stats_tracker.scope(f"w{i}"):
            arrived += 1
            if arrived == n:
                all_in.set()
            await gate.wait()  # every task is inside its scope at once
            spawned = asyncio.create_task(child(i))
            with stats_tracker.scope("inner"):
                await asyncio.sleep(0)
                stats_tracker.scalar(v=float(i))
            await spawned
            stats_tracker.scalar(after=float(i))
            stats_tracker.get("rollout").scalar(reward=float(i))

    tasks = [asyncio.create_task(workflow(i)) for i in range(n)]
    await asyncio.wait_for(all_in.wait(), timeout=30)
    gate.set()
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
    out = stats_tracker.export_all()
    for i in range(n):
        assert out[f"w{i}/inner/v"] == float(i)
        assert out[f"w{i}/child/c"] == float(i)
        assert out[f"w{i}/after"] == float(i)
    assert out["rollout/reward"] == pytest.approx((n - 1) / 2)
    assert out["rollout/reward__count"] == n
    assert len(out) == 2 * (3 * n + 1)
    assert stats_tracker.DEFAULT_TRACKER.current_scope() == ""


async def test_scope_decorates_async_functions() -> None:
    scoped = stats_tracker.scope("agent")

    @scoped
    async def step(i: int) -> None:
        await asyncio.sleep(0)
        stats_tracker.scalar(turn=float(i))

    await asyncio.wait_for(asyncio.gather(*(step(i) for i in range(10))), timeout=10)
    out = stats_tracker.export()
    assert out == {"agent/turn": 4.5, "agent/turn__count": 10}


async def test_workflow_context_stat_scope_per_task() -> None:
    async def run(is_eval: bool) -> None:
        workflow_context.set(workflow_context.WorkflowContext(is_eval=is_eval))
        await asyncio.sleep(0)
        stats_tracker.get(workflow_context.stat_scope()).scalar(reward=1.0 if is_eval else 0.0)

    await asyncio.wait_for(asyncio.gather(*(run(i % 3 == 0) for i in range(30))), timeout=10)
    out = stats_tracker.export_all()
    assert out["eval-rollout/reward"] == 1.0 and out["eval-rollout/reward__count"] == 10
    assert out["rollout/reward"] == 0.0 and out["rollout/reward__count"] == 20
    assert workflow_context.stat_scope() == "rollout"


def test_threads_record_concurrently_without_loss() -> None:
    per_thread, n_threads = 50_000, 4
    tracker = stats_tracker.get("threads")

    def work() -> None:
        for _ in range(per_thread):
            tracker.scalar(x=1.0)

    threads = [threading.Thread(target=work) for _ in range(n_threads)]
    for t in threads:
        t.start()
    for _ in range(20):
        tracker.fold()  # fold races with appends
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive()
    out = tracker.export()
    assert out["threads/x__count"] == per_thread * n_threads


def test_fold_export_and_take_records_race_recording_without_loss_or_double_count() -> None:
    # Recording threads run until the main thread has folded, taken and exported many
    # times under them; every recorded value must come out exactly once.
    tracker = stats_tracker.get("race")
    stop = threading.Event()
    recorded = [0, 0, 0]

    def work(slot: int) -> None:
        n = 0
        while not stop.is_set():
            for _ in range(100):
                tracker.scalar(x=1.0)
            n += 100
        recorded[slot] = n

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(recorded))]
    for t in threads:
        t.start()
    seen = 0.0
    try:
        for _ in range(200):
            tracker.fold()
            recs = stats_tracker.take_records()
            if "race/x" in recs:
                seen += recs["race/x"][1][1]
            seen += tracker.export(reset=True).get("race/x__count", 0)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    seen += tracker.export().get("race/x__count", 0)
    assert seen == sum(recorded) > 0


def test_ring_is_bounded_and_folding_is_exact() -> None:
    tracker = stats_tracker.get("ring")
    total = stats_tracker.RING_CAPACITY * 3 + 17
    for i in range(total):
        tracker.scalar(x=float(i % 7))
        assert tracker.pending_events() < stats_tracker.RING_CAPACITY
    out = tracker.export()
    assert out["ring/x__count"] == total
    assert out["ring/x"] == pytest.approx(sum(i % 7 for i in range(total)) / total, rel=1e-12)


def test_stat_keeps_no_tensor_and_records_without_reading_device() -> None:
    x = torch.randn(64, 4096)
    ref = weakref.ref(x)
    stats_tracker.denominator(m=torch.ones(64, 4096, dtype=torch.bool))
    stats_tracker.stat(x=x, denominator="m")
    del x
    gc.collect()
    assert ref() is None
    # Meta tensors have no data: recording them proves no value is read on the host.
    with stats_tracker.scope("meta"):
        stats_tracker.denominator(m=torch.ones(4, 4, dtype=torch.bool, device="meta"))
        stats_tracker.stat(y=torch.ones(4, 4, device="meta"), denominator="m")
    with stats_tracker.scope("meta"):
        stats_tracker.stat_compact(y=torch.ones(4, 4, device="meta"), denominator="m")


def test_take_records_streams_every_reduce_type_and_keeps_masks() -> None:
    stats_tracker.get("rollout").scalar(reward=1.0)
    stats_tracker.denominator(m=torch.tensor([True, False]))
    stats_tracker.stat(x=torch.tensor([2.0, 9.0]), denominator="m")
    recs = stats_tracker.take_records()
    assert recs["rollout/reward"] == (ReduceType.SCALAR, [1.0, 1.0, math.inf, -math.inf])
    assert recs["x"] == (ReduceType.AVG_MIN_MAX, [2.0, 1.0, 2.0, 2.0])
    assert recs["m"][0] is ReduceType.SUM and recs["m"][1][0] == 1.0
    assert stats_tracker.take_records() == {}
    stats_tracker.stat(x=torch.tensor([4.0, 9.0]), denominator="m")  # mask still known
    assert stats_tracker.export() == {"x/avg": 4.0, "x/min": 4.0, "x/max": 4.0}


def test_merge_worker_stats_matches_the_spec() -> None:
    workers = [
        {"reward": 1.0, "reward__count": 3, "len": 10.0, "len__count": 1},
        {"reward": 0.0, "reward__count": 1},
        {"reward": 0.5, "reward__count": 0, "len": 99.0, "len__count": 0},
    ]
    out = merge_worker_stats(workers)
    assert out == {"reward": 0.75, "reward__count": 4, "len": 10.0, "len__count": 1}
    # Associative: merging merged results gives the same answer.
    assert merge_worker_stats([merge_worker_stats(workers[:2]), workers[2]]) == out
    with pytest.raises(ValueError, match="lonely"):
        merge_worker_stats([{"lonely": 1.0}])


def test_take_records_merges_a_key_recorded_by_two_trackers() -> None:
    with stats_tracker.scope("rollout"):
        stats_tracker.scalar(reward=1.0)
    stats_tracker.get("rollout").scalar(reward=0.0)
    recs = stats_tracker.take_records()
    assert recs["rollout/reward"] == (ReduceType.SCALAR, [1.0, 2.0, math.inf, -math.inf])


def test_scope_decorates_generator_functions_step_by_step() -> None:
    # The body records under the scope; the consumer, between items, does not.
    @stats_tracker.scope("gen")
    def produce(n: int) -> Generator[int, int | None, None]:
        try:
            for i in range(n):
                stats_tracker.scalar(inside=float(i))
                sent = yield i
                if sent is not None:
                    stats_tracker.scalar(sent=float(sent))
        finally:
            stats_tracker.scalar(closed=1.0)

    assert inspect.isgeneratorfunction(produce)  # still one, for frameworks that look
    g = produce(5)
    assert next(g) == 0
    stats_tracker.scalar(outside=1.0)
    assert g.send(7) == 1
    stats_tracker.scalar(outside=1.0)
    g.close()
    assert stats_tracker.DEFAULT_TRACKER.current_scope() == ""
    assert list(produce(2)) == [0, 1]
    out = stats_tracker.export()
    assert out == {
        "gen/inside": 0.5,
        "gen/inside__count": 4,
        "gen/sent": 7.0,
        "gen/sent__count": 1,
        "gen/closed": 1.0,
        "gen/closed__count": 2,
        "outside": 1.0,
        "outside__count": 2,
    }


async def test_scope_decorates_async_generators_per_task() -> None:
    @stats_tracker.scope("agen")
    async def produce(tag: float) -> AsyncIterator[float]:
        for _ in range(3):
            await asyncio.sleep(0)
            stats_tracker.scalar(inside=tag)
            yield tag

    assert inspect.isasyncgenfunction(produce)

    async def consume(tag: float) -> None:
        with stats_tracker.scope(f"c{int(tag)}"):
            async for item in produce(tag):
                assert stats_tracker.DEFAULT_TRACKER.current_scope() == f"c{int(tag)}/"
                stats_tracker.scalar(got=item)

    await asyncio.wait_for(asyncio.gather(consume(1.0), consume(2.0)), timeout=10)
    out = stats_tracker.export()
    assert out == {
        "c1/agen/inside": 1.0,
        "c1/agen/inside__count": 3,
        "c1/got": 1.0,
        "c1/got__count": 3,
        "c2/agen/inside": 2.0,
        "c2/agen/inside__count": 3,
        "c2/got": 2.0,
        "c2/got__count": 3,
    }


def test_record_timing_obeys_kind_checks_and_the_ring_bound() -> None:
    # A timing used to bypass both: a stat of the same key silently replaced the timings
    # at export, and timings alone grew the ring without bound until export.
    stats_tracker.denominator(m=torch.ones(2, dtype=torch.bool))
    timed: dict[str, Any] = {"timeperf/step": torch.ones(2)}
    stats_tracker.stat("m", **timed)
    with pytest.raises(ValueError, match="timeperf/step"), stats_tracker.record_timing("step"):
        pass
    assert stats_tracker.export()["timeperf/step/avg"] == 1.0
    tracker = stats_tracker.get("timing-ring")
    for _ in range(stats_tracker.RING_CAPACITY + 5):
        with tracker.record_timing("t"):
            pass
        assert tracker.pending_events() < stats_tracker.RING_CAPACITY
    assert tracker.export()["timing-ring/timeperf/t__count"] == stats_tracker.RING_CAPACITY + 5


def test_a_key_whose_batches_change_device_keeps_accumulating() -> None:
    # Meta stands in for a second device (CPU-only here): the old fold added tensors of
    # two devices and raised a RuntimeError midway through the call.
    with stats_tracker.scope("moved"):
        stats_tracker.denominator(m=torch.ones(2, dtype=torch.bool, device="meta"))
        stats_tracker.stat(a=torch.ones(2, device="meta"), denominator="m")
        stats_tracker.denominator(m=torch.ones(2, dtype=torch.bool))
        stats_tracker.stat(a=torch.ones(2), denominator="m")
    acc = stats_tracker.DEFAULT_TRACKER._tensors["moved/a"][1]
    assert acc.sw.device.type == "meta" and acc.lo is not None and acc.lo.device.type == "meta"


async def test_scope_decorates_callables_that_return_coroutines_or_generators() -> None:
    # Not coroutine/generator *functions* to inspect: the scope must still cover the
    # body, which runs only when awaited or iterated.
    class Agent:
        async def __call__(self, i: int) -> int:
            await asyncio.sleep(0)
            stats_tracker.scalar(turn=float(i))
            return i

    class Source:
        def __call__(self) -> Iterator[int]:
            def body() -> Iterator[int]:
                stats_tracker.scalar(item=1.0)
                yield 1

            return body()

    agent = stats_tracker.scope("agent")(Agent())
    source = stats_tracker.scope("source")(Source())
    assert await asyncio.wait_for(agent(3), timeout=10) == 3
    assert list(source()) == [1]
    assert stats_tracker.export() == {
        "agent/turn": 3.0,
        "agent/turn__count": 1,
        "source/item": 1.0,
        "source/item__count": 1,
    }


def test_ring_mixes_unscoped_and_scoped_events() -> None:
    # A fresh tracker appends bare dicts until a scope is first used, (scope, dict) after.
    tracker = stats_tracker.DistributedStatsTracker("mixed")
    tracker.scalar(a=1.0)
    with tracker.scope("s"):
        tracker.scalar(a=3.0)
    tracker.scalar(a=5.0)
    tracker.fold()
    with tracker.scope("s"):
        tracker.scalar(a=7.0)
    assert tracker.pending_events() == 1
    assert tracker.export() == {
        "mixed/a": 3.0,
        "mixed/a__count": 2,
        "mixed/s/a": 5.0,
        "mixed/s/a__count": 2,
    }


async def test_decorated_generators_keep_their_inner_scopes_across_yields() -> None:
    # The body yields inside its own scope: that scope stays the body's (its later
    # records carry it) and never leaks into the consumer between items.
    @stats_tracker.scope("g")
    def turns() -> Iterator[int]:
        for i in range(2):
            with stats_tracker.scope("turn"):
                yield i
                stats_tracker.scalar(x=1.0)
        stats_tracker.scalar(end=1.0)

    @stats_tracker.scope("ag")
    async def aturns() -> AsyncIterator[int]:
        for i in range(2):
            with stats_tracker.scope("turn"):
                await asyncio.sleep(0)
                yield i
                stats_tracker.scalar(x=1.0)

    for _ in turns():
        assert stats_tracker.DEFAULT_TRACKER.current_scope() == ""
        stats_tracker.scalar(consumer=1.0)

    async def consume() -> None:
        async for _ in aturns():
            assert stats_tracker.DEFAULT_TRACKER.current_scope() == ""
            stats_tracker.scalar(aconsumer=1.0)

    await asyncio.wait_for(asyncio.gather(consume(), consume()), timeout=10)
    out = stats_tracker.export()
    assert out == {
        "g/turn/x": 1.0,
        "g/turn/x__count": 2,
        "g/end": 1.0,
        "g/end__count": 1,
        "consumer": 1.0,
        "consumer__count": 2,
        "ag/turn/x": 1.0,
        "ag/turn/x__count": 4,
        "aconsumer": 1.0,
        "aconsumer__count": 4,
    }

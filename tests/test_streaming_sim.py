"""Many rollout workers in one event loop, streaming to a real controller over ZMQ.

Each simulated worker has its own record source (the real tracker is one per process) and
runs many concurrent workflows. All values are small integers, so float64 sums are exact
in any order and the assertions use ``==``.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import zmq
import zmq.asyncio

from areal_stream.controller import ControllerOptions, ControllerService
from areal_stream.streams import LocalRecordSource, RolloutStream
from bus import ReduceType
from workers._train import TrainReporter

pytestmark = pytest.mark.timeout(90)

N_WORKERS = 64
N_FLOWS = 8


class ListSink:
    def __init__(self) -> None:
        self.steps: dict[int, dict[str, Any]] = {}

    def commit(self, epoch: int, step: int, global_step: int, data: Mapping[str, Any]) -> None:
        assert global_step not in self.steps
        self.steps[global_step] = dict(data)

    def close(self) -> None:
        pass


@dataclass
class Tally:
    """What the test recorded: count, sum, min, max of ``reward`` and ``len``."""

    n: int = 0
    s: float = 0.0
    len_w: float = 0.0
    len_s: float = 0.0
    len_lo: float = float("inf")
    len_hi: float = float("-inf")
    per_worker: dict[str, int] = field(default_factory=dict)

    def add(self, other: Tally) -> None:
        self.n += other.n
        self.s += other.s
        self.len_w += other.len_w
        self.len_s += other.len_s
        self.len_lo = min(self.len_lo, other.len_lo)
        self.len_hi = max(self.len_hi, other.len_hi)


async def workflow(src: LocalRecordSource, rng: random.Random, n: int, t: Tally) -> None:
    """One rollout episode loop: records synchronously, yields to the loop in between."""
    for _ in range(n):
        r = float(rng.randint(-3, 9))
        src.scalar(**{"rollout/reward": r})
        t.n += 1
        t.s += r
        toks = rng.randint(1, 6)
        lens = [float(rng.randint(1, 50)) for _ in range(toks)]
        src.add("rollout/len", ReduceType.AVG_MIN_MAX, [sum(lens), toks, min(lens), max(lens)])
        t.len_w += toks
        t.len_s += sum(lens)
        t.len_lo = min(t.len_lo, *lens)
        t.len_hi = max(t.len_hi, *lens)
        await asyncio.sleep(0)


@pytest.fixture
def ctx() -> Iterator[zmq.asyncio.Context]:
    """One context for a test's workers; destroyed (closing any socket a failed test left
    open) rather than terminated, which would block on such a socket."""
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


@asynccontextmanager
async def controller(**kw: Any) -> AsyncIterator[tuple[ControllerService, ListSink]]:
    sink = ListSink()
    svc = ControllerService(
        sink, ControllerOptions(data="tcp://127.0.0.1:0", control="tcp://127.0.0.1:0", **kw)
    )
    await svc.start()
    task = asyncio.create_task(svc.serve())
    try:
        yield svc, sink
    finally:
        svc.stop()
        await asyncio.wait_for(task, 30)


def step_tally(stats: Mapping[str, Any]) -> tuple[int, float, float | None, float | None]:
    n = stats.get("rollout/reward__count", 0)
    return (
        n,
        stats.get("rollout/reward", 0.0) * n,
        stats.get("rollout/len/min"),
        stats.get("rollout/len/max"),
    )


async def test_phased_recording_is_exact_per_step_with_join_restart_and_crash(
    ctx: zmq.asyncio.Context,
) -> None:
    rng = random.Random(7)
    async with controller(seal_timeout=5.0, gone_min=0.5) as (svc, sink):
        srcs = [LocalRecordSource() for _ in range(N_WORKERS)]

        def stream(i: int, src: LocalRecordSource) -> RolloutStream:
            return RolloutStream(
                svc.data_addr,
                svc.control_addr,
                f"rollout-{i}",
                source=src,
                heartbeat_interval=0.1,
                context=ctx,
            )

        streams = [stream(i, s) for i, s in enumerate(srcs)]
        await asyncio.gather(*(s.start() for s in streams))
        trainer = TrainReporter(lambda **kw: {"actor/loss": 0.5}, data=svc.data_addr, rank=0)
        expected: dict[int, Tally] = {}
        late_src = LocalRecordSource()
        late: RolloutStream | None = None
        dead: set[int] = set()
        try:
            for step in range(1, 6):
                t = Tally()
                active = [(i, s) for i, s in enumerate(srcs) if i not in dead]
                if late is not None:
                    active.append((N_WORKERS, late_src))
                tallies = [Tally() for _ in range(len(active) * N_FLOWS)]
                await asyncio.gather(
                    *(
                        workflow(src, random.Random(rng.random()), 5 + (j % 4), tallies[k])
                        for k, ((_, src), j) in enumerate(
                            (a, j) for a in active for j in range(N_FLOWS)
                        )
                    )
                )
                for x in tallies:
                    t.add(x)
                expected[step] = t
                trainer.commit(step, epoch=0, epoch_step=step)
                await svc.wait_committed(step, 20)
                if step == 1:  # a late joiner: from step 2 on
                    late = RolloutStream(
                        svc.data_addr, svc.control_addr, "late", source=late_src, context=ctx
                    )
                    await late.start()
                if step == 2:  # restart rollout-0: same id, a new incarnation
                    await streams[0].aclose()
                    streams[0] = stream(0, srcs[0])
                    await streams[0].start()
                if step == 3:  # rollout-1 crashes after its data for step 3 was committed
                    await streams[1].abort()
                    dead.add(1)
        finally:
            await asyncio.to_thread(trainer.close)
            await asyncio.gather(*(s.aclose() for s in streams))
            if late is not None:
                await late.aclose()
    assert sorted(sink.steps)[:5] == [1, 2, 3, 4, 5]
    for step, t in expected.items():
        stats = sink.steps[step]
        n, s, lo, hi = step_tally(stats)
        assert (n, s) == (t.n, t.s), f"step {step}"
        assert (lo, hi) == (t.len_lo, t.len_hi), f"step {step}"
        assert stats["rollout/len/avg"] == t.len_s / t.len_w
        assert stats["actor/loss"] == 0.5
        assert stats["bus/late_events"] == 0
        assert stats["bus/duplicate_batches"] == 0 and stats["bus/gap_batches"] == 0
    assert sink.steps[1]["bus/workers_seen"] == N_WORKERS
    assert sink.steps[2]["bus/expected_workers"] == N_WORKERS + 1  # the late joiner
    assert sink.steps[3]["bus/restarts"] == 1
    # after the crash, step 4 did not wait the seal timeout: the dead worker was declared
    # gone after missing its heartbeats (or was counted missing once)
    assert sink.steps[4]["bus/seal_latency_ms"] < 5000
    assert sink.steps[5]["bus/missing_workers"] == 0


async def test_continuous_streaming_conserves_counts_and_sums_under_garbage(
    ctx: zmq.asyncio.Context,
) -> None:
    """Workflows record while the trainer commits; over the whole run nothing is lost or
    counted twice, with garbage injected into the controller's socket meanwhile."""
    async with controller(seal_timeout=5.0) as (svc, sink):
        srcs = [LocalRecordSource() for _ in range(N_WORKERS)]
        streams = [
            RolloutStream(
                svc.data_addr, svc.control_addr, f"w{i}", source=s, context=ctx, flush_interval=0.02
            )
            for i, s in enumerate(srcs)
        ]
        await asyncio.gather(*(s.start() for s in streams))
        trainer = TrainReporter(lambda **kw: {}, data=svc.data_addr, rank=0)
        bad = ctx.socket(zmq.PUSH)
        bad.setsockopt(zmq.LINGER, 0)
        bad.connect(svc.data_addr)
        tallies = [Tally() for _ in range(N_WORKERS * N_FLOWS)]
        rng = random.Random(11)
        try:
            flows = asyncio.gather(
                *(
                    workflow(srcs[k // N_FLOWS], random.Random(rng.random()), 40, tallies[k])
                    for k in range(N_WORKERS * N_FLOWS)
                )
            )
            step = 0
            while not flows.done():
                step += 1
                trainer.commit(step)
                await bad.send(b"\xff" * (step % 7 + 1))
                await svc.wait_committed(step, 20)
            await flows
        finally:
            bad.close(0)
            await asyncio.to_thread(trainer.close)
            await asyncio.gather(*(s.aclose() for s in streams))
    total = Tally()
    for x in tallies:
        total.add(x)
    n = sum(step_tally(s)[0] for s in sink.steps.values())
    ssum = sum(step_tally(s)[1] for s in sink.steps.values())
    assert step >= 2
    assert n == total.n and ssum == total.s
    assert sum(s["bus/decode_errors"] for s in sink.steps.values()) == step
    assert sum(s["bus/duplicate_batches"] for s in sink.steps.values()) == 0
    steps_with_len = [s for s in sink.steps.values() if "rollout/len/min" in s]
    assert min(s["rollout/len/min"] for s in steps_with_len) == total.len_lo
    assert max(s["rollout/len/max"] for s in steps_with_len) == total.len_hi

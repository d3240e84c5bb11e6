"""The controller service over real ZMQ sockets on 127.0.0.1 (in-process), and its CLI."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from areal_stream import Table
from areal_stream.controller import ControllerOptions, ControllerService, combine
from areal_stream.streams import LocalRecordSource, RolloutStream
from bus import ReduceType
from bus._codec import Header, Seal, Welcome, decode, encode_batch, encode_hello
from workers._train import TrainReporter

pytestmark = pytest.mark.timeout(60)


class ListSink:
    def __init__(self) -> None:
        self.steps: list[tuple[int, int, int, dict[str, Any]]] = []
        self.closed = False

    def commit(self, epoch: int, step: int, global_step: int, data: Mapping[str, Any]) -> None:
        self.steps.append((epoch, step, global_step, dict(data)))

    def close(self) -> None:
        self.closed = True

    def by_step(self) -> dict[int, dict[str, Any]]:
        return {g: s for _, _, g, s in self.steps}


@asynccontextmanager
async def running(
    sink: ListSink | None = None, **kw: Any
) -> AsyncIterator[tuple[ControllerService, ListSink]]:
    sink = sink if sink is not None else ListSink()
    opts = ControllerOptions(data="tcp://127.0.0.1:0", control="tcp://127.0.0.1:0", **kw)
    svc = ControllerService(sink, opts)
    await svc.start()
    task = asyncio.create_task(svc.serve())
    try:
        yield svc, sink
    finally:
        svc.stop()
        await asyncio.wait_for(task, 20)


def reporter(svc: ControllerService, stats: Callable[[], dict[str, Any]]) -> TrainReporter:
    return TrainReporter(lambda **kw: stats(), data=svc.data_addr, rank=0, close_timeout=2.0)


async def test_step_merges_train_stats_and_rollout_window() -> None:
    async with running(seal_timeout=10.0) as (svc, sink):
        src_a, src_b = LocalRecordSource(), LocalRecordSource()
        ra = RolloutStream(svc.data_addr, svc.control_addr, "a", source=src_a)
        rb = RolloutStream(svc.data_addr, svc.control_addr, "b", source=src_b)
        async with ra, rb:
            src_a.scalar(reward=1.0)
            src_a.scalar(reward=3.0)
            src_b.scalar(reward=8.0, shared=4.0)
            src_b.add("len", ReduceType.AVG_MIN_MAX, [30.0, 3.0, 2.0, 20.0])
            table = Table(["expert", "tokens"], [[0, 5], [1, 9]], index=["expert"])
            train = {"loss": 0.25, "shared": 1.0, "shared__count": 1, "moe": table}
            rep = reporter(svc, lambda: train)
            try:
                rep.commit(1, epoch=2, epoch_step=3)
                await svc.wait_committed(1, 10)
            finally:
                await asyncio.to_thread(rep.close)
        epoch, estep, gstep, stats = sink.steps[0]
        assert (epoch, estep, gstep) == (2, 3, 1)
        assert stats["loss"] == 0.25 and stats["moe"] == table
        assert stats["reward"] == 4.0 and stats["reward__count"] == 3
        assert stats["len/avg"] == 10.0 and stats["len/min"] == 2.0 and stats["len/max"] == 20.0
        assert stats["shared"] == 2.5 and stats["shared__count"] == 2  # count-weighted
        assert stats["bus/workers_seen"] == 2 and stats["bus/missing_workers"] == 0
        assert stats["bus/decode_errors"] == 0 and stats["bus/key_collisions"] == 0
        assert stats["bus/seal_latency_ms"] >= 0.0
        assert ra.statistics().bye_acked and rb.statistics().bye_acked
    assert sink.closed


def test_combine_collisions() -> None:
    out, n = combine({"x": 1.0, "y": 2.0}, {"x": 5.0, "z": 1.0, "z__count": 2})
    assert out == {"x": 5.0, "y": 2.0, "z": 1.0, "z__count": 2} and n == 1


class RawProducer:
    """A hand-driven producer: a PUSH socket plus a SUB on the control socket."""

    def __init__(self, ctx: zmq.asyncio.Context, svc: ControllerService, src: str) -> None:
        self.src, self.seq = src, 0
        self.push = ctx.socket(zmq.PUSH)
        self.sub = ctx.socket(zmq.SUB)
        for s in (self.push, self.sub):
            s.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.push.connect(svc.data_addr)
        self.sub.connect(svc.control_addr)

    def head(self) -> Header:
        self.seq += 1
        return Header(self.src, "1", self.seq)

    async def register(self) -> None:
        while True:
            await self.push.send(encode_hello(self.head(), 10.0))
            if await self.sub.poll(50):
                msg = decode(await self.sub.recv())
                if isinstance(msg, Welcome) and msg.src == self.src:
                    return

    async def wait_seal(self, step: int) -> None:
        while True:
            msg = decode(await self.sub.recv())
            if isinstance(msg, Seal) and msg.step == step:
                return

    def close(self) -> None:
        self.push.close(0)
        self.sub.close(0)


async def test_garbage_is_counted_and_nothing_held_is_lost() -> None:
    async with running(seal_timeout=10.0, max_bytes=64 * 1024, max_keys=100) as (svc, sink):
        ctx = zmq.asyncio.Context()
        w = RawProducer(ctx, svc, "w")
        bad = ctx.socket(zmq.PUSH)
        huge = ctx.socket(zmq.PUSH)
        try:
            for s in (bad, huge):
                s.setsockopt(zmq.LINGER, 0)
                s.connect(svc.data_addr)
            await w.register()
            rec = {"r": (6, [10.0, 4.0, 1.0, 4.0])}
            first = encode_batch(w.head(), rec, 4)
            await w.push.send(first)
            frame = encode_batch(w.head(), rec, 4)
            many = {f"k{i}": (6, [1.0, 1.0, 1.0, 1.0]) for i in range(500)}
            garbage = [
                b"\x00\xff garbage",
                frame[:-3],  # truncated
                frame.replace(b"\xa1v\x01", b"\xa1v\x07"),  # unknown version
                encode_batch(Header("x", "1", 1), many, 500),  # absurd key count
                b"\x93\x01\x02\x03",  # a list, not a map
                b"\xa3abc",  # a string
            ]
            for g in garbage:
                await bad.send(g)
            await huge.send(b"\x00" * (128 * 1024))  # over MAXMSGSIZE: libzmq drops it
            await w.push.send(first)  # duplicate sequence number: dropped, counted
            await w.push.send(frame)
            rep = reporter(svc, lambda: {"loss": 1.0})
            try:
                rep.commit(7)
                await w.wait_seal(7)
                await w.push.send(encode_batch(w.head(), {}, 0, mark=7))
                await svc.wait_committed(7, 10)
            finally:
                await asyncio.to_thread(rep.close)
        finally:
            w.close()
            for s in (bad, huge):
                s.close(0)
            ctx.term()
    stats = sink.by_step()[7]
    assert stats["r"] == 2.5 and stats["r__count"] == 8 and stats["loss"] == 1.0
    assert stats["bus/decode_errors"] == len(garbage)
    assert stats["bus/decode_errors_too_many_keys"] == 1
    assert stats["bus/decode_errors_version"] == 1
    assert stats["bus/decode_errors_garbage"] == 2
    assert stats["bus/duplicate_batches"] == 1 and stats["bus/gap_batches"] == 0


async def test_hung_worker_does_not_stall_and_is_not_waited_on_twice() -> None:
    async with running(seal_timeout=0.5, gone_min=30.0) as (svc, sink):
        live_src = LocalRecordSource()
        ctx = zmq.asyncio.Context()
        hung = RawProducer(ctx, svc, "hung")
        try:
            await hung.register()
            await hung.push.send(encode_batch(hung.head(), {"r": (6, [5.0, 1, 5, 5])}, 1))
            async with RolloutStream(svc.data_addr, svc.control_addr, "live", source=live_src):
                live_src.scalar(r=1.0)
                rep = reporter(svc, lambda: {})
                try:
                    t0 = asyncio.get_running_loop().time()
                    rep.commit(1)
                    await svc.wait_committed(1, 10)
                    t1 = asyncio.get_running_loop().time()
                    rep.commit(2)
                    await svc.wait_committed(2, 10)
                finally:
                    await asyncio.to_thread(rep.close)
        finally:
            hung.close()
            ctx.term()
    s = sink.by_step()
    assert s[1]["bus/missing_workers"] == 1 and s[2]["bus/missing_workers"] == 0
    assert t1 - t0 >= 0.5  # waited the timeout once ...
    # ... and not again: step 2 expected only the live worker (no wall-clock bound, which
    # a loaded machine could break)
    assert s[2]["bus/expected_workers"] == 1
    # the hung worker's data is still held; the shutdown commit includes it
    total = sum(v["r"] * v["r__count"] for v in s.values() if "r" in v)
    assert total == 6.0


def test_bind_refuses_non_loopback_without_allow_remote() -> None:
    from bus._sockets import check_bind_endpoint

    with pytest.raises(ValueError, match="loopback"):
        check_bind_endpoint("tcp://0.0.0.0:5555")
    assert check_bind_endpoint("tcp://localhost:0") == "tcp://127.0.0.1:*"
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        check_bind_endpoint("udp://x")


def test_cli_ready_file_and_clean_sigterm(tmp_path: Any) -> None:
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        "stats_logger:\n  experiment_name: e\n  trial_name: t\n"
        f"  fileroot: {tmp_path}\n  tensorboard: {{path: null}}\n  console: {{enabled: false}}\n"
    )
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "areal_stream.controller",
            "--config",
            str(cfg),
            "--bind",
            "tcp://127.0.0.1:0",
            "--control",
            "tcp://127.0.0.1:0",
            "--ready-file",
            str(ready),
            "--commit-every",
            "0.2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVTIMEO, 20_000)
        try:
            inot = 0
            while not ready.exists():
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                inot += 1
                assert inot < 2000
                with suppress(subprocess.TimeoutExpired):
                    proc.wait(0.01)
            addrs = json.loads(ready.read_text())
            assert addrs["data"].startswith("tcp://127.0.0.1:")
            sub.connect(addrs["control"])
            from bus._codec import Committed, decode

            while True:  # rollout-only windows commit on the timer
                if isinstance(decode(sub.recv()), Committed):
                    break
        finally:
            sub.close(0)
            ctx.term()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    journal = next(tmp_path.glob("logs/*/e/t/stats.jsonl"))
    lines = [json.loads(x) for x in journal.read_text().splitlines()]
    assert lines and lines[0]["global_step"] == 1 and "bus/workers_seen" in lines[0]["stats"]


def test_trainer_loop_example_runs() -> None:
    """The example starts a controller and a worker process itself and prints each step."""
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, str(root / "examples" / "trainer_loop.py"), "--steps", "2",
         "--step-seconds", "0.1"],
        capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    steps = [ln for ln in out.stdout.splitlines() if ln.startswith("step ")]
    assert steps[0].startswith("step 1: adv/avg") and steps[1].startswith("step 2: adv/avg")
    assert "missing 0" in steps[0] and "bye acknowledged: True" in out.stdout


async def test_large_flush_is_split_and_overlong_keys_are_refused_at_the_worker() -> None:
    from workers._rollout import RolloutRuntime

    async with running(seal_timeout=10.0, max_bytes=64 * 1024) as (svc, sink):
        src = LocalRecordSource()
        for i in range(5000):
            src.scalar(**{f"k/{i:05d}": float(i)})
        src.scalar(**{"x" * 2000: 1.0})
        rt = RolloutRuntime(
            src, data=svc.data_addr, control=svc.control_addr, worker_id="big", max_bytes=65536
        )
        async with rt:
            rep = reporter(svc, lambda: {})
            try:
                rep.commit(1)
                await svc.wait_committed(1, 10)
            finally:
                await asyncio.to_thread(rep.close)
        st = rt.statistics()
    stats = sink.by_step()[1]
    assert all(stats[f"k/{i:05d}"] == float(i) for i in range(5000))
    assert stats["bus/decode_errors"] == 0 and stats["bus/missing_workers"] == 0
    assert st.invalid_keys == 1 and st.batches_sent >= 5 and st.marks_sent == 1


async def test_a_step_that_fails_to_commit_costs_only_that_step(monkeypatch: Any) -> None:
    """Regression: an exception while assembling a step (e.g. a table the receiver could
    not build) escaped the committer task, so no later step was ever committed."""
    from areal_stream.controller import _service

    real = _service.assemble

    def assemble(sealed: Any) -> Any:
        if sealed.step == 1:
            raise ValueError("cannot assemble")
        return real(sealed)

    class FailingSink(ListSink):
        def commit(self, epoch: int, step: int, global_step: int, data: Mapping[str, Any]) -> None:
            if global_step == 2:
                raise RuntimeError("backend down")
            super().commit(epoch, step, global_step, data)

    monkeypatch.setattr(_service, "assemble", assemble)
    async with running(FailingSink(), seal_timeout=10.0) as (svc, sink):
        rep = reporter(svc, lambda: {"loss": 1.0})
        try:
            for step in (1, 2, 3):
                rep.commit(step)
                await svc.wait_committed(step, 10)
        finally:
            await asyncio.to_thread(rep.close)
        assert svc.commit_errors == 2
    stats = sink.by_step()
    assert sorted(stats) == [3] and stats[3]["loss"] == 1.0
    assert stats[3]["bus/commit_errors"] == 1  # step 2's (step 1's went with step 2)
    assert stats[3]["bus/internal_errors"] == 0


async def test_commit_every_with_a_trainer_keeps_every_train_report() -> None:
    """Regression: with --commit-every, timer windows went on taking step numbers after
    the trainer registered (until its first report), so its first reports were dropped."""
    async with running(seal_timeout=10.0, commit_every=0.05) as (svc, sink):
        src = LocalRecordSource()
        async with RolloutStream(svc.data_addr, svc.control_addr, "a", source=src):
            rep = reporter(svc, lambda: {"loss": 2.0})
            try:

                async def registered() -> None:
                    while not any(p.role == "train" for p in svc.book.producers.values()):
                        await asyncio.sleep(0.005)  # polls a condition, with a deadline

                await asyncio.wait_for(registered(), 10)
                k0 = max([svc.book.last_committed or 0, *svc.book.windows])
                src.scalar(r=1.0)
                await asyncio.sleep(0.3)  # the first PPO step: several timer periods pass
                for step in (k0 + 1, k0 + 2):
                    rep.commit(step)
                    await svc.wait_committed(step, 10)
            finally:
                await asyncio.to_thread(rep.close)
    stats = sink.by_step()
    assert [g for g in stats if g > k0][:2] == [k0 + 1, k0 + 2]
    assert stats[k0 + 1]["loss"] == 2.0 and stats[k0 + 2]["loss"] == 2.0
    assert sum(s["bus/stale_train_steps"] for s in stats.values()) == 0
    assert sum(s.get("r__count", 0) for s in stats.values()) == 1


async def test_a_bad_endpoint_fails_start_clearly_and_leaves_no_socket() -> None:
    """Regression: a malformed endpoint raised a bare ZMQError from ``start()`` and left
    the PUSH socket open in the context (so ``ctx.term()`` would block forever)."""
    ctx = zmq.asyncio.Context()
    try:
        for data, control, which in (
            ("tcp://127.0.0.1:notaport", "tcp://127.0.0.1:1", "data"),
            ("tcp://127.0.0.1:1", "tcp://127.0.0.1:notaport", "control"),
        ):
            s = RolloutStream(data, control, "w", source=LocalRecordSource(), context=ctx)
            with pytest.raises(ValueError, match=f"{which} endpoint 'tcp://127.0.0.1:notaport'"):
                await s.start()
            assert len(ctx._sockets) == 0  # pyzmq's registry of open sockets
    finally:
        ctx.destroy(linger=0)


class MixedSource(LocalRecordSource):
    """A custom record source that also yields records the wire cannot carry."""

    def take_records(self) -> Any:
        out: dict[Any, Any] = dict(super().take_records())
        if out:
            out.update(
                {
                    "bad/rtype": (99, [1.0, 1.0, 1.0, 1.0]),
                    "bad/weight": (6, [1.0, -1.0, 1.0, 1.0]),
                    "bad/nan_weight": (6, [1.0, float("nan"), 1.0, 1.0]),
                    "bad/short": (6, [1.0, 1.0]),
                    "bad/text": (6, ["a", "b", "c", "d"]),
                    b"bytes-key": (6, [1.0, 1.0, 1.0, 1.0]),
                }
            )
        return out


async def test_bad_records_from_a_custom_source_are_counted_not_fatal() -> None:
    """Regression: a record the flusher could not convert raised inside the background
    task, which died silently (no mark, no heartbeat); one the decoder refuses (unknown
    reduce type, negative weight) got the whole frame, and the mark it carried, rejected."""
    async with running(seal_timeout=10.0) as (svc, sink):
        src = MixedSource()
        async with RolloutStream(svc.data_addr, svc.control_addr, "m", source=src) as rs:
            src.scalar(good=2.0)
            rep = reporter(svc, lambda: {})
            try:
                rep.commit(1)
                await svc.wait_committed(1, 10)
            finally:
                await asyncio.to_thread(rep.close)
            st = rs.statistics()
    stats = sink.by_step()[1]
    assert stats["good"] == 2.0 and stats["good__count"] == 1
    assert not any(k.startswith("bad/") for k in stats)
    assert stats["bus/decode_errors"] == 0 and stats["bus/missing_workers"] == 0
    assert st.invalid_keys == 6 and st.marks_sent == 1


async def test_workers_split_frames_under_the_controllers_own_limit() -> None:
    """Regression: a controller started with a lower --max-message-bytes than the workers'
    default dropped their big flushes inside libzmq (with the mark they carried): the step
    waited out the seal timeout and the data was lost, visible only as a sequence gap.
    Likewise a lower --max-keys got the frames refused."""
    async with running(seal_timeout=3.0, max_bytes=64 * 1024) as (svc, sink):
        src = LocalRecordSource()
        for i in range(5000):
            src.scalar(**{f"k/{i:05d}": float(i)})
        async with RolloutStream(svc.data_addr, svc.control_addr, "big", source=src) as rs:
            rep = reporter(svc, lambda: {})
            try:
                rep.commit(1)
                await svc.wait_committed(1, 10)
            finally:
                await asyncio.to_thread(rep.close)
            st = rs.statistics()
    stats = sink.by_step()[1]
    assert all(stats[f"k/{i:05d}"] == float(i) for i in range(5000))
    assert stats["bus/missing_workers"] == 0 and stats["bus/gap_batches"] == 0
    assert st.batches_sent >= 5 and st.marks_sent == 1
    async with running(seal_timeout=3.0, max_keys=100) as (svc, sink):
        src = LocalRecordSource()
        for i in range(1000):
            src.scalar(**{f"k/{i:05d}": float(i)})
        async with RolloutStream(svc.data_addr, svc.control_addr, "many", source=src) as rs:
            rep = reporter(svc, lambda: {})
            try:
                rep.commit(1)
                await svc.wait_committed(1, 10)
            finally:
                await asyncio.to_thread(rep.close)
            st = rs.statistics()
    stats = sink.by_step()[1]
    assert all(stats[f"k/{i:05d}"] == float(i) for i in range(1000))
    assert stats["bus/decode_errors"] == 0 and stats["bus/missing_workers"] == 0
    assert st.batches_sent == 10 and st.marks_sent == 1


def test_frame_limits_are_checked_at_the_boundary() -> None:
    for opts, what in (
        (ControllerOptions(max_bytes=-1), "max_bytes"),
        (ControllerOptions(max_bytes=100), "max_bytes"),
        (ControllerOptions(max_keys=0), "max_keys"),
    ):
        with pytest.raises(ValueError, match=what):
            ControllerService(ListSink(), opts)
    with pytest.raises(TypeError, match="max_bytes"):
        ControllerService(ListSink(), ControllerOptions(max_bytes=1.5e6))  # type: ignore[arg-type]


async def test_a_frame_that_trips_a_bug_is_counted_and_the_controller_goes_on() -> None:
    """Anything but a DecodeError from handling a frame used to end ``serve()``; now it is
    logged, counted in ``bus/internal_errors``, and the next frames are handled."""
    async with running(seal_timeout=10.0) as (svc, sink):
        real = svc.book.handle
        tripped: list[object] = []

        def handle(msg: Any, now: float) -> list[int]:
            if not tripped:
                tripped.append(msg)
                raise KeyError("a bug")
            return real(msg, now)

        svc.book.handle = handle  # type: ignore[method-assign]
        rep = reporter(svc, lambda: {"loss": 3.0})  # its hello trips the bug
        try:
            rep.commit(1)
            await svc.wait_committed(1, 10)
        finally:
            await asyncio.to_thread(rep.close)
    stats = sink.by_step()[1]
    assert stats["loss"] == 3.0 and stats["bus/internal_errors"] == 1 and len(tripped) == 1


async def test_trainer_reports_nobody_took_are_counted_and_named(caplog: Any) -> None:
    """Reports queued for an address where no controller ever answered are not silently
    lost on close: they are counted and a warning names the address."""
    ctx = zmq.Context()
    probe = ctx.socket(zmq.PULL)
    port = probe.bind_to_random_port("tcp://127.0.0.1")
    probe.close(linger=0)  # a free port with nothing listening
    ctx.term()
    dead = TrainReporter(
        lambda **kw: {"x": 1.0}, data=f"tcp://127.0.0.1:{port}", rank=0, close_timeout=0.3
    )
    dead.commit(0)
    dead.commit(1)
    with caplog.at_level("WARNING"):
        await asyncio.to_thread(dead.close)
    assert dead.statistics().reports_undelivered == 2
    assert f"tcp://127.0.0.1:{port}" in caplog.text and "2 step report(s)" in caplog.text
    async with running(seal_timeout=5.0) as (svc, sink):
        live = reporter(svc, lambda: {"x": 1.0})
        live.commit(0)
        await svc.wait_committed(0, 10)
        await asyncio.to_thread(live.close)
    assert live.statistics().reports_undelivered == 0
    assert sink.by_step()[0]["x"] == 1.0

"""The controller service: PULL producer frames, keep step windows, commit complete steps.

One asyncio task receives frames (data socket, PULL), decodes and validates them, and feeds
the pure window book (``bus._window``); seals, commit notices and bye acknowledgements go
out on the control socket (PUB). Complete windows go to an async committer that merges the
train report with the rollout window, adds the ``bus/`` counters and hands the step to the
sink (``StatsLogger.commit``), strictly in step order.

Bad frames are logged (rate-limited), counted in ``bus/decode_errors`` and skipped;
nothing already held is touched by them. A step that fails to assemble or commit is
logged and counted in ``bus/commit_errors`` (reported with the next step); the committer
goes on with the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import zmq
import zmq.asyncio

from areal_stream._table import Table
from bus import ReduceType, project
from bus._codec import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_KEYS,
    Bye,
    ByeAck,
    Committed,
    DecodeError,
    Hello,
    Seal,
    TableData,
    Train,
    Welcome,
    decode,
    encode_byeack,
    encode_committed,
    encode_seal,
    encode_welcome,
)
from bus._sockets import bind, configure
from bus._window import SealedWindow, WindowBook

log = logging.getLogger("areal_stream.controller")

_COUNT = "__count"


class Sink(Protocol):
    """Where committed steps go (a ``StatsLogger``; tests may pass their own)."""

    def commit(self, epoch: int, step: int, global_step: int, data: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def make_sink(config_path: str | None) -> Sink:
    """The ``StatsLogger`` for the run's config (journal first, then every backend)."""
    from areal_stream.config import load_config
    from areal_stream.stats_logger import StatsLogger

    if config_path is None:
        raise ValueError("--config is required (the YAML with the stats_logger: block)")
    sink: Sink = StatsLogger(load_config(config_path))
    return sink


class _RateLimitedLog:
    """Log the first few problems of each kind, then one summary per interval."""

    def __init__(self, first: int = 5, interval: float = 10.0) -> None:
        self.first, self.interval = first, interval
        self.seen: dict[str, int] = {}
        self.last: dict[str, float] = {}

    def __call__(self, kind: str, msg: str) -> None:
        n = self.seen[kind] = self.seen.get(kind, 0) + 1
        now = time.monotonic()
        if n <= self.first or now - self.last.get(kind, 0.0) >= self.interval:
            self.last[kind] = now
            log.warning("controller: rejected frame (%s, %d so far): %s", kind, n, msg)


def _table(t: TableData) -> Table:
    return Table(t.columns, t.rows, index=t.index, heatmap=t.heatmap)


def combine(train: Mapping[str, Any], rollout: Mapping[str, float]) -> tuple[dict[str, Any], int]:
    """Train stats plus the projected rollout window.

    A key present on both sides with a ``__count`` on both is averaged weighted by count
    (as ``merge_worker_stats``); any other collision takes the rollout value, as the
    reference's ``stats.update(rollout.export_stats())`` does, and is counted.
    """
    out: dict[str, Any] = dict(train)
    collisions = 0
    for k, v in rollout.items():
        if k.endswith(_COUNT):
            continue
        if k not in out:
            out[k] = v
            if k + _COUNT in rollout:
                out[k + _COUNT] = rollout[k + _COUNT]
            continue
        ck = k + _COUNT
        a, b = train.get(k), v
        ca, cb = train.get(ck), rollout.get(ck)
        if (
            isinstance(ca, (int, float))
            and isinstance(cb, (int, float))
            and isinstance(a, (int, float))
            and not isinstance(a, bool)
        ):
            n = ca + cb
            out[k] = (a * ca + b * cb) / n if n > 0 else 0.0
            out[ck] = n
        else:
            out[k] = v
            if cb is not None:
                out[ck] = cb
            collisions += 1
    return out, collisions


def assemble(sealed: SealedWindow) -> tuple[int, int, dict[str, Any]]:
    """(epoch, epoch_step, stats) for a committed window."""
    rollout: dict[str, float] = {}
    for k, (rt, rec) in sealed.records.items():
        rollout.update(project(k, ReduceType(rt), rec))
    if sealed.train is not None:
        train = {
            k: _table(v) if isinstance(v, TableData) else v for k, v in sealed.train.stats.items()
        }
        epoch, epoch_step = sealed.train.epoch, sealed.train.epoch_step
    else:
        train, epoch, epoch_step = {}, 0, sealed.step
    stats, collisions = combine(train, rollout)
    for k, v in sealed.counters.items():
        stats["bus/" + k] = v
    stats["bus/key_collisions"] = collisions
    return epoch, epoch_step, stats


@dataclass
class ControllerOptions:
    data: str = "tcp://127.0.0.1:5555"
    control: str = "tcp://127.0.0.1:5556"
    seal_timeout: float = 10.0
    commit_every: float | None = None
    max_bytes: int = DEFAULT_MAX_BYTES
    max_keys: int = DEFAULT_MAX_KEYS
    allow_remote: bool = False
    gone_min: float = 1.0
    reannounce_interval: float = 0.05
    ready_file: str | None = None


class ControllerService:
    """The controller; ``await start()`` binds, ``await serve()`` runs until ``stop()``."""

    def __init__(self, sink: Sink, options: ControllerOptions | None = None) -> None:
        self.options = opts = options or ControllerOptions()
        if opts.seal_timeout <= 0:
            raise ValueError(f"seal_timeout must be > 0, got {opts.seal_timeout}")
        if opts.commit_every is not None and opts.commit_every <= 0:
            raise ValueError(f"commit_every must be > 0, got {opts.commit_every}")
        if isinstance(opts.max_bytes, bool) or not isinstance(opts.max_bytes, int):
            raise TypeError(f"max_bytes must be an int, got {type(opts.max_bytes).__name__}")
        if opts.max_bytes < 4096:  # a negative MAXMSGSIZE would mean "no limit" to libzmq
            raise ValueError(
                f"max_bytes (--max-message-bytes) must be >= 4096, got {opts.max_bytes}"
            )
        if isinstance(opts.max_keys, bool) or not isinstance(opts.max_keys, int):
            raise TypeError(f"max_keys must be an int, got {type(opts.max_keys).__name__}")
        if opts.max_keys < 1:
            raise ValueError(f"max_keys (--max-keys) must be >= 1, got {opts.max_keys}")
        self.sink = sink
        self.book = WindowBook(
            seal_timeout=opts.seal_timeout,
            gone_min=opts.gone_min,
            reannounce_interval=opts.reannounce_interval,
        )
        self._ctx = zmq.asyncio.Context()
        self._pull: zmq.asyncio.Socket | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self.data_addr = ""
        self.control_addr = ""
        self._stop = asyncio.Event()
        self._queue: asyncio.Queue[SealedWindow | None] = asyncio.Queue()
        self._committer: asyncio.Task[None] | None = None
        self._bad = _RateLimitedLog()
        self._next_timer: float | None = None
        self.committed_steps: list[int] = []
        self.commit_errors = 0
        self._committed = asyncio.Condition()

    async def start(self) -> None:
        opts = self.options
        self._pull = self._ctx.socket(zmq.PULL)
        configure(self._pull, max_bytes=opts.max_bytes)
        self._pull.setsockopt(zmq.RCVHWM, 100_000)
        self._pub = self._ctx.socket(zmq.PUB)
        configure(self._pub, max_bytes=None)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        try:
            self.data_addr = bind(self._pull, opts.data, allow_remote=opts.allow_remote)
            self.control_addr = bind(self._pub, opts.control, allow_remote=opts.allow_remote)
        except ValueError:
            self._pull.close(0)
            self._pub.close(0)
            self._ctx.term()
            raise
        if opts.ready_file:
            tmp = f"{opts.ready_file}.tmp{os.getpid()}"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump({"data": self.data_addr, "control": self.control_addr}, f)
            os.replace(tmp, opts.ready_file)
        if opts.commit_every is not None:
            self._next_timer = time.monotonic() + opts.commit_every
        self._committer = asyncio.get_running_loop().create_task(self._commit_loop())
        log.info("controller listening: data %s control %s", self.data_addr, self.control_addr)

    def stop(self) -> None:
        """Ask ``serve()`` to finish: it commits what it holds and returns."""
        self._stop.set()

    def statistics(self) -> dict[str, Any]:
        out = self.book.statistics()
        out["committed_steps"] = len(self.committed_steps)
        out["commit_errors"] = self.commit_errors
        return out

    async def wait_committed(self, step: int, timeout: float | None = None) -> None:
        """Wait until ``step`` (or a later one) has been handed to the sink."""

        async def _wait() -> None:
            async with self._committed:
                await self._committed.wait_for(
                    lambda: bool(self.committed_steps) and self.committed_steps[-1] >= step
                )

        await asyncio.wait_for(_wait(), timeout)

    async def serve(self) -> None:
        """Receive and window frames until ``stop()``; then drain, commit and close."""
        if self._pull is None:
            await self.start()
        try:
            await self._loop()
        finally:
            await self._shutdown()

    # ------------------------------------------------------------------ loop

    async def _publish(self, frame: bytes) -> None:
        assert self._pub is not None
        with contextlib.suppress(zmq.Again):
            await self._pub.send(frame, zmq.NOBLOCK)

    async def _loop(self) -> None:
        assert self._pull is not None
        pull = self._pull
        stop_wait = asyncio.ensure_future(self._stop.wait())
        try:
            while not self._stop.is_set():
                timeout = self._poll_timeout()
                poll = asyncio.ensure_future(pull.poll(int(timeout * 1000) + 1))
                await asyncio.wait({poll, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
                if not poll.done():
                    poll.cancel()
                    break
                if poll.result():
                    await self._drain_frames(pull)
                await self._after_frames()
        finally:
            stop_wait.cancel()

    def _poll_timeout(self) -> float:
        t = 0.02
        now = time.monotonic()
        dl = self.book.next_deadline()
        if dl is not None:
            t = min(t, max(dl - now, 0.0), self.options.reannounce_interval)
        if self._next_timer is not None:
            t = min(t, max(self._next_timer - now, 0.0))
        return t

    async def _drain_frames(self, pull: zmq.asyncio.Socket, limit: int = 4096) -> None:
        for _ in range(limit):
            try:
                frame = await pull.recv(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            await self._handle_frame(frame)

    async def _handle_frame(self, frame: bytes) -> None:
        now = time.monotonic()
        try:
            msg = decode(frame, max_bytes=self.options.max_bytes, max_keys=self.options.max_keys)
            if isinstance(msg, (Seal, Committed, ByeAck, Welcome)):
                raise DecodeError("schema", f"{type(msg).__name__} is not a producer frame")
            stale = self.book.totals["stale_train_steps"]
            announce = self.book.handle(msg, now)
        except DecodeError as e:
            self.book.count("decode_errors")
            self.book.count("decode_errors_" + e.reason)
            self._bad(e.reason, e.detail)
            return
        except Exception:  # a bug must not stop the controller: count, log, go on
            self.book.count("internal_errors")
            log.exception("controller: handling a frame failed (counted in bus/internal_errors)")
            return
        if announce:
            for step in announce:
                await self._publish(encode_seal(step))
        elif isinstance(msg, Train) and self.book.totals["stale_train_steps"] > stale:
            timer = self.book.last_timer_step
            why = (
                f" (--commit-every windows took steps up to {timer} before the trainer registered)"
                if timer is not None and msg.step <= timer
                else ""
            )
            self._bad(
                "stale_train",
                f"train report for step {msg.step} dropped: that step was already reported "
                f"or committed{why} (counted in bus/stale_train_steps)",
            )
        if isinstance(msg, Bye):
            await self._publish(encode_byeack(msg.head.src, msg.head.inc))
        elif isinstance(msg, Hello):
            opts = self.options  # the frame limits, so the worker sizes its batches under them
            await self._publish(
                encode_welcome(msg.head.src, msg.head.inc, opts.max_bytes, opts.max_keys)
            )

    async def _after_frames(self) -> None:
        now = time.monotonic()
        if (
            self._next_timer is not None
            and now >= self._next_timer
            and self.options.commit_every is not None
        ):
            self._next_timer = now + self.options.commit_every
            step = self.book.open_timer_window(now)  # None once a trainer registered
            if step is not None:
                await self._publish(encode_seal(step))
        for step in self.book.reannounce(now):
            await self._publish(encode_seal(step))
        for sealed in self.book.tick(now):
            if sealed.missing:
                log.warning(
                    "controller: step %d committed without %d worker(s): %s",
                    sealed.step,
                    len(sealed.missing),
                    ", ".join(f"{s}#{i}" for s, i in sealed.missing[:8]),
                )
            self._queue.put_nowait(sealed)

    # ------------------------------------------------------------------ committer

    async def _commit_loop(self) -> None:
        while True:
            sealed = await self._queue.get()
            if sealed is None:
                return
            try:  # any failure costs this step only, never the committer
                epoch, epoch_step, stats = assemble(sealed)
                await asyncio.to_thread(self.sink.commit, epoch, epoch_step, sealed.step, stats)
            except Exception:
                self.commit_errors += 1
                self.book.count("commit_errors")  # reported with the next step
                log.exception("controller: committing step %d failed", sealed.step)
            async with self._committed:
                self.committed_steps.append(sealed.step)
                self._committed.notify_all()
            await self._publish(encode_committed(sealed.step))

    async def _shutdown(self) -> None:
        try:
            # frames already queued in the socket are part of what we hold
            if self._pull is not None:
                await self._drain_frames(self._pull, limit=10_000_000)
            for sealed in self.book.drain(time.monotonic()):
                self._queue.put_nowait(sealed)
            self._queue.put_nowait(None)
            if self._committer is not None:
                await self._committer
            try:
                await asyncio.to_thread(self.sink.close)
            except Exception:
                log.exception("controller: closing the sink failed")
        finally:  # whatever failed above, never leave sockets open (term() would hang)
            for s in (self._pull, self._pub):
                if s is not None:
                    s.close(linger=0)
            self._ctx.term()

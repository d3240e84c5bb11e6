"""The rollout-worker streaming runtime: drain a record source, fold, encode, PUSH.

A background asyncio task in the worker's event loop

- drains the process's records (an injected :class:`RecordSource`, by default the
  process-wide stats tracker) on a short interval, and sooner when the source reports
  many pending events;
- answers each seal the controller announces (control SUB socket) by flushing and sending
  a batch that carries the mark: the controller's step window is then exactly what was
  recorded before that point;
- sends a heartbeat when idle, and on close a final batch and a ``bye``, then waits
  (bounded) for the controller's acknowledgement so nothing queued is lost on exit.

Every frame carries the worker id, an incarnation (unique per start) and a sequence
number, so the controller can drop duplicates and count gaps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import zmq
import zmq.asyncio

from bus import ReduceType, merge_into
from bus._codec import (
    DEFAULT_MAX_BYTES,
    MAX_KEY_LEN,
    MAX_WEIGHT,
    ByeAck,
    Committed,
    DecodeError,
    Header,
    Seal,
    Welcome,
    decode,
    encode_batch,
    encode_bye,
    encode_heartbeat,
    encode_hello,
)

log = logging.getLogger(__name__)

RawRecords = Mapping[str, tuple[Any, Sequence[float]]]
_KEYS_PER_FRAME = 20_000


class RecordSource(Protocol):
    """Where a worker's records come from (the stats tracker, or a per-worker test source)."""

    def take_records(self) -> RawRecords:
        """Fold and remove everything recorded so far: key -> (reduce type, [s, w, lo, hi])."""
        ...

    def pending_events(self) -> int:
        """Events recorded but not yet folded (drives the size-triggered flush)."""
        ...


class LocalRecordSource:
    """A self-contained record source: one per simulated worker in a many-worker test.

    ``scalar(key=value)`` folds at once into this source's own records, so many workers in
    one process stay independent (the real stats tracker is one per process).
    """

    def __init__(self) -> None:
        self._records: dict[str, tuple[ReduceType, list[float]]] = {}
        self._pending = 0

    def scalar(self, **kw: float) -> None:
        for k, v in kw.items():
            x = float(v)
            self.add(k, ReduceType.SCALAR, [x, 1.0, x, x])

    def add(self, key: str, rtype: ReduceType, record: Sequence[float]) -> None:
        cur = self._records.get(key)
        if cur is None:
            self._records[key] = (rtype, list(record))
        else:
            merge_into(cur[1], list(record))
        self._pending += 1

    def take_records(self) -> dict[str, tuple[ReduceType, list[float]]]:
        out, self._records, self._pending = self._records, {}, 0
        return out

    def pending_events(self) -> int:
        return self._pending


@dataclass
class RolloutStatistics:
    """Counters of one worker's streaming runtime."""

    worker_id: str
    incarnation: str
    frames_sent: int = 0
    batches_sent: int = 0
    events_sent: int = 0
    keys_sent: int = 0
    marks_sent: int = 0
    last_mark: int | None = None
    heartbeats_sent: int = 0
    seals_seen: int = 0
    committed_step: int | None = None
    control_decode_errors: int = 0
    source_errors: int = 0
    invalid_keys: int = 0
    welcomed: bool = False
    bye_acked: bool = False
    closed: bool = False


_RTYPES = frozenset(int(r) for r in ReduceType)


def _wire_record(key: Any, value: Any) -> tuple[int, list[float]] | str:
    """``(reduce type, [sum, weight, min, max])`` as the controller's decoder accepts it, or
    why it cannot be sent: one bad record from a custom source must not get the whole frame
    (and the mark it may carry) rejected, nor stop the flusher."""
    if type(key) is not str or not 0 < len(key) <= MAX_KEY_LEN:
        return f"the key must be a str of 1 to {MAX_KEY_LEN} characters"
    try:
        rt, rec = value
        code = int(rt)
        vals = [float(x) for x in rec]
    except (TypeError, ValueError, OverflowError):
        return "the record is not (reduce type, [sum, weight, min, max])"
    if code not in _RTYPES or len(vals) != 4:
        return "the record is not (reduce type, [sum, weight, min, max])"
    if not 0.0 <= vals[1] <= MAX_WEIGHT:
        return f"its weight {vals[1]!r} is not in [0, 2**53]"
    return code, vals


def new_incarnation() -> str:
    """Unique per process start: start time, pid and a random suffix."""
    return f"{int(time.time() * 1000):x}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


_shared_ctx: zmq.asyncio.Context | None = None


def shared_context() -> zmq.asyncio.Context:
    """One asyncio ZMQ context per process (sockets close with an explicit linger)."""
    global _shared_ctx
    if _shared_ctx is None or _shared_ctx.closed:
        _shared_ctx = zmq.asyncio.Context()
    return _shared_ctx


class RolloutRuntime:
    """Streams one worker's records to the controller; see the module docstring."""

    def __init__(
        self,
        source: RecordSource,
        *,
        data: str,
        control: str,
        worker_id: str,
        incarnation: str | None = None,
        flush_interval: float = 0.05,
        flush_events: int = 8192,
        check_interval: float = 0.01,
        heartbeat_interval: float = 0.5,
        close_timeout: float = 5.0,
        ready_timeout: float = 5.0,
        context: zmq.asyncio.Context | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        for name, val in (
            ("flush_interval", flush_interval),
            ("check_interval", check_interval),
            ("heartbeat_interval", heartbeat_interval),
        ):
            if not isinstance(val, (int, float)) or not val > 0:
                raise ValueError(f"{name} must be a positive number, got {val!r}")
        if not isinstance(worker_id, str) or not 0 < len(worker_id) <= 256:
            raise ValueError(f"worker_id must be a non-empty str (<= 256 chars), got {worker_id!r}")
        for name, val in (("close_timeout", close_timeout), ("ready_timeout", ready_timeout)):
            if not isinstance(val, (int, float)) or not val >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {val!r}")
        if not isinstance(max_bytes, int) or max_bytes < 4096:
            raise ValueError(f"max_bytes must be an int >= 4096, got {max_bytes!r}")
        if not isinstance(flush_events, int) or flush_events < 1:
            raise ValueError(f"flush_events must be a positive int, got {flush_events!r}")
        for name, addr in (("data", data), ("control", control)):
            if not isinstance(addr, str) or "://" not in addr:
                raise ValueError(
                    f"{name} must be a ZMQ endpoint like tcp://HOST:PORT, got {addr!r}"
                )
        self._source = source
        self._data = data
        self._control = control
        self.worker_id = worker_id
        self.incarnation = incarnation or new_incarnation()
        self.flush_interval = float(flush_interval)
        self.flush_events = flush_events
        self.check_interval = float(min(check_interval, flush_interval))
        self.heartbeat_interval = float(heartbeat_interval)
        self.close_timeout = float(close_timeout)
        self.ready_timeout = float(ready_timeout)
        self._ctx = context
        self._max_bytes = max_bytes
        self._max_keys = _KEYS_PER_FRAME
        self._seq = 0
        self._push: zmq.asyncio.Socket | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._flush_now = asyncio.Event()
        self._bye_acked = asyncio.Event()
        self._welcomed = asyncio.Event()
        self._seal_target: int | None = None
        self._committed = asyncio.Condition()
        self._lock = asyncio.Lock()
        self._last_send = 0.0
        self._last_flush = 0.0
        self._takes = 0
        self._mark_take = 0
        self._stats = RolloutStatistics(worker_id, self.incarnation)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("RolloutRuntime already started")
        ctx = self._ctx or shared_context()
        try:  # a failed start leaves no socket behind (``async with`` will not call aclose)
            self._push = ctx.socket(zmq.PUSH)
            self._push.setsockopt(zmq.LINGER, 0)
            self._push.setsockopt(zmq.SNDHWM, 10_000)
            self._sub = ctx.socket(zmq.SUB)
            self._sub.setsockopt(zmq.LINGER, 0)
            self._sub.setsockopt(zmq.MAXMSGSIZE, 1 << 16)
            self._sub.setsockopt(zmq.SUBSCRIBE, b"")
            endpoints = ((self._push, "data", self._data), (self._sub, "control", self._control))
            for sock, name, addr in endpoints:
                try:
                    sock.connect(addr)
                except zmq.ZMQError as e:
                    msg = f"cannot connect to the {name} endpoint {addr!r}: {e}"
                    raise ValueError(msg) from None
            await self._handshake()
        except BaseException:
            for opened in (self._push, self._sub):
                if opened is not None:
                    opened.close(linger=0)
            self._push = self._sub = None
            raise
        self._last_flush = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"areal_stream-rollout-{self.worker_id}"
        )
        self._task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        """Say at once when the flusher dies: until ``aclose()`` nothing streams, and the
        controller sees this worker only as gone."""
        if not task.cancelled() and task.exception() is not None:
            log.error(
                "rollout worker %s: the streaming task failed; what is recorded from now on "
                "stays in the source until aclose()",
                self.worker_id,
                exc_info=task.exception(),
            )

    async def _handshake(self) -> None:
        """Say hello until the controller answers (its control socket may need a moment
        to deliver to a new subscriber), so the first seal after ``start()`` includes us.
        Gives up after ``ready_timeout`` with a warning: streaming still works later."""
        deadline = time.monotonic() + self.ready_timeout
        while True:
            await self._send(encode_hello(self._head(), self.heartbeat_interval))
            resend = time.monotonic() + 0.05
            while not self._welcomed.is_set() and time.monotonic() < min(resend, deadline):
                await self._read_control(timeout_ms=10)
            if self._welcomed.is_set():
                self._stats.welcomed = True
                return
            if time.monotonic() >= deadline:
                log.warning(
                    "rollout worker %s: no answer from the controller at %s within %.1fs; "
                    "streaming anyway",
                    self.worker_id,
                    self._data,
                    self.ready_timeout,
                )
                return

    async def __aenter__(self) -> RolloutRuntime:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Send what is left and a ``bye``, wait (bounded) for the ack, close the sockets."""
        if self._stats.closed:
            return
        self._stats.closed = True
        try:
            if self._task is not None:
                self._stop.set()
                try:
                    await asyncio.wait_for(asyncio.shield(self._task), self.close_timeout)
                except (asyncio.TimeoutError, Exception):
                    self._task.cancel()
                    log.warning("rollout worker %s: flusher did not stop cleanly", self.worker_id)
                try:
                    await asyncio.wait_for(self._final(), self.close_timeout)
                except asyncio.TimeoutError:
                    log.warning(
                        "rollout worker %s: controller did not acknowledge bye within %.1fs; "
                        "frames still queued may be lost",
                        self.worker_id,
                        self.close_timeout,
                    )
        finally:  # even if the final flush failed: never leave a socket open
            for s in (self._push, self._sub):
                if s is not None:
                    s.close(linger=0)

    async def abort(self) -> None:
        """Stop at once without flushing or saying bye (as if the process died): what was
        not yet sent is lost, and the controller finds out by the missing heartbeats."""
        self._stats.closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        for s in (self._push, self._sub):
            if s is not None:
                s.close(linger=0)

    async def _final(self) -> None:
        await self._flush(None)
        await self._send(encode_bye(self._head()))
        while not self._bye_acked.is_set():
            await self._read_control(timeout_ms=int(self.check_interval * 1000) + 1)
        self._stats.bye_acked = True

    # ------------------------------------------------------------------ public helpers

    def statistics(self) -> RolloutStatistics:
        return RolloutStatistics(**vars(self._stats))

    def request_flush(self) -> None:
        """Ask the background task to flush at its next check (sync, never blocks)."""
        self._flush_now.set()

    async def wait_committed(self, step: int, timeout: float | None = None) -> None:
        """Wait until the controller announces that ``step`` (or a later one) is committed."""

        async def _wait() -> None:
            async with self._committed:
                await self._committed.wait_for(
                    lambda: (
                        self._stats.committed_step is not None
                        and self._stats.committed_step >= step
                    )
                )

        await asyncio.wait_for(_wait(), timeout)

    async def wait_marked(self, timeout: float | None = None) -> int:
        """Wait until everything recorded before this call has been sent ahead of a mark
        (an answered seal), so it belongs to a step window. Returns that mark's step."""
        start = self._takes

        async def _wait() -> int:
            async with self._committed:
                await self._committed.wait_for(lambda: self._mark_take > start)
                assert self._stats.last_mark is not None
                return self._stats.last_mark

        return await asyncio.wait_for(_wait(), timeout)

    # ------------------------------------------------------------------ internals

    def _head(self) -> Header:
        self._seq += 1
        return Header(self.worker_id, self.incarnation, self._seq, "rollout")

    async def _send(self, frame: bytes) -> None:
        assert self._push is not None
        await self._push.send(frame, copy=len(frame) < 65536)
        self._last_send = time.monotonic()
        self._stats.frames_sent += 1

    async def _flush(self, mark: int | None) -> None:
        async with self._lock:
            self._takes += 1
            take = self._takes
            try:
                raw = self._source.take_records()
            except Exception:
                self._stats.source_errors += 1
                log.exception("rollout worker %s: take_records() failed", self.worker_id)
                raw = {}
            self._last_flush = time.monotonic()
            if not raw and mark is None:
                return
            recs: dict[str, tuple[int, list[float]]] = {}
            for k, v in raw.items():
                checked = _wire_record(k, v)
                if isinstance(checked, str):
                    self._stats.invalid_keys += 1
                    if self._stats.invalid_keys <= 5:
                        log.error(
                            "rollout worker %s: key %.80r not sent: %s (counted in "
                            "statistics().invalid_keys; only the first 5 are logged)",
                            self.worker_id,
                            k,
                            checked,
                        )
                    continue
                recs[k] = checked
            chunks = self._chunks(list(recs))
            for i, chunk in enumerate(chunks):
                part = {k: recs[k] for k in chunk}
                events = int(sum(r[1][1] for r in part.values()))
                last = i == len(chunks) - 1
                await self._send(encode_batch(self._head(), part, events, mark if last else None))
                self._stats.batches_sent += 1
                self._stats.events_sent += events
                self._stats.keys_sent += len(part)
            if mark is not None:
                self._stats.marks_sent += 1
                async with self._committed:
                    self._stats.last_mark = mark
                    self._mark_take = take
                    self._committed.notify_all()

    def _chunks(self, keys: list[str]) -> list[list[str]]:
        """Split keys so each frame stays well under the size limit (about 48 bytes per
        record plus the key) and under the key limit (``_KEYS_PER_FRAME``, or the controller's
        if lower); at least one chunk."""
        budget = self._max_bytes // 2
        out: list[list[str]] = [[]]
        size = 0
        for k in keys:
            est = len(k.encode()) + 48
            if out[-1] and (size + est > budget or len(out[-1]) >= self._max_keys):
                out.append([])
                size = 0
            out[-1].append(k)
            size += est
        return out

    async def _read_control(self, timeout_ms: int) -> None:
        assert self._sub is not None
        if not await self._sub.poll(timeout_ms):
            return
        while True:
            try:
                frame = await self._sub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode(frame, max_bytes=1 << 16, max_keys=16)
            except DecodeError as e:
                self._stats.control_decode_errors += 1
                log.debug("rollout worker %s: bad control frame: %s", self.worker_id, e)
                continue
            if isinstance(msg, Seal):
                self._stats.seals_seen += 1
                if (self._stats.last_mark is None or msg.step > self._stats.last_mark) and (
                    self._seal_target is None or msg.step > self._seal_target
                ):
                    self._seal_target = msg.step
            elif isinstance(msg, Committed):
                async with self._committed:
                    if self._stats.committed_step is None or msg.step > self._stats.committed_step:
                        self._stats.committed_step = msg.step
                    self._committed.notify_all()
            elif (
                isinstance(msg, Welcome)
                and msg.src == self.worker_id
                and msg.inc == self.incarnation
            ):
                if msg.max_bytes is not None:  # split frames under the controller's limits
                    self._max_bytes = max(4096, min(self._max_bytes, msg.max_bytes))
                if msg.max_keys is not None:
                    self._max_keys = max(1, min(self._max_keys, msg.max_keys))
                self._welcomed.set()
            elif (
                isinstance(msg, ByeAck)
                and msg.src == self.worker_id
                and msg.inc == self.incarnation
            ):
                self._bye_acked.set()

    async def _run(self) -> None:
        tick_ms = max(1, int(self.check_interval * 1000))
        while not self._stop.is_set():
            await self._read_control(tick_ms)
            target = self._seal_target
            if target is not None and (
                self._stats.last_mark is None or target > self._stats.last_mark
            ):
                self._seal_target = None
                await self._flush(target)
                continue
            now = time.monotonic()
            if (
                self._flush_now.is_set()
                or now - self._last_flush >= self.flush_interval
                or self._source.pending_events() >= self.flush_events
            ):
                self._flush_now.clear()
                await self._flush(None)
            if time.monotonic() - self._last_send >= self.heartbeat_interval:
                await self._send(encode_heartbeat(self._head()))
                self._stats.heartbeats_sent += 1

"""Streaming to the metrics controller: ``RolloutStream`` (workers) and ``TrainStream`` (trainer).

    async with RolloutStream(data="tcp://ctrl:5555", control="tcp://ctrl:5556",
                             worker_id="rollout-3"):
        ...  # workflows record with stats_tracker synchronously; a background task streams

    train = TrainStream(data="tcp://ctrl:5555", group=dp_group)
    train.commit(global_step, epoch=epoch, epoch_step=step)  # every rank; rank 0 sends
    train.close()

Both plug the process-wide ``stats_tracker`` into the ``workers`` runtimes; a
``RolloutStream`` also takes any ``source=`` with ``take_records()``/``pending_events()``
(e.g. ``workers.LocalRecordSource``) so many simulated workers can share one process.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import zmq.asyncio

from workers._rollout import (
    LocalRecordSource,
    RawRecords,
    RecordSource,
    RolloutRuntime,
    RolloutStatistics,
)
from workers._train import TrainReporter, TrainStatistics

__all__ = [
    "LocalRecordSource",
    "RecordSource",
    "RolloutStatistics",
    "RolloutStream",
    "TrainStatistics",
    "TrainStream",
]


class _TrackerSource:
    """The process-wide stats tracker as a record source (imported on first use)."""

    def take_records(self) -> RawRecords:
        from areal_stream import stats_tracker

        return stats_tracker.take_records()

    def pending_events(self) -> int:
        from areal_stream import stats_tracker

        return stats_tracker.pending_events()


class RolloutStream:
    """Streams this worker's records to the controller from a background asyncio task.

    Use as ``async with`` (or ``await start()`` / ``await aclose()``) inside the worker's
    event loop. ``flush_interval`` (s) bounds how long a record waits; ``flush_events``
    flushes sooner when that many events are pending. ``start()`` waits (at most
    ``ready_timeout``) until the controller has registered this worker, so the next seal
    waits for it; ``aclose()`` sends what is left and waits up to ``close_timeout`` for
    the controller to acknowledge.
    """

    def __init__(
        self,
        data: str,
        control: str,
        worker_id: str,
        *,
        flush_interval: float = 0.05,
        flush_events: int = 8192,
        heartbeat_interval: float = 0.5,
        close_timeout: float = 5.0,
        ready_timeout: float = 5.0,
        incarnation: str | None = None,
        source: RecordSource | None = None,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self._rt = RolloutRuntime(
            source if source is not None else _TrackerSource(),
            data=data,
            control=control,
            worker_id=worker_id,
            incarnation=incarnation,
            flush_interval=flush_interval,
            flush_events=flush_events,
            heartbeat_interval=heartbeat_interval,
            close_timeout=close_timeout,
            ready_timeout=ready_timeout,
            context=context,
        )

    @property
    def worker_id(self) -> str:
        return self._rt.worker_id

    @property
    def incarnation(self) -> str:
        return self._rt.incarnation

    async def start(self) -> None:
        await self._rt.start()

    async def aclose(self) -> None:
        await self._rt.aclose()

    async def abort(self) -> None:
        """Stop without flushing or a bye (what a crash looks like to the controller)."""
        await self._rt.abort()

    async def __aenter__(self) -> RolloutStream:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def statistics(self) -> RolloutStatistics:
        return self._rt.statistics()

    def request_flush(self) -> None:
        """Flush at the next check instead of waiting for the interval."""
        self._rt.request_flush()

    async def wait_committed(self, step: int, timeout: float | None = None) -> None:
        """Wait until the controller reports ``step`` (or later) committed."""
        await self._rt.wait_committed(step, timeout)

    async def wait_marked(self, timeout: float | None = None) -> int:
        """Wait until everything recorded before the call is behind an answered seal (so in
        a step window); returns that step."""
        return await self._rt.wait_marked(timeout)


class TrainStream:
    """Reports each training step: every rank exports (packed all-reduce), rank 0 sends.

    ``group`` is the process group to reduce over (the data-parallel group; AReaL's
    ``reduce_group``). With ``None`` nothing is reduced, as in ``export_all``: rank 0 then
    sends only its own statistics. Rank 0 means rank 0 *of the group*. ``close()`` waits
    at most ``close_timeout`` seconds for queued reports to reach the controller.
    """

    def __init__(
        self,
        data: str,
        group: Any = None,
        *,
        producer_id: str = "trainer",
        send_timeout: float = 30.0,
        close_timeout: float = 5.0,
    ) -> None:
        from areal_stream import stats_tracker

        self._rep = TrainReporter(
            stats_tracker.export_all,
            data=data,
            group=group,
            producer_id=producer_id,
            send_timeout=send_timeout,
            close_timeout=close_timeout,
        )

    @property
    def rank(self) -> int:
        return self._rep.rank

    def commit(
        self,
        global_step: int,
        *,
        epoch: int = 0,
        epoch_step: int | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Export and (rank 0) send step ``global_step``; returns the exported stats."""
        return self._rep.commit(global_step, epoch=epoch, epoch_step=epoch_step, extra=extra)

    def statistics(self) -> TrainStatistics:
        return self._rep.statistics()

    def close(self) -> None:
        self._rep.close()

    def __enter__(self) -> TrainStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""Training-rank step reports: every rank exports (one packed all-reduce), rank 0 sends.

``export_all(reduce_group=...)`` is injected (the stats tracker's), so this module needs
nothing of ``areal_stream``. Only rank 0 of the group opens a socket: a plain (blocking)
ZMQ PUSH with its own context, so ``close()`` can wait for queued frames to be delivered
(bounded by ``close_timeout``) instead of dropping them.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from bus._codec import Header, encode_hello, encode_train

ExportAll = Callable[..., Mapping[str, Any]]

log = logging.getLogger(__name__)
_PEER_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED


def _group_rank(group: Any) -> int:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency
        return 0
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return int(dist.get_rank(group) if group is not None else dist.get_rank())


@dataclass
class TrainStatistics:
    rank: int
    steps_committed: int = 0
    frames_sent: int = 0
    last_step: int | None = None
    reports_undelivered: int = 0
    closed: bool = False


class TrainReporter:
    """Per-rank step reporter; see the module docstring."""

    def __init__(
        self,
        export_all: ExportAll,
        *,
        data: str,
        group: Any = None,
        rank: int | None = None,
        producer_id: str = "trainer",
        send_timeout: float = 30.0,
        close_timeout: float = 5.0,
    ) -> None:
        if not callable(export_all):
            raise TypeError("export_all must be callable")
        if not isinstance(data, str) or "://" not in data:
            raise ValueError(f"data must be a ZMQ endpoint like tcp://HOST:PORT, got {data!r}")
        self._export_all = export_all
        self._group = group
        self.rank = _group_rank(group) if rank is None else int(rank)
        self._stats = TrainStatistics(self.rank)
        self._id = producer_id
        self._inc = f"{int(time.time() * 1000):x}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._seq = 0
        self._close_timeout = close_timeout
        self._ctx: zmq.Context[Any] | None = None
        self._sock: zmq.Socket[Any] | None = None
        self._mon: zmq.Socket[Any] | None = None
        self._peer_seen = False
        self._data = data
        if self.rank == 0:
            self._ctx = zmq.Context()
            self._sock = self._ctx.socket(zmq.PUSH)
            self._sock.setsockopt(zmq.LINGER, int(close_timeout * 1000))
            self._sock.setsockopt(zmq.SNDTIMEO, int(send_timeout * 1000))
            # Watch for a peer: frames queued for a controller that never answered are
            # reported as undelivered on close instead of vanishing.
            self._mon = self._sock.get_monitor_socket(_PEER_EVENTS)
            self._sock.connect(data)
            self._send(encode_hello(self._head(), 3600.0 - 1))

    def _head(self) -> Header:
        self._seq += 1
        return Header(self._id, self._inc, self._seq, "train")

    def _send(self, frame: bytes) -> None:
        assert self._sock is not None
        try:
            self._sock.send(frame)
        except zmq.Again:
            raise TimeoutError(
                "TrainStream: the controller did not accept the step report in time "
                "(is `python -m areal_stream.controller` running at the data address?)"
            ) from None
        self._stats.frames_sent += 1

    def commit(
        self,
        global_step: int,
        *,
        epoch: int = 0,
        epoch_step: int | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Export this step's stats on every rank (collective) and, on rank 0, send them.

        Returns the exported dict (identical on every rank). ``extra`` values (numbers or
        tables) are added on rank 0 and win over exported keys of the same name.
        """
        if self._stats.closed:
            raise RuntimeError("TrainStream is closed")
        for name, v in (("global_step", global_step), ("epoch", epoch)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if epoch_step is None:
            epoch_step = global_step
        if isinstance(epoch_step, bool) or not isinstance(epoch_step, int):
            raise TypeError(f"epoch_step must be an int, got {type(epoch_step).__name__}")
        last = self._stats.last_step
        if last is not None and global_step <= last:
            raise ValueError(f"global_step must increase: got {global_step} after {last}")
        if extra is not None and not isinstance(extra, Mapping):
            raise TypeError(f"extra must be a mapping, got {type(extra).__name__}")
        stats = dict(self._export_all(reduce_group=self._group))
        if self.rank == 0:
            if extra:
                stats.update(extra)
            self._send(encode_train(self._head(), global_step, epoch, epoch_step, stats))
        self._stats.last_step = global_step
        self._stats.steps_committed += 1
        return stats

    def statistics(self) -> TrainStatistics:
        return TrainStatistics(**vars(self._stats))

    def _connected(self, wait: float) -> bool:
        """Whether a controller ever took the connection (waits up to ``wait`` s)."""
        if self._peer_seen or self._mon is None:
            return self._peer_seen
        deadline = time.monotonic() + wait
        while self._mon.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            if recv_monitor_message(self._mon)["event"] & _PEER_EVENTS:
                self._peer_seen = True
                break
        return self._peer_seen

    def close(self) -> None:
        """Deliver queued reports (waits at most ``close_timeout``), then close.

        If no controller ever accepted the connection, the reports sent are counted in
        ``statistics().reports_undelivered`` and a warning names the address.
        """
        if self._stats.closed:
            return
        self._stats.closed = True
        if self._sock is not None:
            linger = None
            if not self._connected(self._close_timeout):
                self._stats.reports_undelivered = self._stats.steps_committed
                linger = 0
                log.warning(
                    "TrainStream: no controller accepted the connection to %s; %d step "
                    "report(s) were not delivered",
                    self._data,
                    self._stats.steps_committed,
                )
            self._sock.disable_monitor()
            if self._mon is not None:
                self._mon.close(linger=0)
            self._sock.close(linger=linger)
        if self._ctx is not None:
            self._ctx.term()

    def __enter__(self) -> TrainReporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

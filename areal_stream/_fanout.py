"""Per-backend isolation: each backend runs on its own daemon thread behind a bounded queue.

``BackendWorker.submit`` never blocks: when the queue is full (the backend is slow or hung)
the step is dropped *for that backend only* and counted. A backend that raises has the error
logged once per kind (phase + exception type; later ones are only counted) and keeps
receiving the next steps. A backend whose ``open()`` failed (e.g. its package is missing)
logs why, and every step sent to it afterwards is counted as dropped. ``close(timeout)``
lets the worker drain what is queued and finish the backend; past the time limit the thread
is left behind (daemon) and what was still queued is counted as dropped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from areal_stream._backends._base import Backend, BackendUnavailable, StepRecord

logger = logging.getLogger("areal_stream.stats_logger")

_FLUSH = object()
_CLOSE = object()


def _limit(timeout: float | None) -> float | None:
    """A wait limit the threading primitives accept: ``None`` waits forever; NaN and
    negatives mean 0; anything above ``threading.TIMEOUT_MAX`` (e.g. ``inf``, which would
    raise ``OverflowError``) is capped to it."""
    if timeout is None:
        return None
    if not timeout >= 0:  # NaN or negative
        return 0.0
    return min(float(timeout), threading.TIMEOUT_MAX)


@dataclass(frozen=True)
class WorkerStatistics:
    """Counters of one backend worker (cumulative)."""

    logged: int
    errors: int
    dropped: int
    queued: int
    state: str  # opening | running | failed | closed | abandoned


class BackendWorker:
    """Runs one backend on its own thread; ``queue_size`` 0 means unbounded."""

    def __init__(self, name: str, backend: Backend, queue_size: int) -> None:
        self.name = name
        self.backend = backend
        self._max = queue_size
        self._cond = threading.Condition()
        self._items: deque[object] = deque()
        self._pending = 0  # step records in _items
        self._busy = False
        self._closing = False
        self._state = "opening"
        self._logged = 0
        self._errors = 0
        self._dropped = 0
        self._kinds: set[tuple[str, str]] = set()
        self._thread = threading.Thread(target=self._run, name=f"areal-stream-{name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ producer side

    def submit(self, record: StepRecord) -> bool:
        """Queue a step; ``False`` (and counted as dropped) when full, failed or closing."""
        with self._cond:
            if (
                self._closing
                or self._state == "failed"
                or (self._max and self._pending >= self._max)
            ):
                self._dropped += 1
                return False
            self._items.append(record)
            self._pending += 1
            self._cond.notify()
            return True

    def counters(self) -> tuple[int, int]:
        """``(errors, dropped)`` so far."""
        with self._cond:
            return self._errors, self._dropped

    def statistics(self) -> WorkerStatistics:
        with self._cond:
            return WorkerStatistics(
                self._logged, self._errors, self._dropped, self._pending, self._state
            )

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued step was handed to the backend and its ``flush()`` ran.
        ``False`` if that did not happen within ``timeout`` seconds."""
        with self._cond:
            if self._state in ("closed", "abandoned"):
                return self._pending == 0
            if not self._items or self._items[-1] is not _FLUSH:
                self._items.append(_FLUSH)  # one marker is enough (a hung backend: no pile-up)
            self._cond.notify()
            return self._cond.wait_for(
                lambda: (
                    (not self._items and not self._busy) or self._state in ("closed", "abandoned")
                ),
                _limit(timeout),
            )

    def begin_close(self) -> None:
        """Ask the worker to drain its queue, then close the backend and exit."""
        with self._cond:
            if not self._closing:
                self._closing = True
                self._items.append(_CLOSE)
                self._cond.notify()

    def join(self, deadline: float) -> bool:
        """Wait for the worker to finish until ``deadline`` (``time.monotonic()``); if it does
        not, count what is still queued as dropped and leave the thread behind."""
        self._thread.join(_limit(deadline - time.monotonic()))
        if not self._thread.is_alive():
            return True
        with self._cond:
            lost = self._pending
            self._dropped += lost
            self._pending = 0
            self._items = deque([_CLOSE])
            self._state = "abandoned"
        logger.warning(
            "%s backend did not finish in time; %d queued step(s) dropped for it "
            "(they are in the journal: replay them with python -m areal_stream.replay)",
            self.name,
            lost,
        )
        return False

    # ------------------------------------------------------------------ worker side

    def _error(self, phase: str, exc: BaseException) -> None:
        with self._cond:
            self._errors += 1
            kind = (phase, type(exc).__name__)
            first = kind not in self._kinds
            self._kinds.add(kind)
        if not first:
            return
        if isinstance(exc, BackendUnavailable):
            logger.error("%s", exc)
        else:
            logger.error(
                "%s backend failed in %s: %s: %s (further %s errors in %s are counted under "
                "committer/%s/errors, not logged)",
                self.name,
                phase,
                type(exc).__name__,
                exc,
                type(exc).__name__,
                phase,
                self.name,
                exc_info=exc,
            )

    def _run(self) -> None:
        ok = True
        try:
            self.backend.open()
        except BaseException as exc:
            ok = False
            self._error("open", exc)
        with self._cond:
            if self._state == "opening":
                self._state = "running" if ok else "failed"
        while True:
            with self._cond:
                while not self._items:
                    self._cond.wait()
                item = self._items.popleft()
                if isinstance(item, StepRecord):
                    self._pending -= 1
                self._busy = True
            if item is _CLOSE:
                break
            if not ok:
                if isinstance(item, StepRecord):
                    with self._cond:
                        self._dropped += 1
            elif item is _FLUSH:
                try:
                    self.backend.flush()
                except BaseException as exc:
                    self._error("flush", exc)
            else:
                try:
                    self.backend.log(item)  # type: ignore[arg-type]
                    with self._cond:
                        self._logged += 1
                except BaseException as exc:
                    self._error("log", exc)
            with self._cond:
                self._busy = False
                self._cond.notify_all()
        if ok:
            try:
                self.backend.close()
            except BaseException as exc:
                self._error("close", exc)
        with self._cond:
            self._busy = False
            if self._state != "abandoned":
                self._state = "closed"
            self._cond.notify_all()


class Fanout:
    """A set of ``BackendWorker``s fed the same steps in the same order."""

    def __init__(self, backends: list[tuple[str, Backend]], queue_size: int) -> None:
        self.workers = [BackendWorker(name, b, queue_size) for name, b in backends]

    def submit(self, record: StepRecord) -> None:
        for w in self.workers:
            w.submit(record)

    def counters(self) -> dict[str, tuple[int, int]]:
        return {w.name: w.counters() for w in self.workers}

    def flush(self, timeout: float | None = None) -> bool:
        """Flush every backend, waiting up to ``timeout`` seconds in total."""
        limit = _limit(timeout)
        deadline = None if limit is None else time.monotonic() + limit
        ok = True
        for w in self.workers:
            left = None if deadline is None else deadline - time.monotonic()
            ok = w.flush(left) and ok
        return ok

    def close(self, timeout: float) -> bool:
        """Close all backends concurrently, each given ``timeout`` seconds from now."""
        for w in self.workers:
            w.begin_close()
        deadline = time.monotonic() + (_limit(timeout) or 0.0)
        ok = True
        for w in self.workers:
            ok = w.join(deadline) and ok
        return ok

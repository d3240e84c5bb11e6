"""The controller's step windows, sealed by markers: a pure state machine (no sockets, no clock).

Each producer (worker id + incarnation) sends a numbered stream of frames over one ordered
ZMQ connection. When the trainer reports step N the controller opens window N and
announces its seal; every live worker flushes and answers with a batch carrying
``mark=N``. Window N then holds exactly what each worker recorded before its mark:

- data a worker sends goes to its *pending* records until its next mark; a mark M moves
  the pending records into the lowest uncommitted window ``s`` with ``last_mark < s <= M``
  (a mark for M also answers every lower seal the worker missed);
- if every window in that range is already committed, the data goes to the *carry* and is
  merged into the next committed window, never dropped: counted as late when the worker
  had been waited on for a window that committed without it, else (a late joiner
  answering a seal it was not waited on for) as ``carried_events``;
- a worker silent past a seal's timeout is counted missing and is no longer waited on
  (``suspect``) until it answers a seal again; a worker silent for longer than its
  heartbeat allowance is ``gone``: its pending records move to the carry. Silence is
  counted only while the controller is checking: a gap between two checks longer than
  half of ``gone_min`` (the controller stalled, or shares a stalled event loop with the
  workers) is not held against anyone;
- a new incarnation of a worker id retires the old one (its pending records move to the
  carry); a ``bye`` does the same for a clean close; a ``hello`` numbered at or below what
  its incarnation already sent is a restart that reused the incarnation, handled the same
  way (otherwise every frame of the new process would be dropped as a duplicate);
- duplicate frames (same id, incarnation and sequence number) are dropped and counted,
  skipped sequence numbers are counted as gaps.

Windows commit strictly in step order. Rollout-only runs open windows on a timer
(``open_timer_window``) only until a trainer has registered: timer windows take global step
numbers, so a trainer's report for a step a timer window already committed would be stale.
Every method takes ``now`` (seconds, any monotonic clock) so tests drive time explicitly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from bus._aggregate import Record, merge_into
from bus._codec import Batch, Bye, Header, Heartbeat, Hello, Message, Train

Records = dict[str, tuple[int, Record]]
ProducerKey = tuple[str, str]

_MAX_HOLES = 4096

DELTA_COUNTERS = (
    "batches",
    "events",
    "late_events",
    "late_batches",
    "carried_events",
    "decode_errors",
    "duplicate_batches",
    "gap_batches",
    "reordered_batches",
    "restarts",
    "gone_workers",
    "stale_train_steps",
    "type_conflicts",
    "internal_errors",
    "commit_errors",
)


def merge_records(dst: Records, src: Mapping[str, tuple[int, Record]]) -> int:
    """Fold ``src`` into ``dst`` (copying new records); returns the number of keys whose
    reduce type differed (the record is still merged, so nothing is lost)."""
    conflicts = 0
    for k, (rt, rec) in src.items():
        cur = dst.get(k)
        if cur is None:
            dst[k] = (rt, list(rec))
        else:
            if cur[0] != rt:
                conflicts += 1
            merge_into(cur[1], rec)
    return conflicts


@dataclass
class ProducerState:
    """What the controller knows about one incarnation of one producer."""

    key: ProducerKey
    role: str
    heartbeat: float
    last_seen: float
    hi_seq: int = 0
    holes: set[int] = field(default_factory=set)
    last_mark: int | None = None
    pending: Records = field(default_factory=dict)
    pending_events: int = 0
    suspect: bool = False
    gone: bool = False
    closed: bool = False
    retired: bool = False
    missed: bool = False

    @property
    def live(self) -> bool:
        return not (self.gone or self.closed or self.retired)


@dataclass
class TrainReport:
    epoch: int
    epoch_step: int
    stats: dict[str, Any]


@dataclass
class Window:
    step: int
    opened_at: float
    expected: set[ProducerKey]
    train: TrainReport | None = None
    timer: bool = False
    records: Records = field(default_factory=dict)
    events: int = 0
    last_announce: float = 0.0


@dataclass
class SealedWindow:
    """A committed window: train report (None for rollout-only windows), merged rollout
    records, and the bus counters for this step."""

    step: int
    train: TrainReport | None
    records: Records
    counters: dict[str, float]
    missing: list[ProducerKey]


class WindowBook:
    """All windows and producers of one controller; see the module docstring."""

    def __init__(
        self,
        *,
        seal_timeout: float = 10.0,
        gone_min: float = 1.0,
        gone_heartbeats: float = 4.0,
        reannounce_interval: float = 0.05,
    ) -> None:
        if seal_timeout <= 0:
            raise ValueError(f"seal_timeout must be > 0, got {seal_timeout}")
        self.seal_timeout = seal_timeout
        self.gone_min = gone_min
        self.gone_heartbeats = gone_heartbeats
        self.reannounce_interval = reannounce_interval
        self.producers: dict[ProducerKey, ProducerState] = {}
        # (role, id) -> current incarnation: a worker and the trainer may share an id
        self.current_inc: dict[tuple[str, str], ProducerKey] = {}
        self.windows: dict[int, Window] = {}
        self.carry: Records = {}
        self.carry_events = 0
        self.last_committed: int | None = None
        self.last_timer_step: int | None = None
        self.totals: dict[str, int] = dict.fromkeys(DELTA_COUNTERS, 0)
        self._at_last_commit: dict[str, int] = dict(self.totals)
        self.workers_seen = 0
        self._last_check: float | None = None

    # ------------------------------------------------------------------ counters

    def count(self, name: str, n: int = 1) -> None:
        self.totals[name] = self.totals.get(name, 0) + n

    def statistics(self) -> dict[str, Any]:
        """Cumulative counters plus current sizes (for logs and tests)."""
        out: dict[str, Any] = dict(self.totals)
        out.update(
            workers_seen=self.workers_seen,
            workers_live=len(self._live_workers()),
            open_windows=sorted(self.windows),
            last_committed=self.last_committed,
            carry_keys=len(self.carry),
        )
        return out

    # ------------------------------------------------------------------ producers

    @property
    def trainer_known(self) -> bool:
        """Whether a trainer has registered (its reports, not a timer, open windows)."""
        return any(p.role == "train" for p in self.producers.values())

    def _live_workers(self) -> list[ProducerState]:
        return [p for p in self.producers.values() if p.role == "rollout" and p.live]

    def _retire_to_carry(self, p: ProducerState) -> None:
        if p.pending:
            self.count("type_conflicts", merge_records(self.carry, p.pending))
            self.carry_events += p.pending_events
            p.pending = {}
            p.pending_events = 0

    def _accept(self, head: Header, now: float) -> ProducerState | None:
        """Register the producer and check the sequence number; None for a duplicate."""
        key = (head.src, head.inc)
        p = self.producers.get(key)
        if p is None:
            p = ProducerState(key=key, role=head.role, heartbeat=1.0, last_seen=now)
            p.hi_seq = head.seq - 1  # the first frame seen is accepted, whatever its number
            self.producers[key] = p
            old = self.current_inc.get((head.role, head.src))
            if old is not None and old != key:
                prev = self.producers[old]
                if not prev.retired:
                    prev.retired = True
                    self._retire_to_carry(prev)
                    if prev.role == "rollout":
                        self.count("restarts")
            self.current_inc[(head.role, head.src)] = key
            if head.role == "rollout":
                self.workers_seen += 1
            if p.hi_seq > 0:
                self.count("gap_batches", p.hi_seq)
                self._add_holes(p, 1, p.hi_seq)
        seq = head.seq
        if seq <= p.hi_seq:
            if seq in p.holes:
                p.holes.discard(seq)
                self.count("reordered_batches")
            else:
                self.count("duplicate_batches")
                return None
        else:
            if seq > p.hi_seq + 1:
                self.count("gap_batches", seq - p.hi_seq - 1)
                self._add_holes(p, p.hi_seq + 1, seq - 1)
            p.hi_seq = seq
        p.last_seen = now
        if p.gone and not p.retired:
            p.gone = False
        return p

    def _forget_if_restarted(self, head: Header) -> None:
        """A hello numbered at or below what its incarnation already sent comes from a new
        process that reused the incarnation: retire the old state (pending -> carry) so the
        new process starts a fresh sequence instead of having its frames dropped as
        duplicates. (ZMQ over TCP never duplicates a frame.)"""
        key = (head.src, head.inc)
        p = self.producers.get(key)
        if p is None or head.seq > p.hi_seq or head.seq in p.holes:
            return
        p.retired = True
        self._retire_to_carry(p)
        del self.producers[key]
        if self.current_inc.get((head.role, head.src)) == key:  # else _accept retires it
            del self.current_inc[(head.role, head.src)]
            if p.role == "rollout":
                self.count("restarts")

    @staticmethod
    def _add_holes(p: ProducerState, lo: int, hi: int) -> None:
        for s in range(max(lo, hi - _MAX_HOLES + 1), hi + 1):
            if len(p.holes) >= _MAX_HOLES:
                break
            p.holes.add(s)

    # ------------------------------------------------------------------ messages

    def handle(self, msg: Message, now: float) -> list[int]:
        """Apply one decoded producer frame; returns steps whose seal should be announced."""
        if isinstance(msg, Batch):
            self.on_batch(msg, now)
        elif isinstance(msg, Train):
            step = self.on_train(msg, now)
            return [] if step is None else [step]
        elif isinstance(msg, Hello):
            self._forget_if_restarted(msg.head)
            p = self._accept(msg.head, now)
            if p is not None:
                p.heartbeat = msg.heartbeat
        elif isinstance(msg, Heartbeat):
            self._accept(msg.head, now)
        elif isinstance(msg, Bye):
            p = self._accept(msg.head, now)
            if p is not None:
                p.closed = True
                self._retire_to_carry(p)
        else:
            raise TypeError(f"not a producer message: {type(msg).__name__}")
        return []

    def on_batch(self, msg: Batch, now: float) -> None:
        p = self._accept(msg.head, now)
        if p is None:
            return
        self.count("batches")
        self.count("events", msg.events)
        if p.retired or p.closed:
            self.count("type_conflicts", merge_records(self.carry, msg.records))
            self.carry_events += msg.events
            self.count("late_events", msg.events)
            self.count("late_batches")
            return
        if msg.records:
            self.count("type_conflicts", merge_records(p.pending, msg.records))
            p.pending_events += msg.events
        if msg.mark is not None:
            self._on_mark(p, msg.mark)

    def _on_mark(self, p: ProducerState, mark: int) -> None:
        if p.last_mark is not None and mark <= p.last_mark:
            return  # already answered; its data stays pending for the next mark
        lo = p.last_mark
        target = None
        for s in sorted(self.windows):
            if s > mark:
                break
            if lo is None or s > lo:
                target = self.windows[s]
                break
        if p.pending:
            if target is None:
                dst = self.carry
                self.carry_events += p.pending_events
            else:
                dst = target.records
                target.events += p.pending_events
            self.count("type_conflicts", merge_records(dst, p.pending))
            if p.missed:  # it was waited on for a window that committed without it
                self.count("late_events", p.pending_events)
                self.count("late_batches")
            elif target is None:  # a late joiner answering a seal it was not waited on for
                self.count("carried_events", p.pending_events)
            p.pending = {}
            p.pending_events = 0
        p.last_mark = mark
        p.missed = False
        p.suspect = False

    def on_train(self, msg: Train, now: float) -> int | None:
        """Attach a train report; returns the step to announce (None if it was stale)."""
        p = self._accept(msg.head, now)
        if p is None:
            return None
        step = msg.step
        report = TrainReport(msg.epoch, msg.epoch_step, dict(msg.stats))
        if self.last_committed is not None and step <= self.last_committed:
            self.count("stale_train_steps")
            return None
        w = self.windows.get(step)
        if w is not None:
            if w.train is not None:
                self.count("stale_train_steps")
                return None
            w.train = report
            w.timer = False
            return step
        self._open(step, now, report)
        return step

    def open_timer_window(self, now: float) -> int | None:
        """Open the next window without a train report (rollout-only runs); None once a
        trainer has registered, whose reports then number the windows."""
        if self.trainer_known:
            return None
        top = max([self.last_committed or 0, *self.windows])
        step = top + 1
        self._open(step, now, None).timer = True
        return step

    def _open(self, step: int, now: float, train: TrainReport | None) -> Window:
        expected = {p.key for p in self._live_workers() if not p.suspect}
        w = Window(step=step, opened_at=now, expected=expected, train=train, last_announce=now)
        self.windows[step] = w
        return w

    # ------------------------------------------------------------------ time

    def _done(self, w: Window, key: ProducerKey) -> bool:
        p = self.producers[key]
        if not p.live or p.suspect:
            return True
        return p.last_mark is not None and p.last_mark >= w.step

    def waiting_on(self, step: int) -> list[ProducerKey]:
        w = self.windows[step]
        return sorted(k for k in w.expected if not self._done(w, k))

    def reannounce(self, now: float) -> list[int]:
        """Open steps whose seal should be announced again (a subscriber may have joined
        after the first announcement)."""
        out = []
        for s in sorted(self.windows):
            w = self.windows[s]
            if now - w.last_announce >= self.reannounce_interval:
                w.last_announce = now
                out.append(s)
        return out

    def _check_gone(self, now: float) -> None:
        gap = 0.0 if self._last_check is None else now - self._last_check
        self._last_check = now
        for p in self.producers.values():
            if p.role != "rollout" or not p.live:
                continue
            if gap > self.gone_min / 2:  # the controller was not checking: not their silence
                p.last_seen = min(p.last_seen + gap, now)
            allowance = max(self.gone_min, self.gone_heartbeats * p.heartbeat)
            if now - p.last_seen > allowance:
                p.gone = True
                p.suspect = True
                self.count("gone_workers")
                self._retire_to_carry(p)

    def tick(self, now: float) -> list[SealedWindow]:
        """Declare silent workers gone and return every window now ready, in step order."""
        self._check_gone(now)
        out: list[SealedWindow] = []
        while self.windows:
            step = min(self.windows)
            w = self.windows[step]
            waiting = self.waiting_on(step)
            if waiting and now - w.opened_at < self.seal_timeout:
                break
            out.append(self._commit(w, waiting, now))
        return out

    def next_deadline(self) -> float | None:
        """When the lowest open window times out (for the controller's timer)."""
        if not self.windows:
            return None
        return self.windows[min(self.windows)].opened_at + self.seal_timeout

    def _commit(self, w: Window, missing: list[ProducerKey], now: float) -> SealedWindow:
        self.windows.pop(w.step, None)
        for k in missing:
            p = self.producers[k]
            p.suspect = True
            p.missed = True
        if self.carry:
            self.count("type_conflicts", merge_records(w.records, self.carry))
            w.events += self.carry_events
            self.carry = {}
            self.carry_events = 0
        counters: dict[str, float] = {
            k: v - self._at_last_commit.get(k, 0) for k, v in self.totals.items()
        }
        self._at_last_commit = dict(self.totals)
        counters.update(
            workers_seen=self.workers_seen,
            workers_live=len(self._live_workers()),
            expected_workers=len(w.expected),
            missing_workers=len(missing),
            window_events=w.events,
            seal_latency_ms=(now - w.opened_at) * 1000.0,
        )
        self.last_committed = (
            w.step if self.last_committed is None else max(self.last_committed, w.step)
        )
        if w.timer and w.train is None:
            self.last_timer_step = self.last_committed
        return SealedWindow(w.step, w.train, w.records, counters, missing)

    def drain(self, now: float) -> list[SealedWindow]:
        """Shutdown: commit every open window (everything still held, pending records of
        every producer and the carry, goes into the first), or one extra window if none is
        open and anything is held or counted since the last commit."""
        for p in self.producers.values():
            self._retire_to_carry(p)
        out = [self._commit(self.windows[s], self.waiting_on(s), now) for s in sorted(self.windows)]
        if not out and (self.carry or self.carry_events or self._counted_since_commit()):
            step = (self.last_committed or 0) + 1
            w = Window(step=step, opened_at=now, expected=set(), timer=True)
            out.append(self._commit(w, [], now))
        return out

    def _counted_since_commit(self) -> bool:
        return any(v != self._at_last_commit.get(k, 0) for k, v in self.totals.items())

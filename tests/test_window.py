"""The window/seal state machine, driven with explicit time (no sockets)."""

from __future__ import annotations

import random

from bus import ReduceType
from bus._codec import Batch, Bye, Header, Heartbeat, Hello, Train
from bus._window import SealedWindow, WindowBook

SC = int(ReduceType.SCALAR)


class W:
    """A scripted producer: numbered frames for one incarnation."""

    def __init__(self, src: str, inc: str = "1") -> None:
        self.src, self.inc, self.seq = src, inc, 0

    def head(self) -> Header:
        self.seq += 1
        return Header(self.src, self.inc, self.seq)

    def hello(self, hb: float = 0.5) -> Hello:
        return Hello(self.head(), hb)

    def batch(
        self, value: float = 1.0, n: int = 1, mark: int | None = None, key: str = "r"
    ) -> Batch:
        recs = {key: (SC, [value * n, float(n), value, value])} if n else {}
        return Batch(self.head(), recs, n, mark)

    def hb(self) -> Heartbeat:
        return Heartbeat(self.head())

    def bye(self) -> Bye:
        return Bye(self.head())


class T:
    def __init__(self) -> None:
        self.seq = 0

    def step(self, n: int, **stats: float) -> Train:
        self.seq += 1
        return Train(Header("trainer", "t", self.seq, "train"), n, 0, n, dict(stats))


def weight(sw: SealedWindow, key: str = "r") -> float:
    return sw.records[key][1][1] if key in sw.records else 0.0


def total(sw: SealedWindow, key: str = "r") -> float:
    return sw.records[key][1][0] if key in sw.records else 0.0


def test_window_is_exactly_what_each_worker_sent_before_its_mark() -> None:
    book = WindowBook(seal_timeout=5.0)
    a, b, t = W("a"), W("b"), T()
    for m in (a.hello(), b.hello(), a.batch(2.0, 3), b.batch(5.0, 1)):
        book.handle(m, 0.0)
    assert book.handle(t.step(1, loss=0.5), 0.1) == [1]
    book.handle(a.batch(1.0, 1, mark=1), 0.2)
    assert book.tick(0.2) == []  # b has not answered
    assert book.waiting_on(1) == [("b", "1")]
    book.handle(b.batch(0.0, 0, mark=1), 0.3)
    book.handle(a.batch(100.0, 1), 0.3)  # after a's mark: belongs to the next window
    [sw] = book.tick(0.3)
    assert sw.step == 1 and sw.train is not None and sw.train.stats == {"loss": 0.5}
    assert weight(sw) == 5 and total(sw) == 2.0 * 3 + 5.0 + 1.0
    assert sw.counters["missing_workers"] == 0 and sw.counters["late_events"] == 0
    assert sw.counters["batches"] == 5 and sw.counters["workers_seen"] == 2
    assert abs(sw.counters["seal_latency_ms"] - 200.0) < 1e-6
    book.handle(t.step(2), 0.4)
    book.handle(a.batch(0, 0, mark=2), 0.41)
    book.handle(b.batch(0, 0, mark=2), 0.42)
    [sw2] = book.tick(0.42)
    assert total(sw2) == 100.0 and weight(sw2) == 1


def test_missing_worker_times_out_is_not_waited_on_again_and_its_data_is_carried() -> None:
    book = WindowBook(seal_timeout=1.0, gone_min=100.0)
    a, b, t = W("a"), W("b"), T()
    book.handle(a.hello(), 0.0)
    book.handle(b.hello(), 0.0)
    book.handle(b.batch(1.0, 4), 0.0)
    book.handle(t.step(1), 0.0)
    book.handle(a.batch(1.0, 1, mark=1), 0.1)
    assert book.tick(0.9) == []
    [sw] = book.tick(1.01)
    assert sw.missing == [("b", "1")] and sw.counters["missing_workers"] == 1
    assert weight(sw) == 1  # b's pending data waits for its mark
    # step 2: b is suspect, so only a is waited on
    book.handle(t.step(2), 1.1)
    book.handle(a.batch(0, 0, mark=2), 1.2)
    [sw2] = book.tick(1.2)
    assert sw2.counters["missing_workers"] == 0 and sw2.counters["expected_workers"] == 1
    # b wakes up and answers seal 1 late: its data is carried, counted late, never dropped
    book.handle(b.batch(1.0, 2, mark=1), 1.3)
    book.handle(t.step(3), 1.4)
    assert book.waiting_on(3) == [("a", "1"), ("b", "1")]  # answering made b live again
    book.handle(a.batch(0, 0, mark=3), 1.5)
    book.handle(b.batch(0, 0, mark=3), 1.5)
    [sw3] = book.tick(1.5)
    assert weight(sw3) == 6 and sw3.counters["late_events"] == 6


def test_duplicates_dropped_and_gaps_counted() -> None:
    book = WindowBook()
    a, t = W("a"), T()
    m1 = a.batch(1.0, 1)
    book.handle(m1, 0.0)
    book.handle(m1, 0.0)  # duplicate: dropped
    a.seq += 3  # three frames lost on the way
    book.handle(a.batch(1.0, 1), 0.0)
    book.handle(t.step(1), 0.0)
    book.handle(a.batch(0, 0, mark=1), 0.0)
    [sw] = book.tick(0.0)
    assert weight(sw) == 2
    assert sw.counters["duplicate_batches"] == 1 and sw.counters["gap_batches"] == 3


def test_restart_is_a_new_incarnation_and_keeps_the_old_data() -> None:
    book = WindowBook(seal_timeout=10.0)
    old, new, t = W("a", "1"), W("a", "2"), T()
    book.handle(old.batch(1.0, 3), 0.0)
    book.handle(new.hello(), 0.5)
    book.handle(new.batch(1.0, 2), 0.5)
    book.handle(t.step(1), 0.6)
    assert book.waiting_on(1) == [("a", "2")]  # the old incarnation is not waited on
    book.handle(new.batch(0, 0, mark=1), 0.7)
    [sw] = book.tick(0.7)
    assert weight(sw) == 5 and sw.counters["restarts"] == 1 and sw.counters["workers_seen"] == 2


def test_silent_worker_is_declared_gone_and_bye_releases_a_worker() -> None:
    book = WindowBook(seal_timeout=10.0, gone_min=1.0, gone_heartbeats=4.0)
    a, b, c, t = W("a"), W("b"), W("c"), T()
    book.handle(a.hello(0.1), 0.0)
    book.handle(b.hello(0.1), 0.0)
    book.handle(c.hello(0.1), 0.0)
    book.handle(b.batch(2.0, 2), 0.0)
    book.handle(c.batch(3.0, 1), 0.0)
    book.handle(c.bye(), 0.1)
    book.handle(a.hb(), 0.9)
    book.handle(t.step(1), 0.9)
    assert book.waiting_on(1) == [("a", "1"), ("b", "1")]
    book.handle(a.hb(), 1.5)
    assert book.tick(1.5) == []  # b silent 1.5 s > 1.0: gone, a still owes its mark
    assert book.waiting_on(1) == [("a", "1")]
    book.handle(a.batch(0, 0, mark=1), 1.6)
    [sw] = book.tick(1.6)
    assert weight(sw) == 3 and total(sw) == 7.0  # b's and c's data were kept
    assert sw.counters["gone_workers"] == 1 and sw.counters["missing_workers"] == 0


def test_windows_commit_in_step_order_and_a_mark_answers_lower_seals() -> None:
    book = WindowBook(seal_timeout=10.0)
    a, t = W("a"), T()
    book.handle(a.hello(), 0.0)
    book.handle(t.step(1), 0.0)
    book.handle(t.step(2), 0.0)
    book.handle(a.batch(1.0, 2, mark=2), 0.1)  # missed seal 1: mark 2 answers both
    s1, s2 = book.tick(0.1)
    assert (s1.step, s2.step) == (1, 2)
    assert weight(s1) == 2 and weight(s2) == 0


def test_late_joiner_joins_the_next_window() -> None:
    book = WindowBook(seal_timeout=10.0)
    a, late, t = W("a"), W("late"), T()
    book.handle(a.hello(), 0.0)
    book.handle(t.step(5), 0.0)
    book.handle(late.hello(), 0.1)
    book.handle(late.batch(1.0, 1), 0.1)
    assert book.waiting_on(5) == [("a", "1")]
    book.handle(a.batch(0, 0, mark=5), 0.2)
    [sw] = book.tick(0.2)
    assert weight(sw) == 0
    book.handle(t.step(6), 0.3)
    assert book.waiting_on(6) == [("a", "1"), ("late", "1")]
    book.handle(a.batch(0, 0, mark=6), 0.4)
    book.handle(late.batch(0, 0, mark=6), 0.4)
    [sw6] = book.tick(0.4)
    assert weight(sw6) == 1


def test_stale_train_reports_are_counted() -> None:
    book = WindowBook()
    t = T()
    book.handle(t.step(1), 0.0)
    [sw] = book.tick(0.0)
    assert sw.step == 1
    assert book.handle(t.step(1), 0.1) == []
    book.handle(t.step(2), 0.1)
    [sw2] = book.tick(0.1)
    assert sw2.counters["stale_train_steps"] == 1


def test_timer_windows_and_drain_commit_everything_held() -> None:
    book = WindowBook(seal_timeout=10.0)
    a = W("a")
    book.handle(a.hello(), 0.0)
    book.handle(a.batch(1.0, 1), 0.0)
    step = book.open_timer_window(0.0)
    assert step == 1
    book.handle(a.batch(1.0, 1, mark=1), 0.1)
    [sw] = book.tick(0.1)
    assert sw.train is None and weight(sw) == 2
    book.handle(a.batch(1.0, 7), 0.2)
    [last] = book.drain(0.3)
    assert last.step == 2 and weight(last) == 7


def test_conservation_under_random_interleavings() -> None:
    rng = random.Random(1234)
    for trial in range(30):
        book = WindowBook(seal_timeout=0.5, gone_min=0.7, gone_heartbeats=1.0)
        workers = [W(f"w{i}") for i in range(rng.randint(1, 6))]
        t = T()
        sent_n, sent_sum = 0, 0.0
        committed: list[SealedWindow] = []
        now, step = 0.0, 0
        for _ in range(300):
            now += rng.random() * 0.05
            w = rng.choice(workers)
            r = rng.random()
            if r < 0.5:
                n = rng.randint(0, 3)
                v = float(rng.randint(-5, 5))
                book.handle(w.batch(v, n), now)
                sent_n += n
                sent_sum += v * n
            elif r < 0.6:
                step += 1
                book.handle(t.step(step), now)
            elif r < 0.85 and book.windows:
                m = rng.choice(sorted(book.windows))
                n = rng.randint(0, 2)
                book.handle(w.batch(1.0, n, mark=m), now)
                sent_n += n
                sent_sum += n
            elif r < 0.9:
                idx = workers.index(w)
                workers[idx] = W(w.src, str(trial) + str(now))  # restart
            else:
                dup = w.batch(2.0, 1)
                book.handle(dup, now)
                book.handle(dup, now)
                sent_n += 1
                sent_sum += 2.0
            committed += book.tick(now)
        committed += book.drain(now + 10)
        steps = [s.step for s in committed]
        assert steps == sorted(steps) and len(set(steps)) == len(steps)
        assert sum(weight(s) for s in committed) == sent_n
        assert sum(total(s) for s in committed) == sent_sum


def test_joiner_answering_a_committed_seal_is_carried_not_late() -> None:
    book = WindowBook(seal_timeout=10.0)
    a, j, t = W("a"), W("j"), T()
    book.handle(a.hello(), 0.0)
    book.handle(t.step(1), 0.0)
    book.handle(j.hello(), 0.1)  # joins while 1 is open: not waited on
    book.handle(a.batch(0, 0, mark=1), 0.2)
    [sw1] = book.tick(0.2)
    book.handle(j.batch(1.0, 3, mark=1), 0.3)  # answers the (re-announced) seal 1 late
    book.handle(t.step(2), 0.4)
    book.handle(a.batch(0, 0, mark=2), 0.5)
    book.handle(j.batch(0, 0, mark=2), 0.5)
    [sw2] = book.tick(0.5)
    assert weight(sw1) == 0 and weight(sw2) == 3
    assert sw2.counters["late_events"] == 0 and sw2.counters["carried_events"] == 3


def test_restart_that_reuses_its_incarnation_keeps_its_data() -> None:
    """Regression: a restarted process that passed the same ``incarnation`` numbers its
    frames from 1 again; they were all dropped as duplicates of the old process's."""
    book = WindowBook(seal_timeout=10.0)
    old, t = W("a", "fixed"), T()
    book.handle(old.hello(), 0.0)
    for _ in range(5):
        book.handle(old.batch(1.0, 2), 0.1)  # seq 2..6; no mark: pending at the crash
    new = W("a", "fixed")  # the restarted process: same id and incarnation, seq from 1
    book.handle(new.hello(), 0.5)
    book.handle(new.batch(1.0, 3), 0.6)
    book.handle(t.step(1), 0.7)
    assert book.waiting_on(1) == [("a", "fixed")]  # the new process is waited on
    book.handle(new.batch(0, 0, mark=1), 0.8)
    [sw] = book.tick(0.8)
    assert weight(sw) == 13
    assert sw.counters["duplicate_batches"] == 0 and sw.counters["restarts"] == 1
    assert sw.counters["workers_seen"] == 2


def test_timer_stops_opening_windows_once_a_trainer_registers() -> None:
    """Regression: with --commit-every, timer windows kept taking step numbers until the
    trainer's first report, so its reports for those steps were dropped as stale."""
    book = WindowBook(seal_timeout=10.0)
    a, t = W("a"), T()
    book.handle(a.hello(), 0.0)
    assert book.open_timer_window(0.0) == 1
    book.handle(a.batch(1.0, 2, mark=1), 0.1)
    [sw1] = book.tick(0.1)
    assert sw1.train is None and book.last_timer_step == 1
    t.seq = 1
    book.handle(Hello(Header("trainer", "t", 1, "train"), 3599.0), 0.2)
    assert book.trainer_known and book.open_timer_window(0.3) is None and not book.windows
    book.handle(a.batch(1.0, 4), 0.4)
    assert book.handle(t.step(2, loss=1.0), 5.0) == [2]
    book.handle(a.batch(0, 0, mark=2), 5.1)
    [sw2] = book.tick(5.1)
    assert sw2.train is not None and weight(sw2) == 4
    assert sw2.counters["stale_train_steps"] == 0


def test_a_first_frame_numbered_zero_is_accepted() -> None:
    """Regression: a producer whose first frame had sequence number 0 (the decoder allows
    it) had that frame dropped as a duplicate."""
    book = WindowBook()
    t = T()
    book.handle(Batch(Header("z", "1", 0), {"r": (SC, [2.0, 1.0, 2.0, 2.0])}, 1), 0.0)
    book.handle(t.step(1), 0.0)
    book.handle(Batch(Header("z", "1", 1), {}, 0, mark=1), 0.0)
    [sw] = book.tick(0.0)
    assert weight(sw) == 1 and sw.counters["duplicate_batches"] == 0


def test_a_stall_of_the_controller_is_not_held_against_the_workers() -> None:
    """Regression: after the controller's own loop stalled (in the simulation it shares one
    event loop with 64 workers), every worker looked silent and was declared gone."""
    book = WindowBook(seal_timeout=10.0, gone_min=0.5, gone_heartbeats=4.0)
    a, b = W("a"), W("b")
    book.handle(a.hello(0.1), 0.0)
    book.handle(b.hello(0.1), 0.0)
    book.tick(0.1)
    book.handle(b.hb(), 3.0)  # b's heartbeat was read after the stall, a's not yet
    book.tick(3.0)  # nothing checked for 2.9 s: a stall
    assert book.statistics()["gone_workers"] == 0 and book.statistics()["workers_live"] == 2
    book.tick(3.2)
    book.tick(3.4)
    book.tick(3.45)  # a silent 0.55 s of checked time > 0.5: gone; b (seen at 3.0) is not
    assert [p.key for p in book.producers.values() if p.gone] == [("a", "1")]


def test_a_worker_and_the_trainer_may_share_an_id() -> None:
    """Regression: incarnations were tracked by id alone, so the trainer's hello (default id
    "trainer") retired a rollout worker of that name: all its later data arrived "late"."""
    book = WindowBook(seal_timeout=10.0)
    w, t = W("trainer"), T()
    book.handle(w.hello(), 0.0)
    book.handle(Hello(Header("trainer", "t", 1, "train"), 3599.0), 0.1)
    t.seq = 1
    book.handle(w.batch(1.0, 2), 0.2)
    book.handle(t.step(1), 0.3)
    assert book.waiting_on(1) == [("trainer", "1")]
    book.handle(w.batch(0, 0, mark=1), 0.4)
    [sw] = book.tick(0.4)
    assert weight(sw) == 2 and sw.counters["late_events"] == 0 and sw.counters["restarts"] == 0

"""StatsLogger: journal format, step rule, resume, rank 0 only, and per-backend isolation.

Fan-out is checked with a recording backend (a real ``Backend`` that keeps what it gets)
next to backends that fail or hang: a test double stands in only for a *failing* backend,
which a real one cannot be made to be here. TensorBoard and the console are off except where
a test is about them (real backends are covered in test_backends.py)."""

from __future__ import annotations

import getpass
import logging
import math
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _dist import run_ranks
from readback import read_jsonl, read_tensorboard_scalars

from areal_stream import StatsLogger, Table
from areal_stream._backends import Backend, StepRecord
from areal_stream._backends._base import NoteOnce, expand_table, heatmap_pixels
from areal_stream._backends.console import format_step

WAIT = 30.0  # generous upper bound for waits on other threads; never reached when passing


@pytest.fixture(autouse=True)
def _no_worker_thread_left() -> Iterator[None]:
    """Every backend worker thread a test started has exited when it ends."""
    yield
    for t in threading.enumerate():
        if t.name.startswith("areal-stream-"):
            t.join(WAIT)
            assert not t.is_alive(), t.name


def cfg(root: Path, **extra: Any) -> dict[str, Any]:
    return {
        "experiment_name": "exp",
        "trial_name": "t",
        "fileroot": str(root),
        "tensorboard": {"path": None},
        "console": {"enabled": False},
        **extra,
    }


class Recorder(Backend):
    """Keeps every record it is given, in order."""

    def __init__(self) -> None:
        self.records: list[StepRecord] = []
        self.closed = False
        self._cond = threading.Condition()

    def log(self, record: StepRecord) -> None:
        with self._cond:
            self.records.append(record)
            self._cond.notify_all()

    def close(self) -> None:
        self.closed = True

    def wait_for(self, n: int) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.records) >= n, WAIT), len(self.records)


class Failing(Backend):
    """Raises ValueError on every step, RuntimeError on step 3 (two kinds of error)."""

    def log(self, record: StepRecord) -> None:
        if record.step == 3:
            raise RuntimeError("boom at 3")
        raise ValueError(f"bad step {record.step}")


class Hung(Backend):
    """Blocks inside log() until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.closed = threading.Event()
        self.steps: list[int] = []

    def log(self, record: StepRecord) -> None:
        self.entered.set()
        assert self.release.wait(WAIT)
        self.steps.append(record.step)

    def close(self) -> None:
        self.closed.set()


def test_journal_step_rule_and_values(tmp_path: Path) -> None:
    import torch

    rec = Recorder()
    logger = StatsLogger(cfg(tmp_path), extra_backends=[("rec", rec)])
    try:
        expect_path = tmp_path / "logs" / getpass.getuser() / "exp" / "t" / "stats.jsonl"
        assert logger.journal_path == str(expect_path)
        assert logger.backends == ["rec"]
        logger.commit(0, 0, 0, {"a": 1.5, "a__count": 4, "flag": False, "t": torch.tensor(2.5)})
        logger.commit(0, 1, 1, [{"b": np.float64(0.25)}, {"b": np.int64(3)}, {}])
        logger.commit(0, 2, 2, {"c": np.array(7.0)})  # max(2, 3 + 1) = 4
        logger.commit(1, 0, 10, {"d": float("nan"), "e": float("-inf")})
        logger.commit(1, 1, 10, [])  # nothing to log: no step taken
        logger.commit(1, 1, 10, {"f": 1})  # max(10, 11) = 11
        assert logger.state_dict() == {"last_commit_step": 11}
        assert logger.flush(WAIT)
    finally:
        logger.close()
    lines = read_jsonl(expect_path)
    assert [(x["global_step"], x["step"], x["epoch"], x["epoch_step"]) for x in lines] == [
        (0, 0, 0, 0),
        (1, 1, 0, 1),
        (1, 2, 0, 1),
        (1, 3, 0, 1),
        (2, 4, 0, 2),
        (10, 10, 1, 0),
        (10, 11, 1, 1),
    ]
    stats = [x["stats"] for x in lines]
    assert stats[0] == {"a": 1.5, "flag": 0, "t": 2.5}
    assert stats[1] == {"b": 0.25} and stats[2] == {"b": 3} and stats[3] == {}
    assert type(stats[2]["b"]) is int and stats[4] == {"c": 7.0}
    assert math.isnan(stats[5]["d"]) and stats[5]["e"] == -math.inf
    # the backend saw exactly the journal, in order
    assert [r.step for r in rec.records] == [x["step"] for x in lines]
    assert [dict(r.stats).keys() for r in rec.records] == [s.keys() for s in stats]
    assert rec.closed


def test_bad_input_raises_and_writes_nothing(tmp_path: Path) -> None:
    import torch

    logger = StatsLogger(cfg(tmp_path))
    try:
        with pytest.raises(TypeError, match=r"stats\['s'\] must be a number or an areal_stream"):
            logger.commit(0, 0, 0, {"ok": 1.0, "s": "text"})
        with pytest.raises(TypeError, match=r"stats\['v'\]"):
            logger.commit(0, 0, 0, [{"ok": 1.0}, {"v": [1, 2]}])  # second dict bad: none kept
        with pytest.raises(TypeError, match=r"stats\['n'\] must be a number .*got NoneType"):
            logger.commit(0, 0, 0, {"ok": 1.0, "n": None})
        with pytest.raises(TypeError, match=r"stats\['t'\] .*got Tensor with 2 elements"):
            logger.commit(0, 0, 0, {"ok": 1.0, "t": torch.tensor([1.0, 2.0])})
        with pytest.raises(TypeError, match=r"stats\['e'\] .*got Tensor with 0 elements"):
            logger.commit(0, 0, 0, {"e": torch.tensor([])})
        with pytest.raises(TypeError, match=r"stats\['a'\] .*got ndarray with 3 elements"):
            logger.commit(0, 0, 0, [{"ok": 1.0}, {"a": np.zeros(3)}])
        with pytest.raises(TypeError, match="keys must be non-empty strings"):
            logger.commit(0, 0, 0, {3: 1.0})  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="must be integers"):
            logger.commit(0, 0, 1.5, {"a": 1.0})  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="item 0 is int"):
            logger.commit(0, 0, 0, [1])  # type: ignore[list-item]
        for junk in (None, "text", 3):
            with pytest.raises(TypeError, match="must be a dict or a list of dicts, got"):
                logger.commit(0, 0, 0, junk)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"Table cell \(row 0, column 'b'\)"):
            logger.commit(0, 0, 0, {"t": Table(["a", "b"], [[1, object()]])})
        assert logger.state_dict() == {"last_commit_step": -1}
        assert Path(logger.journal_path or "").read_text() == ""
    finally:
        logger.close()
    with pytest.raises(RuntimeError, match="after close"):
        logger.commit(0, 0, 0, {"a": 1.0})


def test_resume_keeps_steps_monotonic(tmp_path: Path) -> None:
    first = StatsLogger(cfg(tmp_path))
    try:
        first.commit(0, 0, 0, {"x": 0.0})
        first.commit(0, 1, 5, [{"x": 1.0}, {"x": 2.0}])  # steps 5, 6
        state = first.state_dict()
    finally:
        first.close()
    assert state == {"last_commit_step": 6}
    rec = Recorder()
    second = StatsLogger(cfg(tmp_path), extra_backends=[("rec", rec)])
    try:
        second.load_state_dict(state)
        second.commit(0, 1, 5, {"x": 3.0})  # the trainer re-runs step 5 after a restart
        second.commit(0, 2, 6, {"x": 4.0})
        with pytest.raises(ValueError, match="last_commit_step"):
            second.load_state_dict({})
        with pytest.raises(TypeError, match="must be an integer"):
            second.load_state_dict({"last_commit_step": "7"})
    finally:
        second.close()
    lines = read_jsonl(second.journal_path or "")
    assert [(x["step"], x["stats"]["x"]) for x in lines] == [
        (0, 0.0),
        (5, 1.0),
        (6, 2.0),
        (7, 3.0),
        (8, 4.0),
    ]
    assert [r.step for r in rec.records] == [7, 8]


def test_failing_backend_is_counted_and_others_get_every_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rec = Recorder()
    logger = StatsLogger(cfg(tmp_path), extra_backends=[("bad", Failing()), ("rec", rec)])
    try:
        with caplog.at_level(logging.ERROR, logger="areal_stream.stats_logger"):
            for i in range(6):
                logger.commit(0, i, i, {"i": i})
                assert logger.flush(WAIT)
        stats = logger.statistics()
    finally:
        logger.close()
    assert [r.step for r in rec.records] == list(range(6))
    lines = read_jsonl(logger.journal_path or "")
    # each step reports the errors of the steps before it; the healthy backend never appears
    for i, line in enumerate(lines):
        want = {"i": i}
        if i:
            want |= {"committer/bad/errors": i, "committer/bad/dropped": 0}
        assert line["stats"] == want
    assert (stats["bad"].logged, stats["bad"].errors, stats["bad"].dropped) == (0, 6, 0)
    assert (stats["rec"].logged, stats["rec"].errors) == (6, 0)
    # logged once per kind: ValueError once, RuntimeError once, each with its traceback
    msgs = [r for r in caplog.records if r.name == "areal_stream.stats_logger"]
    assert len(msgs) == 2
    assert "ValueError: bad step 0" in msgs[0].getMessage()
    assert "RuntimeError: boom at 3" in msgs[1].getMessage()
    assert all(m.exc_info is not None for m in msgs)


def test_hung_backend_drops_only_its_own_steps(tmp_path: Path) -> None:
    hung, rec = Hung(), Recorder()
    logger = StatsLogger(cfg(tmp_path, queue_size=4), extra_backends=[("hung", hung), ("rec", rec)])
    try:
        logger.commit(0, 0, 0, {"i": 0})
        assert hung.entered.wait(WAIT)  # step 0 is inside hung.log(), blocked
        for i in range(1, 20):
            logger.commit(0, i, i, {"i": i})  # would hang the test if commit waited
            rec.wait_for(i + 1)  # the healthy backend keeps up, step by step
        assert [r.step for r in rec.records] == list(range(20))
        assert logger.statistics()["hung"].dropped == 15  # 4 queued, 15 dropped
        assert logger.flush(timeout=0.05) is False  # flush gives up on the hung backend
        hung.release.set()
    finally:
        hung.release.set()
        logger.close()
    assert hung.steps == [0, 1, 2, 3, 4]
    lines = read_jsonl(logger.journal_path or "")
    assert len(lines) == 20  # the journal has every step
    for i, line in enumerate(lines):
        dropped_before = max(0, i - 1 - 4)  # steps 1-4 queued, 5.. dropped
        if dropped_before:
            assert line["stats"]["committer/hung/dropped"] == dropped_before
            assert line["stats"]["committer/hung/errors"] == 0
        else:
            assert "committer/hung/dropped" not in line["stats"]


def test_close_time_limit_leaves_a_hung_backend_behind(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    hung, rec = Hung(), Recorder()
    logger = StatsLogger(
        cfg(tmp_path, close_timeout=0.2), extra_backends=[("hung", hung), ("rec", rec)]
    )
    try:
        logger.commit(0, 0, 0, {"i": 0})
        assert hung.entered.wait(WAIT)
        logger.commit(0, 1, 1, {"i": 1})
        logger.commit(0, 2, 2, {"i": 2})
        rec.wait_for(3)  # only the healthy backend's close() has to fit in close_timeout
        with caplog.at_level(logging.WARNING, logger="areal_stream.stats_logger"):
            logger.close()  # returns although hung.log() is still blocked
        assert not hung.release.is_set() and not hung.closed.is_set()
        st = logger.statistics()
        assert (st["hung"].state, st["hung"].dropped, st["hung"].queued) == ("abandoned", 2, 0)
        assert (st["rec"].state, st["rec"].logged) == ("closed", 3)
        assert rec.closed
        assert any(
            "hung backend did not finish in time; 2 queued" in r.getMessage()
            for r in caplog.records
        )
    finally:
        hung.release.set()
    assert hung.closed.wait(WAIT)  # the worker thread finishes once unblocked
    assert hung.steps == [0]


def test_registration_hook_and_bad_extra_backends(tmp_path: Path) -> None:
    from areal_stream._backends import register_backend, registered_backends, unregister_backend

    rec = Recorder()
    register_backend("mine", lambda config, log_dir: rec if config.trial_name == "t" else None)
    try:
        with pytest.raises(ValueError, match="already registered"):
            register_backend("mine", lambda c, d: None)
        assert registered_backends()[-1] == "mine"
        with StatsLogger(cfg(tmp_path)) as logger:
            assert logger.backends == ["mine"]
            logger.commit(0, 0, 0, {"a": 1})
        assert [r.step for r in rec.records] == [0]
    finally:
        unregister_backend("mine")
    assert "mine" not in registered_backends()
    with pytest.raises(ValueError, match="built-in"):
        unregister_backend("wandb")
    with pytest.raises(ValueError, match="clash"):
        StatsLogger(cfg(tmp_path, console={"enabled": True}), extra_backends=[("console", rec)])
    with pytest.raises(ValueError, match="'r' is given twice"):
        StatsLogger(cfg(tmp_path), extra_backends=[("r", rec), ("r", Recorder())])
    with pytest.raises(TypeError, match="no log"):
        StatsLogger(cfg(tmp_path), extra_backends=[("x", object())])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="StatsLogger expects"):
        StatsLogger(3)


def test_embedded_default_tensorboard_and_console(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = {"experiment_name": "exp", "trial_name": "t", "fileroot": str(tmp_path)}
    with StatsLogger(config) as logger:
        assert logger.backends == ["tensorboard", "console"]
        logger.commit(0, 0, 3, {"loss": 0.1, "n": 2})
        assert logger.flush(WAIT)
    log_dir = Path(logger.log_dir)
    assert read_tensorboard_scalars(log_dir / "tensorboard") == {
        "loss": {3: float(np.float32(0.1))},
        "n": {3: 2.0},
    }
    out = capsys.readouterr().out
    assert (
        out == "step 3  (global_step 3, epoch 0, epoch_step 0)  2 stats\n  loss  0.1\n  n     2\n"
    )


def _rank_fn(rank: int, world: int, root: str) -> dict[str, Any]:
    config: dict[str, Any] = {
        "experiment_name": "exp",
        "trial_name": "t",
        "fileroot": os.path.join(root, str(rank)),
    }
    config["console"] = {"enabled": False}
    logger = StatsLogger(config)  # TensorBoard default on: rank 1 must not create it either
    logger.commit(0, 0, 0, {"rank": rank})
    logger.commit(0, 1, 1, [{"rank": rank}, {"rank": rank}])
    logger.close()
    return {
        "exists": os.path.exists(os.path.join(root, str(rank))),
        "backends": logger.backends,
        "state": logger.state_dict(),
    }


def test_only_rank_zero_logs(tmp_path: Path) -> None:
    r0, r1 = run_ranks(_rank_fn, 2, str(tmp_path))
    assert r0["exists"] and r0["backends"] == ["tensorboard"]
    assert r0["state"] == {"last_commit_step": 2}
    assert not r1["exists"] and r1["backends"] == []
    lines = read_jsonl(next((tmp_path / "0" / "logs").glob("*/exp/t/stats.jsonl")))
    assert [(x["step"], x["stats"]) for x in lines] == [
        (0, {"rank": 0}),
        (1, {"rank": 0}),
        (2, {"rank": 0}),
    ]


def test_table_expansion_and_heatmap_rules() -> None:
    note_log: list[str] = []
    note = NoteOnce("x")
    note._seen = set()  # fresh
    t = Table(
        ["layer", "expert", "tokens", "name"],
        [[0, 1, 5, "a"], [2, 0, 7, "b"]],
        index=["layer", "expert"],
    )
    assert expand_table("moe/expert_loads", t, note) == {
        "moe/layer_0/expert_1/tokens": 5,
        "moe/layer_2/expert_0/tokens": 7,
    }  # the string column is skipped (noted once)
    assert expand_table("top", t, note)["layer_0/expert_1/tokens"] == 5  # no parent path
    plain = Table(["v", "w"], [[1.5, True]])
    assert expand_table("k", plain, note) == {"k/0/v": 1.5, "k/0/w": 1}
    del note_log
    h = Table(
        ["r", "c", "v"],
        [["b", 1, 2.0], ["a", 0, 4.0], ["a", 1, float("nan")], ["b", 0, -1.0]],
        index=["r", "c"],
        heatmap="v",
    )
    rows, cols, px = heatmap_pixels(h)
    assert rows == ["a", "b"] and cols == [0, 1]
    assert px == [[255, 0], [0, 128]]  # nan and negative -> 0; round(255 * 2 / 4) = 128
    zero = Table(["r", "c", "v"], [[0, 0, 0.0], [0, 2, 0.0]], index=["r", "c"], heatmap="v")
    assert heatmap_pixels(zero)[2] == [[0, 0]]


def test_console_format_limits_rows() -> None:
    rec = StepRecord(
        5, 4, 1, 2, {"b": 1.23456789, "a": 3, "c": float("inf"), "t": Table(["x"], [])}
    )
    assert format_step(rec) == (
        "step 5  (global_step 4, epoch 1, epoch_step 2)  3 stats\n  a  3\n  b  1.23457\n  c  inf"
    )
    assert format_step(rec, max_rows=1).splitlines()[1:] == ["  a  3", "  ... 2 more"]


class Stuck(Backend):
    """Blocks in ``open()`` or ``close()`` until released, or raises in ``close()``."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.entered = threading.Event()
        self.release = threading.Event()
        self.steps: list[int] = []
        self._cond = threading.Condition()

    def _block(self, phase: str) -> None:
        if self.where == phase:
            self.entered.set()
            assert self.release.wait(WAIT)

    def open(self) -> None:
        self._block("open")

    def log(self, record: StepRecord) -> None:
        with self._cond:
            self.steps.append(record.step)
            self._cond.notify_all()

    def wait_for_steps(self, n: int) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.steps) >= n, WAIT), self.steps

    def close(self) -> None:
        if self.where == "close-raises":
            raise OSError("cannot finish")
        self._block("close")


def test_backends_stuck_in_open_or_close_isolated(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    opening, closing, raising, rec = (
        Stuck("open"),
        Stuck("close"),
        Stuck("close-raises"),
        Recorder(),
    )
    logger = StatsLogger(
        cfg(tmp_path, queue_size=2, close_timeout=0.5),
        extra_backends=[
            ("opening", opening),
            ("closing", closing),
            ("raising", raising),
            ("rec", rec),
        ],
    )
    try:
        assert opening.entered.wait(WAIT)
        for i in range(5):
            logger.commit(0, i, i, {"i": i})  # never waits on the backend stuck in open()
            rec.wait_for(i + 1)  # (queues hold 2 steps: let the healthy one keep up)
            closing.wait_for_steps(i + 1)
            raising.wait_for_steps(i + 1)
        assert logger.flush(timeout=0.05) is False  # the stuck open() blocks that flush only
        for _ in range(3):  # repeated flushes of a stuck backend do not pile up markers
            logger.flush(timeout=0)
        assert len(logger._fanout.workers[0]._items) == 2 + 1  # type: ignore[union-attr]
        with caplog.at_level(logging.WARNING, logger="areal_stream.stats_logger"):
            logger.close()  # within close_timeout although two backends are stuck
        st = logger.statistics()
        assert (st["opening"].state, st["opening"].dropped) == ("abandoned", 5)  # 2 queued
        assert (st["closing"].state, st["closing"].logged) == ("abandoned", 5)
        assert (st["raising"].state, st["raising"].logged, st["raising"].errors) == ("closed", 5, 1)
        assert (st["rec"].state, st["rec"].logged) == ("closed", 5) and rec.closed
        assert "raising backend failed in close: OSError: cannot finish" in caplog.text
        assert "opening backend did not finish in time; 2 queued" in caplog.text
    finally:
        opening.release.set()
        closing.release.set()
        logger.close()  # no-op when the test got there
    assert closing.steps == raising.steps == [0, 1, 2, 3, 4]
    assert opening.steps == []  # abandoned: its queue was dropped, nothing logged late


def test_timeouts_beyond_what_threads_accept(tmp_path: Path) -> None:
    """``flush(inf)`` / a huge close timeout used to raise OverflowError (and leave the
    journal open and the worker threads running)."""
    from areal_stream._fanout import Fanout

    rec = Recorder()
    with StatsLogger(cfg(tmp_path), extra_backends=[("rec", rec)]) as logger:
        logger.commit(0, 0, 0, {"a": 1.0})
        assert logger.flush(timeout=float("inf")) is True
        assert logger.flush(timeout=1e300) is True
    assert rec.closed
    other = Recorder()
    fanout = Fanout([("other", other)], queue_size=4)
    assert fanout.close(float("inf")) is True and other.closed


async def test_commit_from_an_event_loop_then_aclose(tmp_path: Path) -> None:
    import asyncio

    hung, rec = Hung(), Recorder()
    logger = StatsLogger(
        cfg(tmp_path, close_timeout=0.2), extra_backends=[("hung", hung), ("rec", rec)]
    )
    try:
        for i in range(3):  # the controller commits from its event loop: never waits
            logger.commit(0, i, i, {"i": i})
            await asyncio.sleep(0)
        await asyncio.wait_for(asyncio.to_thread(rec.wait_for, 3), timeout=WAIT)
        await asyncio.wait_for(logger.aclose(), timeout=WAIT)
        assert [r.step for r in rec.records] == [0, 1, 2] and rec.closed
    finally:
        hung.release.set()
    assert hung.closed.wait(WAIT)


def test_backends_import_only_when_enabled(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from areal_stream import StatsLogger\n"
        "lg = StatsLogger({'experiment_name': 'e', 'trial_name': 't', 'fileroot': sys.argv[1],"
        " 'console': {'enabled': False}})\n"
        "lg.commit(0, 0, 0, {'a': 1.0})\n"
        "lg.close()\n"
        "print(sorted(m for m in ('torch', 'wandb', 'swanlab', 'trackio', 'tensorboard')"
        " if m in sys.modules))\n"
    )
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['tensorboard']"  # the embedded default; torch never

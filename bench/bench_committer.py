"""How long ``StatsLogger.commit`` holds the caller (e.g. the controller's event loop).

Per-commit wall time, median and p99, for a typical step (200 scalars) and a step with a
MoE expert-load Table (48 layers x 128 experts), against a same-run baseline: encoding the
same step as one JSON line and writing + flushing it (the journal's irreducible cost).
Setups: journal only; journal + real TensorBoard + two in-memory backends; journal + a
backend hung inside ``log()`` (its queue full, every step dropped for it alone).
Run: ``python -m bench.bench_committer`` (or via ``python -m bench``).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from areal_stream import StatsLogger, Table
from areal_stream._backends import Backend, StepRecord

N = 300


class _Sink(Backend):
    def log(self, record: StepRecord) -> None:
        self.last = record.step


class _Hung(Backend):
    def __init__(self) -> None:
        self.release = threading.Event()

    def log(self, record: StepRecord) -> None:
        self.release.wait(120)


def _step(table: bool) -> dict[str, Any]:
    stats: dict[str, Any] = {f"group{i % 10}/metric{i}": 0.001 * i for i in range(200)}
    if table:
        rows = [[la, e, 100 + la + e, 100 / 128] for la in range(48) for e in range(128)]
        stats["moe_balance/expert_loads"] = Table(
            ["layer", "expert", "tokens", "load_percent"], rows, index=["layer", "expert"]
        )
    return stats


def _time(fn: Callable[[int], None]) -> list[float]:
    out = []
    for i in range(N):
        t0 = time.perf_counter_ns()
        fn(i)
        out.append((time.perf_counter_ns() - t0) / 1000)
    return out


def _baseline(tmp: str, stats: dict[str, Any]) -> list[float]:
    from areal_stream._backends.jsonl import encode_record

    with open(os.path.join(tmp, "base.jsonl"), "w") as f:

        def one(i: int) -> None:
            f.write(encode_record(StepRecord(i, i, 0, i, stats)) + "\n")
            f.flush()

        return _time(one)


def _commits(tmp: str, name: str, stats: dict[str, Any], setup: str) -> list[float]:
    cfg = {
        "experiment_name": "bench",
        "trial_name": name,
        "fileroot": tmp,
        "console": {"enabled": False},
        "queue_size": 64,
        "close_timeout": 5,
    }
    extra: list[tuple[str, Backend]] = []
    hung = _Hung()
    if setup == "journal":
        cfg["tensorboard"] = {"path": None}
    elif setup == "fanout":
        extra = [("sink1", _Sink()), ("sink2", _Sink())]
    else:
        cfg["tensorboard"] = {"path": None}
        extra = [("hung", hung)]
    logger = StatsLogger(cfg, extra_backends=extra)
    try:
        return _time(lambda i: logger.commit(0, i, i, stats))
    finally:
        hung.release.set()
        logger.close()


def run() -> str:
    lines = [
        "## Committer: time `StatsLogger.commit` holds the caller",
        "",
        f"{N} commits per row; microseconds; ratio = median / baseline median "
        "(baseline: encode the step as a JSON line, write and flush it).",
        "",
        "| step | setup | median us | p99 us | ratio |",
        "|---|---|---:|---:|---:|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for table in (False, True):
            stats = _step(table)
            label = "200 scalars + 6144-row Table" if table else "200 scalars"
            base = statistics.median(_baseline(tmp, stats))
            lines.append(f"| {label} | baseline | {base:.0f} | | 1.00 |")
            for setup in ("journal", "fanout", "hung"):
                name = f"{setup}_{int(table)}"
                t = sorted(_commits(tmp, name, stats, setup))
                med, p99 = statistics.median(t), t[int(0.99 * (len(t) - 1))]
                desc = {
                    "journal": "journal only",
                    "fanout": "journal + TensorBoard + 2 sinks",
                    "hung": "journal + 1 hung backend",
                }[setup]
                lines.append(f"| {label} | {desc} | {med:.0f} | {p99:.0f} | {med / base:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    return text


if __name__ == "__main__":
    run()

"""Streaming benchmarks: throughput into one controller, and seal-to-commit latency.

- throughput: 8 rollout worker processes record scalars with the real stats tracker as
  fast as they can, in alternating rounds without streaming (baseline: recording alone)
  and with a ``RolloutStream`` open, to one ``python -m areal_stream.controller`` on
  loopback. Reports recorded scalars/s in total (median over rounds), the ratio to the
  baseline, and the fraction of streamed events the controller committed (must be 1).
- commit latency: a trainer's ``commit`` -> the controller publishing "step committed",
  with 64 rollout workers (one process, each worker its own record source) answering each
  seal, vs 1 worker (baseline). p50 / p99 over the steps of each round, median of rounds.

Run alone: ``python -m bench.bench_stream``. Worker processes are this module run with
``worker`` / ``fleet`` arguments.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
N_PROCS = 8
ROUNDS = 3
ROUND_S = 1.0
GAP_S = 0.4
LAT_WORKERS = 64
LAT_STEPS = 100
LAT_ROUNDS = 3


# ---------------------------------------------------------------------------- child processes


async def _record_until(deadline: float, flows: int = 16) -> int:
    from areal_stream import stats_tracker

    tr = stats_tracker.get("rollout")
    counts = [0] * flows

    async def flow(i: int) -> None:
        sc = tr.scalar
        x = float(i)
        while time.time() < deadline:
            for _ in range(500):
                sc(reward=x, length=x)
            counts[i] += 1000
            await asyncio.sleep(0)

    await asyncio.gather(*(flow(i) for i in range(flows)))
    return sum(counts)


async def _throughput_worker(data: str, control: str, wid: str, t0: float, out: str) -> None:
    from areal_stream import RolloutStream, stats_tracker

    res: list[tuple[str, int]] = []
    slot = ROUND_S + GAP_S
    for r in range(ROUNDS):
        for j, mode in enumerate(("base", "stream")):
            start = t0 + (2 * r + j) * slot
            stream = None
            if mode == "stream":
                stream = RolloutStream(data, control, wid, flush_interval=0.05)
                await stream.start()
            await asyncio.sleep(max(0.0, start - time.time()))
            n = await _record_until(start + ROUND_S)
            if stream is not None:
                await stream.aclose()
            else:
                stats_tracker.take_records()  # baseline rounds stream nothing
            res.append((mode, n))
    Path(out).write_text(json.dumps(res))


async def _fleet(data: str, control: str, n: int, ready: str) -> None:
    """``n`` rollout workers in one loop, each recording a little all the time."""
    from areal_stream.streams import LocalRecordSource, RolloutStream

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    srcs = [LocalRecordSource() for _ in range(n)]
    streams = [
        RolloutStream(data, control, f"fleet-{i}", source=s, flush_interval=0.1)
        for i, s in enumerate(srcs)
    ]
    await asyncio.gather(*(s.start() for s in streams))

    async def flow(src: LocalRecordSource, rng: random.Random) -> None:
        while not stop.is_set():
            src.scalar(reward=rng.random())
            await asyncio.sleep(0.02 + rng.random() * 0.02)

    tasks = [asyncio.create_task(flow(s, random.Random(i))) for i, s in enumerate(srcs)]
    Path(ready).write_text("ready")
    await stop.wait()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.gather(*(s.aclose() for s in streams))


# ---------------------------------------------------------------------------- orchestration


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _wait_file(path: Path, procs: list[subprocess.Popen[bytes]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args!r} exited with {p.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear in {timeout}s")
        with contextlib.suppress(subprocess.TimeoutExpired):
            procs[0].wait(0.02)


def _controller(tmp: Path, *extra: str) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    cfg = tmp / "run.yaml"
    cfg.write_text(
        "stats_logger:\n  experiment_name: bench\n  trial_name: t\n"
        f"  fileroot: {tmp}\n  tensorboard: {{path: null}}\n  console: {{enabled: false}}\n"
    )
    ready = tmp / "ready.json"
    p = subprocess.Popen(
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
            "--log-level",
            "WARNING",
            *extra,
        ],
        env=_env(),
        cwd=ROOT,
    )
    _wait_file(ready, [p], 60)
    return p, json.loads(ready.read_text())


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each process in turn and wait for it (workers before the controller)."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def _journal(tmp: Path) -> list[dict[str, Any]]:
    path = next(tmp.glob("logs/*/bench/t/stats.jsonl"))
    return [json.loads(x) for x in path.read_text().splitlines()]


def bench_throughput() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        ctrl, addr = _controller(tmp, "--commit-every", "0.25")
        procs = [ctrl]
        try:
            # torch imports take a few seconds per process on a small machine
            t0 = time.time() + 6.0 + 1.0 * N_PROCS
            outs = [tmp / f"w{i}.json" for i in range(N_PROCS)]
            workers = [
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "bench.bench_stream",
                        "worker",
                        addr["data"],
                        addr["control"],
                        f"w{i}",
                        repr(t0),
                        str(outs[i]),
                    ],
                    env=_env(),
                    cwd=ROOT,
                )
                for i in range(N_PROCS)
            ]
            procs += workers
            for w in workers:
                if w.wait(120) != 0:
                    raise RuntimeError(f"throughput worker exited with {w.returncode}")
        finally:
            _stop(procs[::-1])
        if ctrl.returncode != 0:
            raise RuntimeError(f"controller exited with {ctrl.returncode}")
        per = [json.loads(o.read_text()) for o in outs]
        lines = _journal(tmp)
    base = [sum(p[2 * r][1] for p in per) / ROUND_S for r in range(ROUNDS)]
    stream = [sum(p[2 * r + 1][1] for p in per) / ROUND_S for r in range(ROUNDS)]
    streamed = sum(n for p in per for mode, n in p if mode == "stream")
    committed = sum(ln["stats"].get("bus/events", 0) for ln in lines)
    late = sum(ln["stats"].get("bus/late_events", 0) for ln in lines)
    carried = sum(ln["stats"].get("bus/carried_events", 0) for ln in lines)
    return {
        "base": statistics.median(base),
        "stream": statistics.median(stream),
        "ratio": statistics.median(s / b for s, b in zip(stream, base)),
        "delivered": committed / streamed if streamed else float("nan"),
        "late": late,
        "carried": carried,
        "windows": len(lines),
    }


def _latency_round(n_workers: int) -> list[tuple[float, float]]:
    import zmq

    from bus._codec import Committed, decode
    from workers._train import TrainReporter

    out: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        ctrl, addr = _controller(tmp, "--seal-timeout", "5")
        procs = [ctrl]
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVTIMEO, 10_000)
        sub.connect(addr["control"])
        rep = None
        try:
            ready = tmp / "fleet.ready"
            fleet = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bench.bench_stream",
                    "fleet",
                    addr["data"],
                    addr["control"],
                    str(n_workers),
                    str(ready),
                ],
                env=_env(),
                cwd=ROOT,
            )
            procs.append(fleet)
            _wait_file(ready, [fleet, ctrl], 60)
            rep = TrainReporter(lambda **kw: {"loss": 1.0}, data=addr["data"], rank=0)
            for r in range(LAT_ROUNDS):
                lat = []
                for k in range(LAT_STEPS):
                    step = r * LAT_STEPS + k + 1
                    t = time.perf_counter()
                    rep.commit(step)
                    while True:
                        msg = decode(sub.recv())
                        if isinstance(msg, Committed) and msg.step >= step:
                            break
                    lat.append(time.perf_counter() - t)
                    time.sleep(0.005)  # the next training step
                lat.sort()
                p50 = lat[len(lat) // 2]
                p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
                out.append((p50 * 1000, p99 * 1000))
        finally:
            if rep is not None:
                rep.close()
            sub.close(0)
            ctx.term()
            _stop(procs[::-1])
    return out


def bench_latency() -> dict[str, float]:
    res: dict[str, float] = {}
    for n in (1, LAT_WORKERS):
        rounds = _latency_round(n)
        res[f"p50_{n}"] = statistics.median(r[0] for r in rounds)
        res[f"p99_{n}"] = statistics.median(r[1] for r in rounds)
    return res


def run() -> str:
    tp = bench_throughput()
    lat = bench_latency()
    lines = [
        "## Streaming (bench_stream)",
        "",
        f"Throughput: {N_PROCS} worker processes x 16 workflows, real stats tracker, one "
        f"controller on loopback; median of {ROUNDS} rounds of {ROUND_S:.0f} s.",
        "",
        "| measure | value |",
        "|---|---|",
        f"| recorded scalars/s, recording only (baseline) | {tp['base']:,.0f} |",
        f"| recorded scalars/s, streaming to the controller | {tp['stream']:,.0f} |",
        f"| streaming / baseline | {tp['ratio']:.2f} |",
        f"| events committed by the controller / events streamed | {tp['delivered']:.6f} |",
        f"| late events / carried events (workers joining mid-window) | {tp['late']:.0f} / "
        f"{tp['carried']:.0f} |",
        "",
        f"Commit latency (trainer commit -> controller reports the step committed), "
        f"{LAT_STEPS} steps per round, median of {LAT_ROUNDS} rounds:",
        "",
        "| workers | p50 ms | p99 ms |",
        "|---|---|---|",
        f"| 1 (baseline) | {lat['p50_1']:.2f} | {lat['p99_1']:.2f} |",
        f"| {LAT_WORKERS} | {lat[f'p50_{LAT_WORKERS}']:.2f} | {lat[f'p99_{LAT_WORKERS}']:.2f} |",
        f"| ratio {LAT_WORKERS} / 1 | {lat[f'p50_{LAT_WORKERS}'] / lat['p50_1']:.2f} | "
        f"{lat[f'p99_{LAT_WORKERS}'] / lat['p99_1']:.2f} |",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    return text


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        _, _, d, c, w, t0s, o = sys.argv
        asyncio.run(_throughput_worker(d, c, w, float(t0s), o))
    elif len(sys.argv) > 1 and sys.argv[1] == "fleet":
        _, _, d, c, n, ready_path = sys.argv
        asyncio.run(_fleet(d, c, int(n), ready_path))
    else:
        run()

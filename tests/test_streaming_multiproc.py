"""A real run across processes: the controller command, rollout worker processes using the
process-wide stats tracker, and 2 gloo trainer ranks; checked against the JSONL journal.

One worker kills itself (SIGKILL) mid-run once what it recorded is behind a committed
mark; garbage is pushed into the controller's data socket meanwhile. Over the whole run
the journal's counts and sums equal exactly what every worker recorded.

Run as a script (``python tests/test_streaming_multiproc.py worker ...``) this file is the
worker process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent
N_FLOWS = 12
EPISODES = 30


# ---------------------------------------------------------------------------- worker process


async def _worker_main(
    data: str, control: str, wid: str, seed: int, out: str, victim: bool
) -> None:
    import torch

    from areal_stream import RolloutStream, stats_tracker

    rng = random.Random(seed)
    tally = {"n": 0, "sum": 0.0}

    async def flow(r: random.Random) -> None:
        tr = stats_tracker.get("rollout")
        for _ in range(EPISODES):
            rewards = [float(r.randint(-4, 9)) for _ in range(r.randint(1, 4))]
            for x in rewards:
                tr.scalar(reward=x)
            tr.denominator(episodes=torch.ones(len(rewards), dtype=torch.bool))
            tr.stat(
                reward_total=torch.tensor(rewards),
                denominator="episodes",
                reduce_type=stats_tracker.ReduceType.SUM,
            )
            tally["n"] += len(rewards)
            tally["sum"] += sum(rewards)
            await asyncio.sleep(0.002)  # the episode's "generation" time

    stream = RolloutStream(data, control, wid, heartbeat_interval=0.1, flush_interval=0.02)
    await stream.start()
    await asyncio.gather(*(flow(random.Random(rng.random())) for _ in range(N_FLOWS)))
    if victim:
        step = await stream.wait_marked(timeout=30)
        await stream.wait_committed(step, timeout=30)
        _write(out, tally)
        os.kill(os.getpid(), signal.SIGKILL)
    await stream.aclose()
    assert stream.statistics().bye_acked
    _write(out, tally)


def _write(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------- trainer ranks


def trainer_ranks(rank: int, world: int, data: str, control: str, stop_file: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import zmq

    from areal_stream import TrainStream, stats_tracker
    from bus._codec import Committed, decode

    sub = None
    ctx = None
    if rank == 0:
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVTIMEO, 20_000)
        sub.connect(control)
        _until_subscribed(ctx, sub, data)
    train = TrainStream(data, group=dist.group.WORLD)
    steps = 0
    try:
        for step in range(1, 500):
            mask = torch.tensor([True, True, rank == 0])
            stats_tracker.denominator(n_tokens=mask)
            adv = torch.tensor([1.0 + rank, 2.0 + rank, 100.0]) * step
            stats_tracker.stat(adv=adv, denominator="n_tokens")
            stats_tracker.scalar(lr=0.5 + rank)
            train.commit(step, epoch=step // 10, epoch_step=step % 10)
            steps = step
            if sub is not None:
                while True:
                    msg = decode(sub.recv())
                    if isinstance(msg, Committed) and msg.step >= step:
                        break
            time.sleep(0.03)  # the next PPO step's compute
            flag = torch.tensor([1.0 if rank == 0 and os.path.exists(stop_file) else 0.0])
            dist.all_reduce(flag)
            if flag.item() > 0:
                break
    finally:
        train.close()
        if sub is not None and ctx is not None:
            sub.close(0)
            ctx.term()
    return {"steps": steps}


def _until_subscribed(ctx: Any, sub: Any, data: str) -> None:
    """Say hello (as a probe, not a worker) until the controller's welcome arrives on
    ``sub``: a SUB connected just now may miss what is published before its subscription
    reaches the controller, and the "committed" notice for step 1 is published once."""
    import zmq

    from bus._codec import Header, Welcome, decode, encode_hello

    probe = ctx.socket(zmq.PUSH)
    probe.setsockopt(zmq.LINGER, 0)
    probe.connect(data)
    try:
        for seq in range(1, 400):  # at most 20 s
            probe.send(encode_hello(Header("sub-probe", "p", seq, "train"), 3599.0))
            while sub.poll(50):
                msg = decode(sub.recv())
                if isinstance(msg, Welcome) and msg.src == "sub-probe":
                    return
        raise TimeoutError("the controller never welcomed the probe")
    finally:
        probe.close(0)


# ---------------------------------------------------------------------------- the test


def _wait_file(path: Path, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"controller exited early: {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(0.02)


def test_multiprocess_run_conserves_everything(tmp_path: Path) -> None:
    import zmq
    from _dist import run_ranks

    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        "stats_logger:\n  experiment_name: mp\n  trial_name: t1\n"
        f"  fileroot: {tmp_path}\n  tensorboard: {{path: null}}\n  console: {{enabled: false}}\n"
    )
    ready = tmp_path / "ready.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs: list[subprocess.Popen[bytes]] = []
    ctrl_log = (tmp_path / "controller.log").open("wb")
    ctrl = subprocess.Popen(
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
            "--seal-timeout",
            "3",
            "--gone-after",
            "1.0",
        ],
        env=env,
        stdout=ctrl_log,
        stderr=subprocess.STDOUT,
    )
    procs.append(ctrl)
    trainer_result: list[Any] = []
    trainer_error: list[BaseException] = []
    trainer_thread: threading.Thread | None = None
    stop_file = tmp_path / "stop"
    zctx = zmq.Context()
    bad = zctx.socket(zmq.PUSH)
    bad.setsockopt(zmq.LINGER, 0)
    try:
        _wait_file(ready, ctrl, 30)
        addr = json.loads(ready.read_text())
        bad.connect(addr["data"])
        workers = {}
        for i, wid in enumerate(["w0", "w1", "victim"]):
            out = tmp_path / f"{wid}.json"
            p = subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "worker",
                    addr["data"],
                    addr["control"],
                    wid,
                    str(100 + i),
                    str(out),
                    "1" if wid == "victim" else "0",
                ],
                env=env,
            )
            procs.append(p)
            workers[wid] = (p, out)

        def run_trainer() -> None:
            try:
                trainer_result.append(
                    run_ranks(
                        trainer_ranks,
                        2,
                        addr["data"],
                        addr["control"],
                        str(stop_file),
                        timeout=90,
                    )
                )
            except BaseException as e:  # reported by the main thread
                trainer_error.append(e)

        trainer_thread = threading.Thread(target=run_trainer, daemon=True)
        trainer_thread.start()
        n_garbage = 0
        for wid, (p, _) in workers.items():
            while True:
                try:
                    rc = p.wait(0.2)
                    break
                except subprocess.TimeoutExpired:
                    bad.send(b"\xc1not msgpack" + bytes([n_garbage % 256]))
                    n_garbage += 1
            assert rc == (-signal.SIGKILL if wid == "victim" else 0), wid
        stop_file.write_text("stop")
        trainer_thread.join(100)
        assert not trainer_thread.is_alive(), "trainer ranks did not finish"
        if trainer_error:
            raise trainer_error[0]
        ctrl.send_signal(signal.SIGTERM)
        rc = ctrl.wait(30)
        assert rc == 0, (tmp_path / "controller.log").read_text()
    finally:
        ctrl_log.close()
        bad.close(0)
        zctx.term()
        if not stop_file.exists():
            stop_file.write_text("stop")
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        if trainer_thread is not None:
            trainer_thread.join(30)

    steps = trainer_result[0][0]["steps"]
    tallies = {w: json.loads(out.read_text()) for w, (_, out) in workers.items()}
    journal = next(tmp_path.glob("logs/*/mp/t1/stats.jsonl"))
    lines = [json.loads(x) for x in journal.read_text().splitlines()]
    gsteps = [ln["global_step"] for ln in lines]
    assert gsteps[:steps] == list(range(1, steps + 1))
    assert len(gsteps) <= steps + 1  # at most one extra: what shutdown still held
    st = [ln["stats"] for ln in lines]
    assert sum(s.get("rollout/episodes", 0) for s in st) == sum(t["n"] for t in tallies.values())
    assert sum(s.get("rollout/reward_total", 0) for s in st) == sum(
        t["sum"] for t in tallies.values()
    )
    assert sum(s["bus/decode_errors"] for s in st) == n_garbage
    assert sum(s["bus/duplicate_batches"] + s["bus/gap_batches"] for s in st) == 0
    assert max(s["bus/workers_seen"] for s in st) == 3
    assert sum(s["bus/gone_workers"] + s["bus/missing_workers"] for s in st) >= 1  # the victim
    for ln in lines[:steps]:  # train stats: the packed all-reduce over both ranks
        k, s = ln["global_step"], ln["stats"]
        assert (ln["epoch"], ln["epoch_step"]) == (k // 10, k % 10)
        assert s["adv/avg"] == pytest.approx((1 + 2 + 2 + 3 + 100) * k / 5)
        assert s["adv/min"] == 1.0 * k and s["adv/max"] == 100.0 * k
        assert s["lr"] == 1.0 and s["n_tokens"] == 5


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "worker":
    _, _, data_, control_, wid_, seed_, out_, victim_ = sys.argv
    asyncio.run(_worker_main(data_, control_, wid_, int(seed_), out_, victim_ == "1"))

"""A rollout worker process: many concurrent RLVR-style workflows, streamed to the controller.

The generation engine is fake (random latency, a reward whose success rate rises over
time); everything else is what a workflow author writes with areal_stream.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import random
import signal
import time

from areal_stream import RolloutStream, stats_tracker, workflow_context


class FakeEngine:
    """Stands in for an inference server: answers after a random delay."""

    def __init__(self, seed: int, latency: float) -> None:
        self._rng = random.Random(seed)
        self._latency = latency
        self._t0 = time.monotonic()

    async def agenerate(self, prompt_len: int) -> tuple[int, float]:
        delay = self._rng.uniform(0.2, 1.8) * self._latency
        await asyncio.sleep(delay)
        return self._rng.randint(16, 512), delay

    def success_rate(self, is_eval: bool) -> float:
        # The "policy" improves as the run goes on; eval prompts are a bit harder.
        t = time.monotonic() - self._t0
        base = 0.2 + 0.6 * (1 - math.exp(-t / 20.0))
        return base * (0.8 if is_eval else 1.0)


async def rlvr_workflow(
    engine: FakeEngine, rng: random.Random, task_id: int, is_eval: bool
) -> float:
    """One episode: generate, score, record (the way AReaL's RLVRWorkflow records)."""
    workflow_context.set(workflow_context.WorkflowContext(is_eval=is_eval, task_id=task_id))
    prompt_len = rng.randint(32, 256)
    num_turns = rng.randint(1, 3)
    gen_tokens = 0
    latency = 0.0
    for _ in range(num_turns):
        n, dt = await engine.agenerate(prompt_len)
        gen_tokens += n
        latency += dt
    reward = 1.0 if rng.random() < engine.success_rate(is_eval) else 0.0
    stats_tracker.get(workflow_context.stat_scope()).scalar(
        reward=reward,
        num_turns=num_turns,
        prompt_len=prompt_len,
        gen_tokens=gen_tokens,
        latency_s=latency,
    )
    return reward


async def _run(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    engine = FakeEngine(args.seed, args.latency)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with RolloutStream(data=args.data, control=args.control, worker_id=args.worker_id):
        if args.eval_before_train:
            # One evaluation round before training starts: it lands in step 0's window.
            await asyncio.gather(
                *(rlvr_workflow(engine, rng, i, True) for i in range(args.workflows))
            )
        if args.ready_file:
            with open(args.ready_file + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(args.ready_file + ".tmp", args.ready_file)

        async def loop_forever(slot: int) -> None:
            task_id = slot
            while not stop.is_set():
                await rlvr_workflow(engine, rng, task_id, rng.random() < args.eval_fraction)
                task_id += args.workflows

        tasks = [asyncio.create_task(loop_forever(i)) for i in range(args.workflows)]
        await stop.wait()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m areal_stream.demo._worker")
    p.add_argument("--data", required=True)
    p.add_argument("--control", required=True)
    p.add_argument("--worker-id", required=True)
    p.add_argument("--workflows", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--latency", type=float, default=0.05, help="mean generation latency (s)")
    p.add_argument("--eval-fraction", type=float, default=0.1)
    p.add_argument("--eval-before-train", action="store_true")
    p.add_argument("--ready-file")
    asyncio.run(_run(p.parse_args(argv)))


if __name__ == "__main__":
    main()

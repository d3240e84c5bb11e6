"""A rollout worker process: many concurrent async workflows, streamed to the controller.

Each workflow records synchronously with ``stats_tracker`` (scalars, a token-level
``stat`` under a denominator, a timing); ``RolloutStream`` streams it in the background.

    python examples/rollout_worker.py --data tcp://HOST:5555 --control tcp://HOST:5556 \\
        --worker-id rollout-0 --seconds 5

Without ``--data`` it starts its own controller (rollout-only: a window every 0.5 s),
writes the journal under a temporary directory and prints it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
from pathlib import Path

import torch

try:
    import areal_stream  # noqa: F401
except ModuleNotFoundError:  # running from a checkout without an installed package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from areal_stream import RolloutStream, stats_tracker, workflow_context
from areal_stream.workflow_context import WorkflowContext


async def episode(rng: random.Random, task_id: int, is_eval: bool) -> None:
    """One fake RLVR episode: generate, score, record."""
    with workflow_context.using(WorkflowContext(is_eval=is_eval, task_id=task_id)):
        tracker = stats_tracker.get(workflow_context.stat_scope())
        n_tokens = rng.randint(8, 64)
        with stats_tracker.record_timing("generate"):
            await asyncio.sleep(rng.random() * 0.01)  # waiting on the inference server
        logprobs = -torch.rand(n_tokens, dtype=torch.float32)
        tracker.denominator(n_tokens=torch.ones(n_tokens, dtype=torch.bool))
        tracker.stat(logprob=logprobs, denominator="n_tokens")
        tracker.scalar(reward=float(rng.random() < 0.4), seq_len=n_tokens)


async def workflow_loop(rng: random.Random, stop_at: float, first_task: int) -> int:
    loop = asyncio.get_running_loop()
    n = 0
    while loop.time() < stop_at:
        await episode(rng, first_task + n, is_eval=(n % 10 == 9))
        n += 1
    return n


async def run_worker(
    data: str,
    control: str,
    worker_id: str,
    seconds: float,
    flows: int = 32,
    seed: int = 0,
    ready_file: str | None = None,
) -> int:
    """Run ``flows`` concurrent workflows for ``seconds``; returns the number of episodes."""
    rng = random.Random(seed)
    async with RolloutStream(data=data, control=control, worker_id=worker_id) as stream:
        if ready_file:  # the controller knows us now: the next seal waits for our mark
            Path(ready_file).write_text(worker_id)
        stop_at = asyncio.get_running_loop().time() + seconds
        counts = await asyncio.gather(
            *(workflow_loop(random.Random(rng.random()), stop_at, i * 10**6) for i in range(flows))
        )
    stats = stream.statistics()
    print(
        f"[{worker_id}] {sum(counts)} episodes, {stats.batches_sent} batches, "
        f"{stats.marks_sent} seals answered, bye acknowledged: {stats.bye_acked}"
    )
    return sum(counts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data")
    p.add_argument("--control")
    p.add_argument("--worker-id", default="rollout-0")
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--flows", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-file", help="written once the controller has registered us")
    args = p.parse_args()
    if args.data and args.control:
        asyncio.run(run_worker(args.data, args.control, args.worker_id, args.seconds,
                               args.flows, args.seed, args.ready_file))  # fmt: skip
        return
    from areal_stream.controller import ControllerProcess

    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "run.yaml"
        cfg.write_text(
            "stats_logger:\n  experiment_name: example\n  trial_name: rollout_worker\n"
            f"  fileroot: {tmp}\n  tensorboard: {{path: null}}\n  console: {{enabled: false}}\n"
        )
        with ControllerProcess(str(cfg), commit_every=0.5) as ctrl:
            asyncio.run(run_worker(ctrl.data, ctrl.control, args.worker_id, args.seconds,
                                   args.flows, args.seed))  # fmt: skip
        for line in next(Path(tmp).glob("logs/*/*/*/stats.jsonl")).read_text().splitlines():
            rec = json.loads(line)
            s = rec["stats"]
            print(
                f"step {rec['global_step']}: reward {s.get('rollout/reward', float('nan')):.3f} "
                f"logprob/avg {s.get('rollout/logprob/avg', float('nan')):.3f} "
                f"eval reward {s.get('eval-rollout/reward', float('nan')):.3f} "
                f"events {s['bus/events']}"
            )


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C: the with/finally blocks above stopped the children
        sys.exit(130)

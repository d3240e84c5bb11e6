"""A training loop reporting each step to the controller, with a rollout worker streaming.

Starts the controller and one rollout worker process (``examples/rollout_worker.py``),
then runs a few fake PPO steps: each records token-level statistics and calls
``TrainStream.commit``; the controller merges the step's train stats with the rollout
window sealed for it and writes the journal, which is printed at the end.

    python examples/trainer_loop.py --steps 5
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

try:
    import areal_stream  # noqa: F401
except ModuleNotFoundError:  # running from a checkout without an installed package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from areal_stream import TrainStream, stats_tracker
from areal_stream.controller import ControllerProcess, child_env

HERE = Path(__file__).resolve().parent


def ppo_step(step: int, gen: torch.Generator) -> None:
    """What an actor's update records (the reference's PPOActor keys, simplified)."""
    mask = torch.rand(4, 32, generator=gen) > 0.2
    with stats_tracker.scope("ppo_actor"):
        stats_tracker.denominator(n_valid_tokens=mask, n_seqs=torch.ones(4, dtype=torch.bool))
        stats_tracker.stat(
            advantages=torch.randn(4, 32, generator=gen), denominator="n_valid_tokens"
        )
        stats_tracker.stat(
            importance_weight=1 + 0.05 * torch.randn(4, 32, generator=gen),
            denominator="n_valid_tokens",
        )
        stats_tracker.scalar(
            lr=1e-6 * (1 + step / 10), grad_norm=float(torch.rand(1, generator=gen))
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--step-seconds", type=float, default=0.3)
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "run.yaml"
        cfg.write_text(
            "stats_logger:\n  experiment_name: example\n  trial_name: trainer_loop\n"
            f"  fileroot: {tmp}\n  tensorboard: {{path: null}}\n  console: {{enabled: false}}\n"
        )
        with ControllerProcess(str(cfg), seal_timeout=5.0) as ctrl:
            seconds = args.steps * args.step_seconds + 0.2
            ready = Path(tmp) / "worker.ready"
            worker = subprocess.Popen(
                [sys.executable, str(HERE / "rollout_worker.py"), "--data", ctrl.data,
                 "--control", ctrl.control, "--worker-id", "rollout-0",
                 "--seconds", str(seconds), "--ready-file", str(ready)],
                env=child_env(),
            )  # fmt: skip
            try:
                while not ready.exists():  # start training once the worker streams
                    if worker.poll() is not None:
                        raise SystemExit(f"the rollout worker exited with {worker.returncode}")
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        worker.wait(0.02)
                with TrainStream(data=ctrl.data) as train:
                    for step in range(1, args.steps + 1):
                        time.sleep(args.step_seconds)  # the PPO update's compute
                        ppo_step(step, gen)
                        train.commit(step, epoch=0, epoch_step=step)
                worker.wait(seconds + 60)
            finally:
                if worker.poll() is None:
                    worker.kill()
                    worker.wait(10)
        for line in next(Path(tmp).glob("logs/*/*/*/stats.jsonl")).read_text().splitlines():
            rec = json.loads(line)
            s = rec["stats"]
            if "ppo_actor/lr" not in s:
                print(f"step {rec['global_step']} (held at shutdown): {s['bus/events']} events")
                continue
            print(
                f"step {rec['global_step']}: adv/avg {s.get('ppo_actor/advantages/avg', 0):+.3f} "
                f"lr {s.get('ppo_actor/lr', 0):.2e} | rollout reward "
                f"{s.get('rollout/reward', float('nan')):.3f} over {s['bus/events']} events, "
                f"seal {s['bus/seal_latency_ms']:.1f} ms, missing {s['bus/missing_workers']}"
            )


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C: the with/finally blocks above stopped the children
        sys.exit(130)

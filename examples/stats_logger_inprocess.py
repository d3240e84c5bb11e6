"""In-process logging as in AReaL: record, export, ``StatsLogger.commit`` each step.

    python examples/stats_logger_inprocess.py [--fileroot DIR] [--steps N]

A single-process trainer: no controller, no ZMQ. Rollout metrics recorded in this
process land in the same export as the training metrics (``export_all``).
"""

from __future__ import annotations

import argparse
import random
import tempfile

import torch

from areal_stream import StatsLogger, stats_tracker, workflow_context
from areal_stream.config import load_config


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--fileroot", default=None, help="default: a temporary folder")
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    fileroot = args.fileroot or tempfile.mkdtemp(prefix="areal_stream_example_")
    config = load_config(
        {
            "stats_logger": {
                "experiment_name": "inprocess",
                "trial_name": "trial_0",
                "fileroot": fileroot,
                "wandb": {"mode": "disabled"},
                "console": {"enabled": False},
            }
        }
    )
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    with StatsLogger(config) as logger:
        for step in range(args.steps):
            for i in range(16):  # rollout: one scalar per finished episode
                workflow_context.set(workflow_context.WorkflowContext(is_eval=i % 8 == 0))
                tracker = stats_tracker.get(workflow_context.stat_scope())
                tracker.scalar(reward=float(rng.random() < 0.5))
            loss_mask = torch.rand(8, 64, generator=gen) > 0.3
            with stats_tracker.scope("ppo_actor"):  # training: masked tensor statistics
                stats_tracker.denominator(n_valid_tokens=loss_mask)
                stats_tracker.stat(
                    advantages=torch.randn(8, 64, generator=gen), denominator="n_valid_tokens"
                )
            with stats_tracker.record_timing("train_step"):
                pass
            stats = stats_tracker.export_all()
            logger.commit(epoch=0, step=step, global_step=step, data=stats)
            print(f"step {step}: rollout/reward={stats['rollout/reward']:.3f}")
    print(f"journal: {config.log_dir()}/stats.jsonl")


if __name__ == "__main__":
    main()

"""A training rank: a fake PPO update per step, recorded and reported to the controller.

Two of these run on a gloo group. Each step records what AReaL's PPO actor records
(``denominator``/``stat`` under ``ppo_actor``), the training diagnostics, ``train_perf``
with a registered FLOPs estimator and MoE expert balance, then ``TrainStream.commit``
all-reduces the step's statistics and rank 0 sends them.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from areal_stream import TrainStream, stats_tracker
from areal_stream.flops import get_flops_estimator, register_flops_estimator
from areal_stream.moe_metrics import MoEBalanceTracker
from areal_stream.train_perf import TrainPerfMeter
from areal_stream.training_metrics import (
    log_advantage_sign_fractions,
    log_train_infer_diagnostics,
    log_version_staleness,
)

# A small MoE model for the demo: the numbers only shape the FLOPs estimate.
DEMO_MODEL = {
    "model_type": "demo_moe",
    "active_parameters": 3_000_000_000,
    "num_attention_heads": 32,
    "head_dim": 128,
    "num_hidden_layers": 48,
}
N_LAYERS, N_EXPERTS, TOP_K = 4, 16, 4


def demo_flops_factory(config: Any) -> Any:
    """Training FLOPs of one sequence: 6 * active params * L + causal attention."""
    cfg = config if isinstance(config, dict) else vars(config)
    params, heads = cfg["active_parameters"], cfg["num_attention_heads"]
    head_dim, layers = cfg["head_dim"], cfg["num_hidden_layers"]

    def total_training_flops(sequence_length: int) -> float:
        linear = 6 * params * sequence_length
        attention = 6 * layers * heads * head_dim * sequence_length * (sequence_length + 1)
        return float(linear + attention)

    return total_training_flops


def fake_batch(
    gen: torch.Generator, step: int, batch: int = 16, seqlen: int = 256
) -> dict[str, Any]:
    """Random tensors shaped like a packed PPO batch (prompt + response + padding)."""
    prompt = torch.randint(16, 64, (batch,), generator=gen)
    resp = torch.randint(32, seqlen - 64, (batch,), generator=gen)
    pos = torch.arange(seqlen).expand(batch, seqlen)
    attention_mask = pos < (prompt + resp)[:, None]
    loss_mask = attention_mask & (pos >= prompt[:, None])
    rollout_logp = -torch.rand(batch, seqlen, generator=gen) * 2
    drift = 0.05 * torch.randn(batch, seqlen, generator=gen)
    rewards = (torch.rand(batch, generator=gen) < min(0.9, 0.2 + 0.05 * step)).float()
    advantages = (rewards - rewards.mean())[:, None].expand(batch, seqlen).contiguous()
    lag = torch.randint(0, 3, (batch, 1), generator=gen)
    versions = torch.where(loss_mask, step - lag, torch.full_like(lag, -1)).long()
    return {
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "rollout_logp": rollout_logp,
        "trainer_logp": rollout_logp + drift,
        "rewards": rewards,
        "advantages": advantages,
        "versions": versions,
        "seqlens": attention_mask.sum(1).float(),
    }


def ppo_update(data: dict[str, Any], step: int) -> None:
    """Record what a PPO actor records for one update."""
    loss_mask = data["loss_mask"]
    with stats_tracker.scope("ppo_actor"):
        stats_tracker.denominator(
            n_seqs=torch.ones_like(data["rewards"], dtype=torch.bool), n_valid_tokens=loss_mask
        )
        stats_tracker.stat(advantages=data["advantages"], denominator="n_valid_tokens")
        stats_tracker.stat(
            task_reward=data["rewards"], seq_len=data["seqlens"], denominator="n_seqs"
        )
        log_train_infer_diagnostics(data["trainer_logp"], data["rollout_logp"], loss_mask)
        log_advantage_sign_fractions(data["advantages"], loss_mask)
        with stats_tracker.scope("update"):
            stats_tracker.denominator(n_valid_tokens=loss_mask)
            ratio = torch.exp(data["trainer_logp"] - data["rollout_logp"])
            loss = -(ratio * data["advantages"])
            stats_tracker.stat(loss=loss, importance_weight=ratio, denominator="n_valid_tokens")
            log_version_staleness(data["versions"], loss_mask, current_version=step)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m areal_stream.demo._trainer")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--store", required=True, help="file path for the gloo rendezvous")
    p.add_argument("--data", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--step-seconds", type=float, default=0.5)
    args = p.parse_args(argv)

    dist.init_process_group(
        "gloo", init_method=f"file://{args.store}", rank=args.rank, world_size=args.world
    )
    register_flops_estimator("demo_moe", demo_flops_factory)
    meter = TrainPerfMeter(get_flops_estimator(DEMO_MODEL))
    moe = MoEBalanceTracker()
    gen = torch.Generator().manual_seed(1000 + args.rank)
    train = TrainStream(data=args.data, group=dist.group.WORLD)
    try:
        for step in range(args.steps):
            t0 = time.monotonic()
            data = fake_batch(gen, step)
            with meter.measure(data["attention_mask"]):
                ppo_update(data, step)
                tokens = int(data["attention_mask"].sum())
                for layer in range(N_LAYERS):
                    # Skewed routing: low expert ids are hot, more so in deeper layers.
                    w = torch.linspace(1.0 + layer, 1.0, N_EXPERTS)
                    ids = torch.multinomial(w.expand(tokens, -1), TOP_K, generator=gen)
                    moe.record(layer, expert_ids=ids, num_experts=N_EXPERTS)
                time.sleep(max(0.0, args.step_seconds - (time.monotonic() - t0)))
            stats_tracker.scalar(
                learning_rate=1e-6 * (1 + step) ** -0.5, grad_norm=1.0 / (1 + step)
            )
            extra = meter.export(dp_group=dist.group.WORLD, group=dist.group.WORLD)
            extra.update(moe.export(reduce_group=dist.group.WORLD))
            train.commit(step, epoch=0, epoch_step=step, extra=extra)
    finally:
        train.close()
        dist.destroy_process_group()


def _stop_now(signum: int, frame: Any) -> None:
    """Stopped by the demo: exit at once, quietly (the peer rank may be mid-collective)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(128 + signum)


if __name__ == "__main__":
    for _sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(_sig, _stop_now)
    main()
    # Skip C++ static destructors: torch's gloo threads sometimes abort an exiting
    # interpreter ("terminate called without an active exception") after a clean run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

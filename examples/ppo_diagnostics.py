"""PPO update with the training diagnostics, exported across 2 gloo ranks.

    python examples/ppo_diagnostics.py

Each rank holds a tiny bigram "language model", samples a padded batch of responses from
a slightly older behaviour policy (the rollout engine, whose logprobs carry a little
numerical noise), then runs a PPO update the way AReaL's actor does:

1. recompute the proximal logprobs and compare them with the rollout's
   (``log_train_infer_diagnostics``, before PPO overwrites the rollout logprobs);
2. ``log_advantage_sign_fractions`` on the shaped advantages and loss mask;
3. inside ``scope("update")``, ``log_version_staleness`` once per update;
4. a few clipped-objective minibatch steps.

Everything records into the default stats tracker; one ``export`` per training step
all-reduces over the gloo group, and rank 0 prints the diagnostics of each step.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

try:
    import areal_stream  # noqa: F401
except ModuleNotFoundError:  # running from a checkout without an installed package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from areal_stream import stats_tracker
from areal_stream.training_metrics import (
    log_advantage_sign_fractions,
    log_train_infer_diagnostics,
    log_version_staleness,
)

VOCAB, BATCH, SEQ, PROMPT = 32, 8, 24, 4
STEPS, MINIBATCHES, CLIP = 2, 2, 0.2


def sample_batch(
    behaviour: torch.nn.Embedding, gen: torch.Generator, version: int
) -> dict[str, torch.Tensor]:
    """Right-padded rollouts; tensors in prediction positions except ``versions``."""
    tokens = torch.zeros(BATCH, SEQ, dtype=torch.long)
    tokens[:, :PROMPT] = torch.randint(0, VOCAB, (BATCH, PROMPT), generator=gen)
    lengths = torch.randint(PROMPT + 2, SEQ + 1, (BATCH,), generator=gen)
    rollout_logp = torch.zeros(BATCH, SEQ)
    with torch.no_grad():
        for j in range(PROMPT - 1, SEQ - 1):
            logp = torch.log_softmax(behaviour(tokens[:, j]), dim=-1)
            nxt = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(1)
            tokens[:, j + 1] = nxt
            # engine numerics: the returned logprob differs a little from the exact one
            noise = 0.02 * torch.randn(BATCH, generator=gen)
            rollout_logp[:, j] = logp.gather(1, nxt[:, None]).squeeze(1) + noise
    pos = torch.arange(SEQ)[None, :]
    generated = (pos >= PROMPT) & (pos < lengths[:, None])  # token positions
    loss_mask = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    loss_mask[:, :-1] = generated[:, 1:]  # prediction j predicts token j + 1
    # Behaviour version per generated token: partial rollouts mix checkpoints.
    lag = torch.randint(0, 3, (BATCH, SEQ), generator=gen)
    versions = torch.where(generated, (version - lag).clamp(min=0), -1)
    reward = torch.rand(BATCH, generator=gen).round()  # 0/1 task success
    adv = (reward - reward.mean())[:, None].expand(BATCH, SEQ).contiguous()
    return {
        "tokens": tokens,
        "rollout_logp": torch.where(loss_mask, rollout_logp, 0.0),
        "loss_mask": loss_mask,
        "versions": versions,
        "advantages": torch.where(loss_mask, adv, 0.0),
    }


def token_logp(model: torch.nn.Embedding, tokens: torch.Tensor) -> torch.Tensor:
    """Log-probability of token j + 1 at prediction position j (last position 0)."""
    logp = torch.log_softmax(model(tokens[:, :-1]), dim=-1)
    picked = logp.gather(2, tokens[:, 1:, None]).squeeze(2)
    return torch.nn.functional.pad(picked, (0, 1))


def ppo_update(
    model: torch.nn.Embedding,
    opt: torch.optim.Optimizer,
    batch: dict[str, torch.Tensor],
    current_version: int,
) -> None:
    mask = batch["loss_mask"]
    with stats_tracker.scope("ppo_actor"):
        with torch.no_grad():
            proximal_logp = token_logp(model, batch["tokens"])
        # Before the rollout logprobs are replaced by the recomputed ones.
        log_train_infer_diagnostics(proximal_logp, batch["rollout_logp"], mask)
        log_advantage_sign_fractions(batch["advantages"], mask)
        old_logp = proximal_logp
        with stats_tracker.scope("update"):
            log_version_staleness(batch["versions"], mask, current_version)
            for rows in torch.arange(BATCH).chunk(MINIBATCHES):
                m = mask[rows]
                logp = token_logp(model, batch["tokens"][rows])
                ratio = torch.exp(logp - old_logp[rows])
                adv = batch["advantages"][rows]
                clipped = torch.clamp(ratio, 1 - CLIP, 1 + CLIP)
                loss = -torch.where(m, torch.minimum(ratio * adv, clipped * adv), 0.0)
                loss = loss.sum() / m.sum().clamp(min=1)
                opt.zero_grad()
                loss.backward()
                opt.step()
                stats_tracker.denominator(n_valid_tokens=m)
                stats_tracker.stat("n_valid_tokens", importance_weight=ratio.detach())


def run_rank(rank: int, world: int, store: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)  # same initial weights on every rank
        model = torch.nn.Embedding(VOCAB, VOCAB)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        behaviour = torch.nn.Embedding(VOCAB, VOCAB)
        gen = torch.Generator().manual_seed(1000 + rank)  # different data per rank
        for step in range(1, STEPS + 1):
            with torch.no_grad():  # the rollout engine lags the trainer a little
                behaviour.weight.copy_(model.weight + 0.05 * torch.randn_like(model.weight))
            batch = sample_batch(behaviour, gen, version=step)
            ppo_update(model, opt, batch, current_version=step)
            for p in model.parameters():  # data-parallel gradient sync stand-in
                dist.all_reduce(p.data)
                p.data /= world
            stats = stats_tracker.export(reduce_group=dist.group.WORLD)
            if rank == 0:
                print(f"--- step {step} ({len(stats)} keys, pooled over {world} ranks)")
                for key in sorted(stats):
                    print(f"{key:58s} {float(stats[key]): .6g}")
    finally:
        dist.destroy_process_group()
    # Leave without C++ static destructors: torch's gloo threads sometimes abort an
    # exiting interpreter ("terminate called without an active exception").
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(run_rank, args=(world, os.path.join(tmp, "store")), nprocs=world, join=True)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C: the with/finally blocks above stopped the children
        sys.exit(130)

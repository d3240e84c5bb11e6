"""train_perf and moe_balance overheads, each against a same-run baseline (medians).

- MoE router hooks: a tiny Qwen3-MoE training step (forward + backward) with the hooks
  installed vs without (ratio of medians; interleaved runs);
- ``MoEBalanceTracker.record`` on one router output ([4096, 8] ids, 128 experts) vs a bare
  ``torch.bincount`` of the same ids;
- 48 ``record(counts=...)`` calls + ``export`` for 48 layers x 128 experts (Qwen3-30B-A3B's
  layout) vs bare in-place adds into 48 buffers + ``torch.cat(...).tolist()``;
- ``TrainPerfMeter.measure`` around an empty block (64-row mask) vs the bare work it must do
  (a ``perf_counter`` pair and the mask's row sums), and a window of 16 batches x 64
  sequences exported with the Qwen3-30B-A3B estimator vs without an estimator.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(os.path.dirname(HERE), "tests", "data")


def _median_us(fn: Callable[[], Any], reps: int, rounds: int = 7) -> float:
    """Median over ``rounds`` of the mean time per call of ``reps`` calls, in microseconds."""
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        out.append((time.perf_counter() - t0) / reps * 1e6)
    return statistics.median(out)


def _hook_overhead() -> tuple[float, float]:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from areal_stream.moe_metrics import MoEBalanceTracker, install_moe_hooks

    kwargs: dict[str, Any] = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=16,
        num_experts_per_tok=4,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**kwargs))
    model.train()
    ids = torch.randint(0, 256, (4, 64))
    tracker = MoEBalanceTracker()

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()

    for _ in range(3):
        step()
    plain, hooked = [], []
    for _ in range(9):
        t0 = time.perf_counter()
        step()
        plain.append(time.perf_counter() - t0)
        hooks = install_moe_hooks(model, tracker)
        t0 = time.perf_counter()
        step()
        hooked.append(time.perf_counter() - t0)
        hooks.remove()
    return statistics.median(plain) * 1e3, statistics.median(hooked) * 1e3


def run() -> str:
    from areal_stream.flops import get_flops_estimator
    from areal_stream.moe_metrics import MoEBalanceTracker
    from areal_stream.train_perf import TrainPerfMeter

    torch.set_num_threads(1)
    rows: list[tuple[str, str, str, str]] = []

    plain_ms, hooked_ms = _hook_overhead()
    rows.append(
        (
            "tiny Qwen3-MoE train step, hooks vs none",
            f"{hooked_ms:.2f} ms",
            f"{plain_ms:.2f} ms",
            f"{hooked_ms / plain_ms:.3f}",
        )
    )

    ids = torch.randint(0, 128, (4096, 8))
    tracker = MoEBalanceTracker()
    rec = _median_us(lambda: tracker.record(3, expert_ids=ids, num_experts=128), 200)
    base = _median_us(lambda: torch.bincount(ids.reshape(-1), minlength=128), 200)
    rows.append(
        ("record [4096, 8] ids, E=128", f"{rec:.1f} us", f"{base:.1f} us", f"{rec / base:.2f}")
    )

    counts = [torch.randint(0, 100, (128,)).double() for _ in range(48)]
    accs = [torch.zeros(129, dtype=torch.float64) for _ in range(48)]

    def fill_and_export() -> None:
        for layer, c in enumerate(counts):
            tracker.record(layer, counts=c)
        tracker.export()

    def bare_fill_and_copy() -> None:
        for acc, c in zip(accs, counts, strict=True):
            acc[:128] += c
        torch.cat(accs).tolist()

    tracker.reset()
    exp = _median_us(fill_and_export, 20)
    cat = _median_us(bare_fill_and_copy, 20)
    rows.append(
        (
            "48 layers x 128 experts: 48 records + export",
            f"{exp:.0f} us",
            f"{cat:.0f} us",
            f"{exp / cat:.2f}",
        )
    )

    meter = TrainPerfMeter(device="cpu")
    mask = torch.ones(64, 512, dtype=torch.bool)
    kept: list[torch.Tensor] = []

    def measured() -> None:
        with meter.measure(mask):
            pass

    def bare() -> None:
        t0 = time.perf_counter()
        kept.append((mask != 0).sum(dim=1))
        (time.perf_counter() - t0)

    m = _median_us(measured, 500)
    b = _median_us(bare, 500)
    meter.export()
    kept.clear()
    rows.append(
        (
            "measure() around an empty block, [64, 512] mask",
            f"{m:.1f} us",
            f"{b:.1f} us",
            f"{m / b:.2f}",
        )
    )

    with open(os.path.join(DATA, "qwen3_30b_a3b_config.json")) as f:
        est = get_flops_estimator(json.load(f))
    gen = torch.Generator().manual_seed(0)
    masks = [
        torch.rand(64, 2048, generator=gen) < torch.rand(64, 1, generator=gen) for _ in range(16)
    ]
    flops_meter = TrainPerfMeter(est, device="cpu")

    def window() -> None:
        for mk in masks:
            with flops_meter.measure(mk):
                pass
        flops_meter.export()

    def window_no_flops() -> None:
        for mk in masks:
            with meter.measure(mk):
                pass
        meter.export()

    w = _median_us(window, 3, rounds=5)
    wb = _median_us(window_no_flops, 3, rounds=5)
    rows.append(
        (
            "window: 16 x [64, 2048] masks, export with vs without FLOPs",
            f"{w / 1e3:.2f} ms",
            f"{wb / 1e3:.2f} ms",
            f"{w / wb:.2f}",
        )
    )

    lines = [
        "## train_perf and moe_balance",
        "",
        "Single thread, CPU. Ratio = measured / baseline (medians).",
        "",
        "| case | measured | baseline | ratio |",
        "| --- | --- | --- | --- |",
        *[f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows],
        "",
    ]
    report = "\n".join(lines)
    print(report)
    return report


if __name__ == "__main__":
    run()

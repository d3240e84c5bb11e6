"""TrainPerfMeter: every train_perf key against values computed here, on real gloo ranks."""

from __future__ import annotations

import math
import time
from typing import Any, ClassVar

import pytest
import torch
from _dist import run_ranks

from areal_stream.flops import get_flops_estimator
from areal_stream.train_perf import TrainPerfMeter

P = "train_perf/"
BASE_KEYS = {P + k for k in ("tokens", "seconds", "total_tokens", "total_seconds")}
RATE_KEYS = {P + "tokens_per_second", P + "cumulative_tokens_per_second"}
FLOPS_KEYS = {
    P + "estimated_flops",
    P + "estimated_flops_per_second",
    P + "cumulative_estimated_flops_per_second",
}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def toy(length: int) -> float:
    return float(10 * length + length * length)


class Counting:
    """An estimator that counts its calls (to check per-length caching)."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, length: int) -> float:
        self.calls.append(length)
        return toy(length)


def work(seconds: float, device: str = "cpu") -> None:
    """The training step stand-in: keep the clock's device busy for about ``seconds``."""
    if device == "cuda":
        torch.cuda._sleep(int(seconds * 1e9))  # ~1 cycle/ns: rough GPU-side work
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def mask(rows: list[list[int]], device: str = "cpu", dtype: torch.dtype = torch.bool) -> Any:
    return torch.tensor(rows, device=device).to(dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_window_keys_against_direct_computation(device: str) -> None:
    est = Counting()
    meter = TrainPerfMeter(est, device=device)
    m1 = mask([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], device)  # 3, 2, (empty row)
    m2 = mask([[0, 1, 1, 1], [1, 1, 1, 1]], device, torch.int64)  # 3 (left-padded), 4
    t0 = time.perf_counter()
    with meter.measure(m1):
        work(0.02, device)
    with meter.measure(m2):
        work(0.01, device)
    out = meter.export()
    if device == "cuda":
        torch.cuda.synchronize()
    outer = time.perf_counter() - t0
    assert set(out) == BASE_KEYS | RATE_KEYS | FLOPS_KEYS
    assert out[P + "tokens"] == 12
    flops = toy(3) + toy(2) + toy(3) + toy(4)
    assert out[P + "estimated_flops"] == flops
    assert sorted(est.calls) == [2, 3, 4]  # each length estimated once; empty row skipped
    s = out[P + "seconds"]
    assert 0.0 < s <= outer
    if device == "cpu":
        assert s >= 0.03
    assert out[P + "tokens_per_second"] == 12 / s
    assert out[P + "estimated_flops_per_second"] == flops / s
    assert out[P + "total_tokens"] == 12
    assert out[P + "total_seconds"] == s
    assert out[P + "cumulative_tokens_per_second"] == 12 / s
    assert out[P + "cumulative_estimated_flops_per_second"] == flops / s

    # Second window: one batch; totals accumulate, the window restarts.
    with meter.measure(mask([[1, 1, 1, 1, 1]], device)):
        work(0.01, device)
    out2 = meter.export()
    s2 = out2[P + "seconds"]
    assert out2[P + "tokens"] == 5 and out2[P + "estimated_flops"] == toy(5)
    assert out2[P + "total_tokens"] == 17
    assert out2[P + "total_seconds"] == pytest.approx(s + s2, rel=1e-12)
    assert out2[P + "cumulative_tokens_per_second"] == 17 / out2[P + "total_seconds"]
    assert out2[P + "cumulative_estimated_flops_per_second"] == (
        (flops + toy(5)) / out2[P + "total_seconds"]
    )

    # An empty window: zeros, no window rates, the totals stay.
    out3 = meter.export()
    assert out3[P + "tokens"] == 0 and out3[P + "seconds"] == 0.0
    assert out3[P + "estimated_flops"] == 0.0
    assert P + "tokens_per_second" not in out3 and P + "estimated_flops_per_second" not in out3
    assert out3[P + "total_tokens"] == 17
    assert out3[P + "cumulative_tokens_per_second"] == 17 / out3[P + "total_seconds"]


def test_without_estimator_only_tokens_and_time() -> None:
    meter = TrainPerfMeter(device="cpu")
    assert not meter.has_flops
    with meter.measure(mask([[1, 0], [1, 1]])):
        work(0.001)
    out = meter.export()
    assert set(out) == BASE_KEYS | RATE_KEYS
    assert out[P + "tokens"] == 3


def test_packed_batches_sum_per_sequence_estimates() -> None:
    cfg = {
        "model_type": "qwen3_moe",
        "hidden_size": 8,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 4,
        "vocab_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 6,
    }
    f = get_flops_estimator(cfg)
    assert f is not None
    meter = TrainPerfMeter(f, device="cpu")
    with meter.measure(cu_seqlens=torch.tensor([0, 3, 3, 10], dtype=torch.int32)):
        pass
    out = meter.export()
    assert out[P + "tokens"] == 10
    assert out[P + "estimated_flops"] == f(3) + f(7)
    assert out[P + "estimated_flops"] < f(10)  # not the total length in one call


def test_failed_block_counts_nothing_and_blocks_do_not_nest() -> None:
    meter = TrainPerfMeter(toy, device="cpu")
    with pytest.raises(KeyError), meter.measure(mask([[1, 1]])):
        raise KeyError("step failed")
    with (
        meter.measure(mask([[1]])),
        pytest.raises(RuntimeError, match="nest"),
        meter.measure(mask([[1]])),
    ):
        pass
    out = meter.export()
    assert out[P + "tokens"] == 1


def test_bad_inputs_are_refused_at_the_boundary() -> None:
    meter = TrainPerfMeter(device="cpu")
    with pytest.raises(TypeError, match="bool or integer"):
        meter.measure(torch.ones(2, 3)).__enter__()
    with pytest.raises(ValueError, match="2-D"):
        meter.measure(torch.ones(3, dtype=torch.bool)).__enter__()
    with pytest.raises(ValueError, match="2-D"):
        meter.measure(torch.ones(1, 2, 3, dtype=torch.bool)).__enter__()
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        meter.measure([[1, 1]]).__enter__()  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="exactly one"):
        meter.measure().__enter__()
    with pytest.raises(TypeError, match="exactly one"):
        meter.measure(mask([[1]]), cu_seqlens=torch.tensor([0, 1])).__enter__()
    with pytest.raises(TypeError, match="integer"):
        meter.measure(cu_seqlens=torch.tensor([0.0, 2.0])).__enter__()
    with pytest.raises(TypeError, match="callable"):
        TrainPerfMeter(3)  # type: ignore[arg-type]
    assert meter.export()[P + "tokens"] == 0  # nothing was counted


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0])
def test_bad_estimates_are_errors(bad: float) -> None:
    meter = TrainPerfMeter(lambda n: bad if n == 3 else toy(n), device="cpu")
    with meter.measure(mask([[1, 1, 1], [1, 0, 0]])):
        pass
    with pytest.raises(ValueError, match="sequence length 3"):
        meter.export()
    with meter.measure(mask([[1, 1]])):  # the bad window was discarded
        pass
    out = meter.export()
    assert out[P + "tokens"] == 2 and out[P + "estimated_flops"] == toy(2)


def test_decreasing_cu_seqlens_is_an_error_at_export() -> None:
    meter = TrainPerfMeter(device="cpu")
    with meter.measure(cu_seqlens=torch.tensor([0, 5, 2])):
        pass
    with pytest.raises(ValueError, match="non-decreasing"):
        meter.export()


# ---------------------------------------------------------------- 2 gloo ranks


def _ranks(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    res: dict[str, Any] = {}
    singles = [dist.new_group([r]) for r in range(world)]
    own = singles[rank]

    # 1) DP over both ranks: tokens and FLOPs summed, time = the slower rank's.
    meter = TrainPerfMeter(toy, device="cpu")
    rows = [[1, 1, 1, 0]] if rank == 0 else [[1, 1, 0, 0], [1, 1, 1, 1]]
    with meter.measure(mask(rows)):
        work(0.08 if rank == 1 else 0.0)
    res["dp"] = meter.export(dp_group=dist.group.WORLD, group=dist.group.WORLD)

    # 2) Time windows dominated by different ranks: total_seconds is the max of each
    #    rank's cumulative time, not the sum of window maxima.
    with meter.measure(mask(rows)):
        work(0.08 if rank == 0 else 0.0)
    res["dp2"] = meter.export(dp_group=dist.group.WORLD, group=dist.group.WORLD)

    # 3) Both ranks hold the same data (TP peers): DP group of one, time over both.
    tp = TrainPerfMeter(device="cpu")
    with tp.measure(mask([[1, 1, 1]])):
        work(0.02 if rank == 0 else 0.0)
    res["tp"] = tp.export(dp_group=own, group=dist.group.WORLD)

    # 4) A bad estimate on rank 1 only: both ranks raise, none hangs.
    bad = TrainPerfMeter(lambda n: math.nan if rank == 1 else 1.0, device="cpu")
    with bad.measure(mask([[1]])):
        pass
    try:
        bad.export(dp_group=own, group=dist.group.WORLD)
        res["error"] = None
    except ValueError as exc:
        res["error"] = str(exc)
    # The meter still works afterwards (a further collective round trip).
    with bad.measure(mask([[1, 1]])):
        pass
    res["after_error_tokens"] = TrainPerfMeter(device="cpu").export(dp_group=dist.group.WORLD)[
        P + "tokens"
    ]
    return res


def test_two_ranks() -> None:
    r0, r1 = run_ranks(_ranks, 2)
    for key in ("dp", "dp2", "tp"):
        assert r0[key] == r1[key], key  # every rank gets the same numbers
    dp = r0["dp"]
    assert dp[P + "tokens"] == 3 + 2 + 4
    assert dp[P + "estimated_flops"] == toy(3) + toy(2) + toy(4)
    assert dp[P + "seconds"] >= 0.08  # rank 1's time, not rank 0's ~0
    assert dp[P + "tokens_per_second"] == 9 / dp[P + "seconds"]
    dp2 = r0["dp2"]
    assert dp2[P + "total_tokens"] == 18
    assert dp2[P + "seconds"] >= 0.08
    total = dp2[P + "total_seconds"]
    assert max(dp[P + "seconds"], dp2[P + "seconds"]) <= total
    assert total < dp[P + "seconds"] + dp2[P + "seconds"] - 0.05
    assert dp2[P + "cumulative_estimated_flops_per_second"] == 2 * dp[P + "estimated_flops"] / total
    assert r0["tp"][P + "tokens"] == 3  # not 6: the DP group is one rank
    assert r0["tp"][P + "seconds"] >= 0.02  # time is still the max over both ranks
    assert r1["error"] is not None and "sequence length 1" in r1["error"]
    assert r0["error"] is not None and "another rank" in r0["error"]
    assert r0["after_error_tokens"] == 0


class FakeEvent:
    """Stands in for ``torch.cuda.Event`` (no GPU here): checks the CUDA branch's protocol."""

    log: ClassVar[list[tuple[str, Any]]] = []

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.t: float | None = None

    def record(self, stream: Any) -> None:
        self.t = time.perf_counter()
        FakeEvent.log.append(("record", stream))

    def synchronize(self) -> None:
        FakeEvent.log.append(("synchronize", None))

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.t is not None and end.t is not None
        return (end.t - self.t) * 1000.0  # milliseconds, like CUDA


def test_cuda_branch_records_on_the_entry_stream_and_syncs_only_at_export(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    streams = iter(["stream-A", "stream-B"])
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: next(streams))
    FakeEvent.log = []
    meter = TrainPerfMeter(toy, device="cuda")
    t0 = time.perf_counter()
    with meter.measure(mask([[1, 1, 0]])):
        work(0.01)
    with meter.measure(mask([[1, 1, 1], [1, 0, 0]])):
        work(0.01)
    outer = time.perf_counter() - t0
    # Start and end on the stream current at entry; nothing waits inside measure().
    assert FakeEvent.log == [("record", "stream-A")] * 2 + [("record", "stream-B")] * 2
    out = meter.export()
    assert [e for e, _ in FakeEvent.log[4:]] == ["synchronize", "synchronize"]
    assert 0.02 <= out[P + "seconds"] <= outer
    assert out[P + "tokens"] == 6 and out[P + "estimated_flops"] == toy(2) + toy(3) + toy(1)

"""Cost of the training diagnostics on a [64, 8192] batch, and memory held until export.

Time: median wall time per call (after a warm-up) of each diagnostic, recording into the
real default tracker, against a same-run baseline: one plain float64 masked mean of
``trainer_logp - rollout_logp`` (the least a logger of this batch could compute). The
export of a window of such batches is timed separately.

Memory: the diagnostics must keep O(keys) numbers per batch, not per-token tensors. We
count the bytes of every live ``torch.Tensor`` storage reachable by the garbage collector
(``gc.get_objects()``, storages deduplicated by data pointer) before recording and after
recording N batches without exporting; the difference is what the tracker retains for
the window (the bench's own inputs are alive in both counts, so they cancel). tracemalloc
cannot see torch's CPU allocator and RSS deltas are dominated by allocator caching, so
the live-tensor count is the precise measure here. For contrast, the table also gives what
keeping each recorded per-token float64 tensor (plus its bool denominator) would retain.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

try:
    import areal_stream  # noqa: F401
except ModuleNotFoundError:  # pragma: no cover - running from a bare checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from areal_stream import _training_diag as _impl
from areal_stream import stats_tracker
from areal_stream.training_metrics import (
    log_advantage_sign_fractions,
    log_train_infer_diagnostics,
    log_version_staleness,
)

ROWS, COLS = 64, 8192
REPEATS = 7
WINDOW = 8  # batches recorded before one export (memory and export timing)
# Per-token tensors each diagnostic hands to the tracker (float64 values, bool denominators).
RECORDED = {"train_infer": (15, 2), "advantage": (3, 1), "staleness": (8, 1)}


class _NoTracker:
    """Accepts the calls the diagnostics make and does nothing (cost split only)."""

    @staticmethod
    @contextlib.contextmanager
    def scope(name: str) -> Iterator[None]:
        yield

    @staticmethod
    def denominator(**kw: torch.Tensor) -> None:
        pass

    @staticmethod
    def stat_compact(denominator: str, reduce_type: object = None, **kw: torch.Tensor) -> None:
        pass


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(COLS // 4, COLS + 1, (ROWS,), generator=gen)
    mask = torch.arange(COLS)[None, :] < lengths[:, None]
    t = -torch.rand(ROWS, COLS, generator=gen) * 5
    r = t + 0.05 * torch.randn(ROWS, COLS, generator=gen)
    versions = torch.randint(0, 10, (ROWS, COLS), generator=gen)
    versions[:, :32] = -1
    return {
        "trainer_logp": t,
        "rollout_logp": r,
        "mask": mask,
        "advantages": torch.randn(ROWS, COLS, generator=gen),
        "versions": versions,
    }


def _interleaved_medians_ms(
    cases: list[tuple[str, Callable[[], object]]], repeats: int = REPEATS
) -> dict[str, float]:
    """Median ms per case; cases run round-robin so machine load hits them alike."""
    for _, fn in cases:  # warm-up (first-touch allocations)
        fn()
    stats_tracker.export()
    times: dict[str, list[float]] = {name: [] for name, _ in cases}
    for _ in range(repeats):
        for name, fn in cases:
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        stats_tracker.export()
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def _live_storages() -> dict[int, int]:
    """Data pointer -> bytes of every live tensor storage the garbage collector can see."""
    gc.collect()
    seen: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance() pokes deprecated torch.distributed names
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and obj.device.type != "meta":
                storage = obj.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
    return seen


def _new_bytes(before: dict[int, int], after: dict[int, int]) -> int:
    return sum(n for ptr, n in after.items() if ptr not in before)


def _mask_bytes(before: dict[int, int]) -> int:
    """New storages among the masks the tracker keeps for later ``stat()`` calls by name."""
    masks = getattr(stats_tracker.DEFAULT_TRACKER, "_denoms", {})
    ptrs = {m.untyped_storage().data_ptr(): m.untyped_storage().nbytes() for m in masks.values()}
    return sum(n for ptr, n in ptrs.items() if ptr not in before)


def run() -> str:
    b = _batch()
    t, r, m = b["trainer_logp"], b["rollout_logp"], b["mask"]
    a, v = b["advantages"], b["versions"]
    stats_tracker.export()  # start from an empty window

    def baseline() -> torch.Tensor:
        d = torch.where(m, t.double() - r.double(), 0.0)
        return d.sum() / m.sum()

    def train_infer() -> None:
        with stats_tracker.scope("ppo_actor"):
            log_train_infer_diagnostics(t, r, m)

    def advantage() -> None:
        with stats_tracker.scope("ppo_actor"):
            log_advantage_sign_fractions(a, m)

    def staleness() -> None:
        with stats_tracker.scope("ppo_actor"), stats_tracker.scope("update"):
            log_version_staleness(v, m, 10)

    def all_three() -> None:
        train_infer()
        advantage()
        staleness()

    cases: list[tuple[str, Callable[[], object]]] = [
        ("baseline: float64 masked mean of d", baseline),
        ("log_train_infer_diagnostics", train_infer),
        ("log_advantage_sign_fractions", advantage),
        ("log_version_staleness", staleness),
        ("all three", all_three),
    ]
    timings = _interleaved_medians_ms(cases)
    # Split the cost: the same three calls with the tracker replaced by a no-op, i.e. the
    # diagnostics' own per-token arithmetic without the tracker's folding.
    real_tracker = _impl.stats_tracker
    _impl.stats_tracker = _NoTracker()  # type: ignore[assignment]
    try:
        stub_name = "all three, tracker calls stubbed out"
        timings.update(_interleaved_medians_ms([(stub_name, all_three)]))
    finally:
        _impl.stats_tracker = real_tracker
    cases.append((stub_name, all_three))
    base = timings[cases[0][0]]

    def window_export() -> None:
        for _ in range(WINDOW):
            all_three()
        t0 = time.perf_counter()
        stats_tracker.export()
        export_times.append(time.perf_counter() - t0)

    export_times: list[float] = []
    for _ in range(3):
        window_export()
    export_ms = statistics.median(export_times) * 1e3

    # Memory retained until export.
    stats_tracker.export()
    before = _live_storages()
    all_three()
    after_one = _live_storages()
    masks_one = _mask_bytes(before)
    for _ in range(WINDOW - 1):
        all_three()
    after_window = _live_storages()
    n_keys = len(stats_tracker.export())
    after_export = _live_storages()
    one, window = _new_bytes(before, after_one), _new_bytes(before, after_window)
    full_tensors = sum(
        n_val * ROWS * COLS * 8 + n_den * ROWS * COLS for n_val, n_den in RECORDED.values()
    )

    lines = [
        f"## Training diagnostics ([{ROWS}, {COLS}] float32 batch, "
        f"{torch.get_num_threads()} CPU threads)",
        "",
        "| case | median ms | x baseline |",
        "|---|---:|---:|",
    ]
    for name, _ in cases:
        lines.append(f"| {name} | {timings[name]:.2f} | {timings[name] / base:.1f} |")
    lines += [
        f"| export of a {WINDOW}-batch window ({n_keys} keys) | {export_ms:.2f} | "
        f"{export_ms / base:.1f} |",
        "",
        "| memory held until export (live tensor storages) | bytes |",
        "|---|---:|",
        f"| after 1 batch of all three | {one} |",
        f"| - of which the latest denominator masks (kept by the tracker) | {masks_one} |",
        f"| - of which per-key records | {one - masks_one} |",
        f"| after {WINDOW} batches | {window} |",
        f"| growth per further batch | {(window - one) / (WINDOW - 1):.0f} |",
        f"| after export | {_new_bytes(before, after_export)} |",
        f"| keeping every recorded per-token tensor instead, per batch | {full_tensors} |",
        "",
        f"Per padded token, whole tensors would retain {full_tensors / (ROWS * COLS):.0f} B; "
        "the diagnostics retain only per-key records. Medians of "
        f"{REPEATS} runs after a warm-up; ratios against the baseline of the same run.",
    ]
    report = "\n".join(lines)
    print(report)
    return report


if __name__ == "__main__":
    run()

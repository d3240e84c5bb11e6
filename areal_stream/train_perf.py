"""Training throughput and estimated FLOPs of a training engine (``train_perf/*``).

The engine wraps each ``train_batch`` (from before zero-grad through the optimizer step)::

    meter = TrainPerfMeter(flops_estimator=get_flops_estimator(model_config))
    with meter.measure(batch["attention_mask"]):
        ...  # zero_grad, micro-batches forward/backward, optimizer.step()
    stats.update(meter.export(dp_group=dp_group, group=all_training_ranks))

A window is everything measured since the last :meth:`TrainPerfMeter.export`. Tokens are
the valid (non-zero) entries of ``attention_mask`` (a 2-D ``[batch, seq_len]`` bool/integer
mask, one sequence per row; a packed batch passes ``cu_seqlens=`` instead) summed over
``dp_group`` only; FLOPs are the estimator summed over each sequence (mask row or packed
segment; empty rows skipped) and over ``dp_group``; time is the
maximum over ``group`` of each rank's accumulated time in the window. ``None`` for a group
means no reduction (this rank's own numbers).

Timing: on a CUDA device (ROCm included) the meter records an event on the current stream
when the block is entered and another on that same stream when it exits, and synchronises
the end events once per export; the time is therefore that stream's time, including host
gaps after the first event, not other streams' unjoined work. Elsewhere (CPU, NPU) it is
synchronous wall time (``time.perf_counter``). Nothing inside :meth:`measure` waits for the
device: token counts stay device tensors until export.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from areal_stream.flops import check_flops_value, check_sequence_length

__all__ = ["TrainPerfMeter"]

_PREFIX = "train_perf/"
_CACHE_LIMIT = 1 << 16


def _collective_device(group: Any) -> torch.device:
    """Where a tensor for a collective on ``group`` must live (NCCL needs the current GPU)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce(values: list[float], op: Any, group: Any) -> list[float]:
    buf = torch.tensor(values, dtype=torch.float64, device=_collective_device(group))
    dist.all_reduce(buf, op=op, group=group)
    return [float(v) for v in buf.tolist()]


def sequence_lengths(
    attention_mask: torch.Tensor | None, cu_seqlens: torch.Tensor | None
) -> torch.Tensor:
    """Valid tokens per sequence as an int64 tensor on the input's device (no host sync).

    ``attention_mask``: a 2-D ``[batch, seq_len]`` bool or integer tensor, one sequence per
    row; a token is valid where the mask is non-zero (padding anywhere in the row is
    ignored). ``cu_seqlens``: a 1-D integer tensor of packed-sequence boundaries
    ``[0, l1, l1 + l2, ...]``. Exactly one of the two.
    """
    if (attention_mask is None) == (cu_seqlens is None):
        raise TypeError("measure() takes exactly one of attention_mask or cu_seqlens")
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor):
            raise TypeError(
                f"attention_mask must be a torch.Tensor, got {type(attention_mask).__name__}"
            )
        if attention_mask.dtype.is_floating_point or attention_mask.dtype.is_complex:
            raise TypeError(
                f"attention_mask must be a bool or integer tensor, got {attention_mask.dtype}"
            )
        if attention_mask.dim() != 2:
            raise ValueError(
                "attention_mask must be 2-D [batch, seq_len] (one sequence per row), got shape "
                f"{tuple(attention_mask.shape)}; pass cu_seqlens= for a packed batch"
            )
        return (attention_mask.detach() != 0).sum(dim=1, dtype=torch.int64)
    assert cu_seqlens is not None
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if (
        cu_seqlens.dtype.is_floating_point
        or cu_seqlens.dtype.is_complex
        or (cu_seqlens.dtype == torch.bool)
    ):
        raise TypeError(f"cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(
            f"cu_seqlens must be 1-D with at least one entry, got shape {tuple(cu_seqlens.shape)}"
        )
    cu = cu_seqlens.detach().to(torch.int64)
    return cu[1:] - cu[:-1]


class TrainPerfMeter:
    """Accumulates tokens, estimated FLOPs and training time per window; see the module doc.

    ``flops_estimator`` is ``f(sequence_length) -> float`` (e.g. from
    :func:`areal_stream.flops.get_flops_estimator`); without one the export has tokens and
    time only. ``device`` selects the clock: a CUDA device uses stream events, anything
    else wall time; by default the current CUDA device when CUDA is available, else CPU.
    Results are cached per sequence length: the estimator must be a pure function.
    """

    def __init__(
        self,
        flops_estimator: Callable[[int], float] | None = None,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        if flops_estimator is not None and not callable(flops_estimator):
            raise TypeError(f"flops_estimator must be callable or None, got {flops_estimator!r}")
        self._estimator = flops_estimator
        self._device = None if device is None else torch.device(device)
        self._active = False
        self._lengths: list[torch.Tensor] = []
        self._wall_seconds = 0.0
        self._events: list[tuple[Any, Any]] = []
        self._cache: dict[int, float] = {}
        self._total_tokens = 0
        self._total_flops = 0.0
        self._total_seconds_local = 0.0

    @property
    def has_flops(self) -> bool:
        """Whether exports carry the ``estimated_flops`` keys."""
        return self._estimator is not None

    def _clock_device(self) -> torch.device:
        if self._device is None:
            if torch.cuda.is_available():
                self._device = torch.device("cuda", torch.cuda.current_device())
            else:
                self._device = torch.device("cpu")
        return self._device

    @contextmanager
    def measure(
        self,
        attention_mask: torch.Tensor | None = None,
        *,
        cu_seqlens: torch.Tensor | None = None,
    ) -> Iterator[None]:
        """Time the block and count the batch's tokens; a block that raises counts nothing."""
        lengths = sequence_lengths(attention_mask, cu_seqlens)
        if self._active:
            raise RuntimeError("TrainPerfMeter.measure() blocks cannot nest")
        device = self._clock_device()
        self._active = True
        try:
            if device.type == "cuda":  # events on the stream current at entry; no waiting
                stream = torch.cuda.current_stream(device)
                start = torch.cuda.Event(enable_timing=True)
                start.record(stream)
                yield
                end = torch.cuda.Event(enable_timing=True)
                end.record(stream)
                self._events.append((start, end))
            else:
                t0 = time.perf_counter()
                yield
                self._wall_seconds += time.perf_counter() - t0
            self._lengths.append(lengths)  # reached only when the block did not raise
        finally:
            self._active = False

    def _window_seconds(self) -> float:
        """Seconds measured in this window. Waits for the end events: in effect one wait,
        since events of a stream complete in order."""
        seconds = self._wall_seconds
        for start, end in self._events:
            end.synchronize()
            seconds += start.elapsed_time(end) / 1000.0
        return seconds

    def _host_lengths(self) -> list[int]:
        """All sequence lengths of the window as ints: one device-to-host copy per device."""
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for t in self._lengths:
            by_device.setdefault(t.device, []).append(t)
        out: list[int] = []
        for parts in by_device.values():
            out.extend(int(v) for v in torch.cat(parts).cpu().tolist())
        return out

    def _estimate(self, length: int) -> float:
        flops = self._cache.get(length)
        if flops is None:
            assert self._estimator is not None
            flops = check_flops_value(self._estimator(check_sequence_length(length)), length)
            if len(self._cache) >= _CACHE_LIMIT:
                self._cache.clear()
            self._cache[length] = flops
        return flops

    def _reset_window(self) -> None:
        self._lengths = []
        self._events = []
        self._wall_seconds = 0.0

    def export(self, dp_group: Any = None, group: Any = None) -> dict[str, float]:
        """The window's ``train_perf/*`` values, then start a new window.

        ``dp_group`` sums tokens and FLOPs (the data-parallel group only: TP/CP/PP/EP peers
        see the same tokens); ``group`` (all training ranks) takes the max of time. Every
        rank of those groups must call this. Rate keys are omitted while their time is 0.
        A bad window (negative cu_seqlens length, an estimator error, a non-finite or
        negative estimate) raises on every rank of the groups, after the collectives, so no
        rank is left waiting; the window is discarded.
        """
        error: BaseException | None = None
        tokens = 0
        flops = 0.0
        try:
            lengths = self._host_lengths()
            bad = [n for n in lengths if n < 0]
            if bad:
                raise ValueError(f"cu_seqlens must be non-decreasing; got a length of {bad[0]}")
            tokens = sum(lengths)
            if self._estimator is not None:
                flops = math.fsum(self._estimate(n) for n in lengths if n > 0)
        except Exception as exc:  # raised below, after the collectives, so no rank hangs
            error = exc
        local_seconds = seconds = self._window_seconds()
        self._reset_window()
        total_seconds = self._total_seconds_local + local_seconds
        failed = 1.0 if error is not None else 0.0
        if dp_group is not None:
            tokens_f, flops, failed = _all_reduce(
                [float(tokens), flops, failed], dist.ReduceOp.SUM, dp_group
            )
            tokens = int(tokens_f)
        if group is not None:
            seconds, total_seconds, failed = _all_reduce(
                [seconds, total_seconds, failed], dist.ReduceOp.MAX, group
            )
        if failed:
            if error is not None:
                raise error
            raise ValueError("train_perf export failed on another rank (see its error)")
        self._total_seconds_local += local_seconds
        self._total_tokens += tokens
        self._total_flops += flops
        out: dict[str, float] = {
            _PREFIX + "tokens": tokens,
            _PREFIX + "seconds": seconds,
            _PREFIX + "total_tokens": self._total_tokens,
            _PREFIX + "total_seconds": total_seconds,
        }
        if seconds > 0:
            out[_PREFIX + "tokens_per_second"] = tokens / seconds
        if total_seconds > 0:
            out[_PREFIX + "cumulative_tokens_per_second"] = self._total_tokens / total_seconds
        if self._estimator is not None:
            out[_PREFIX + "estimated_flops"] = flops
            if seconds > 0:
                out[_PREFIX + "estimated_flops_per_second"] = flops / seconds
            if total_seconds > 0:
                out[_PREFIX + "cumulative_estimated_flops_per_second"] = (
                    self._total_flops / total_seconds
                )
        return out

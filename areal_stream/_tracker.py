"""The stats tracker: synchronous recording into mergeable per-key records.

Scalars go to a lock-free ring (a list append) and are folded into ``[sum, count]`` when
the ring fills or on export. Tensor statistics fold at once into float64 device tensors
``(sum, weight)``, ``min``, ``max``: nothing of the tensor is kept and the host is not
synchronised until export. Scopes live in a ``ContextVar`` per tracker, so concurrent
asyncio tasks each see their own scope stack.
"""

from __future__ import annotations

import math
import numbers
import threading
from collections.abc import Callable
from contextvars import ContextVar
from types import TracebackType
from typing import Any, TypeVar, cast

import torch

from areal_stream._errors import StatsInputError
from areal_stream._export import Entry, TensorAcc, local_records, reduce_entries
from areal_stream._scope import Scope, Timing
from bus import Record, ReduceType, merge_into, project
from bus._aggregate import output_keys

F = TypeVar("F", bound=Callable[..., Any])

RING_CAPACITY = 1 << 15
"""Scalar calls held before the recording call folds them in place (bounded memory)."""


def _as_number(key: str, value: object) -> float:
    """Validate a ``scalar()`` value off the fast path; refuse anything non-numeric."""
    if isinstance(value, numbers.Real):  # int, bool, float, numpy scalars, Fraction
        return float(value)
    if isinstance(value, torch.Tensor):
        raise StatsInputError(
            f"scalar `{key}` got a torch.Tensor; pass a number (float(t)) or record the "
            "tensor with stat()"
        )
    raise StatsInputError(f"scalar `{key}` must be a real number, got {type(value).__name__}")


class DistributedStatsTracker:
    """A named set of statistics with hierarchical scopes (AReaL-compatible API).

    Recording methods are synchronous and never await. Keys of a named tracker carry its
    name as prefix: ``get("rollout").scalar(reward=1.0)`` exports ``rollout/reward``.
    """

    def __init__(self, name: str = "") -> None:
        name = name.strip("/")
        self.name = name
        self._prefix = name + "/" if name else ""
        self._scope: ContextVar[str] = ContextVar(f"areal_stream_scope_{name}", default="")
        self._scoped = False  # set for good when a scope is first entered
        # Hot path state: appended to without a lock (list.append is atomic).
        # ``{name: value}`` recorded outside any scope, else ``(scope, {name: value})``.
        self._ring: list[dict[str, float] | tuple[str, dict[str, float]]] = []
        # Everything below is guarded by _lock.
        self._lock = threading.RLock()
        self._scalars: dict[str, list[float]] = {}  # key -> [sum, count]
        self._tensors: dict[str, tuple[ReduceType, TensorAcc]] = {}
        self._denoms: dict[str, torch.Tensor] = {}  # key -> latest mask
        self._groups: dict[str, Any] = {}  # key -> per-key reduce group override

    def __repr__(self) -> str:
        return f"DistributedStatsTracker({self.name!r})"

    # -- scopes -----------------------------------------------------------------------

    def scope(self, name: str) -> Scope:
        """Context manager (sync or async) and decorator adding ``name/`` to keys."""
        self._scoped = True
        return Scope(self._scope, name)

    def scope_func_wrapper(self, name: str) -> Callable[[F], F]:
        """Decorator form of :meth:`scope` (reference name)."""
        return self.scope(name)

    def record_timing(self, name: str) -> Timing:
        """Time a block into SCALAR ``timeperf/<name>`` (seconds)."""
        return Timing(self, name)

    def current_scope(self) -> str:
        """The current task's scope prefix, e.g. ``"ppo_actor/update/"``."""
        return self._scope.get()

    # -- recording --------------------------------------------------------------------

    def scalar(self, *, reduce_group: Any = None, **kwargs: Any) -> None:
        """Record one number per key (SCALAR: exported as mean ``k`` and ``k__count``).

        The hot path: one append of ``(scope, kwargs)`` to the ring, no lock, no await. A
        call with any bad value records nothing and raises, naming the key.
        """
        for v in kwargs.values():
            if type(v) is not float and type(v) is not int:
                kwargs = {k: _as_number(k, v) for k, v in kwargs.items()}
                break
        if reduce_group is not None or self._tensors:
            self._scalar_slow(self._scope.get(), kwargs, reduce_group)
        ring = self._ring
        # Until a scope is first entered on this tracker, every key is unscoped; an
        # unscoped call appends its dict alone (no tuple: the cheapest hot path).
        if self._scoped:
            ring.append((self._scope.get(), kwargs))
        else:
            ring.append(kwargs)
        if len(ring) >= RING_CAPACITY:
            self.fold()

    def _record_unscoped(self, kwargs: dict[str, float]) -> None:
        """``scalar()`` outside any scope, for already-checked floats (record_timing)."""
        if self._tensors:
            self._scalar_slow("", kwargs, None)
        ring = self._ring
        ring.append(kwargs)
        if len(ring) >= RING_CAPACITY:
            self.fold()

    def _scalar_slow(self, prefix: str, kwargs: dict[str, Any], group: Any) -> None:
        with self._lock:
            for k in kwargs:
                held = self._tensors.get(prefix + k)
                if held is not None:
                    raise ValueError(
                        f"`{self._prefix}{prefix}{k}` is recorded as {held[0].name} in this "
                        "window; it cannot also be a SCALAR"
                    )
            if group is not None:
                for k in kwargs:
                    self._groups[prefix + k] = group

    def denominator(self, *, reduce_group: Any = None, **kwargs: Any) -> None:
        """Record bool masks that later ``stat()`` calls name; exported as SUM of the mask."""
        prefix = self._scope.get()
        for k, v in kwargs.items():
            if not isinstance(v, torch.Tensor) or v.dtype != torch.bool:
                what = v.dtype if isinstance(v, torch.Tensor) else type(v).__name__
                raise StatsInputError(f"denominator `{k}` must be a bool tensor, got {what}")
            if v.numel() == 0:
                raise ValueError(f"denominator `{k}` must be non-empty")
        with self._lock:
            for k in kwargs:
                self._check_kind(prefix + k, ReduceType.SUM)
            for k, v in kwargs.items():
                key = prefix + k
                m = v.detach()
                count = m.sum(dtype=torch.float64)
                self._fold_tensor(key, ReduceType.SUM, count, count, None, None)
                self._denoms[key] = m
                if reduce_group is not None:
                    self._groups[key] = reduce_group

    def stat(
        self,
        denominator: str,
        reduce_type: ReduceType | None = None,
        *,
        reduce_group: Any = None,
        **kwargs: Any,
    ) -> None:
        """Record float tensors masked by the named denominator (default AVG_MIN_MAX).

        Each call folds to four numbers per key on the tensor's device; the tensor itself
        is not kept.
        """
        if reduce_type is None:
            reduce_type = ReduceType.AVG_MIN_MAX
        elif not isinstance(reduce_type, ReduceType):
            raise StatsInputError(f"reduce_type must be a ReduceType, got {reduce_type!r}")
        if reduce_type is ReduceType.SCALAR:
            raise ValueError(
                f"stat({', '.join(kwargs)}): the SCALAR reduce type cannot be used for a "
                "tensor; use scalar() for single numbers"
            )
        if not isinstance(denominator, str):
            raise StatsInputError(f"denominator must be a key name, got {denominator!r}")
        prefix = self._scope.get()
        with self._lock:
            dkey = prefix + denominator
            mask = self._denoms.get(dkey)
            if mask is None:
                raise ValueError(
                    f"stat({', '.join(kwargs)}): denominator `{self._prefix}{dkey}` does not "
                    "exist; call denominator() first in the same scope"
                )
            for k, v in kwargs.items():
                if not isinstance(v, torch.Tensor) or not v.is_floating_point():
                    what = v.dtype if isinstance(v, torch.Tensor) else type(v).__name__
                    raise StatsInputError(f"stat `{k}` must be a floating tensor, got {what}")
                if v.shape != mask.shape:
                    raise ValueError(
                        f"stat `{k}` has shape {tuple(v.shape)} but denominator "
                        f"`{denominator}` has shape {tuple(mask.shape)}"
                    )
                if v.device != mask.device:
                    raise ValueError(
                        f"stat `{k}` is on {v.device} but denominator `{denominator}` is on "
                        f"{mask.device}"
                    )
                self._check_kind(prefix + k, reduce_type)
            # Only the statistics the reduce type exports are computed (min/max passes
            # cost as much as the sum).
            need_lo = reduce_type in (ReduceType.AVG_MIN_MAX, ReduceType.MIN)
            need_hi = reduce_type in (ReduceType.AVG_MIN_MAX, ReduceType.MAX)
            w = mask.sum(dtype=torch.float64)
            for k, v in kwargs.items():
                x = v.detach()
                s = torch.where(mask, x, 0).sum(dtype=torch.float64)
                lo = torch.where(mask, x, math.inf).amin().to(torch.float64) if need_lo else None
                hi = torch.where(mask, x, -math.inf).amax().to(torch.float64) if need_hi else None
                self._fold_tensor(prefix + k, reduce_type, s, w, lo, hi)
                if reduce_group is not None:
                    self._groups[prefix + k] = reduce_group

    stat_compact = stat
    """Same as :meth:`stat`: every stat here keeps four numbers per key until export."""

    def _check_kind(self, key: str, rtype: ReduceType) -> None:
        held = self._tensors.get(key)
        if held is not None and held[0] is not rtype:
            raise ValueError(
                f"`{self._prefix}{key}` was recorded as {held[0].name} in this window; "
                f"it cannot also be {rtype.name}"
            )
        if held is None:
            self._fold_locked()
            if key in self._scalars:
                raise ValueError(
                    f"`{self._prefix}{key}` is recorded as SCALAR in this window; it cannot "
                    f"also be {rtype.name}"
                )

    def _fold_tensor(
        self,
        key: str,
        rtype: ReduceType,
        s: torch.Tensor,
        w: torch.Tensor,
        lo: torch.Tensor | None,
        hi: torch.Tensor | None,
    ) -> None:
        held = self._tensors.get(key)
        sw = torch.stack((s, w))
        if held is None:
            self._tensors[key] = (rtype, TensorAcc(sw, lo, hi))
            return
        acc = held[1]
        if sw.device != acc.sw.device:  # the key moved device: keep accumulating where it is
            sw = sw.to(acc.sw.device)
            lo = None if lo is None else lo.to(acc.sw.device)
            hi = None if hi is None else hi.to(acc.sw.device)
        acc.sw = acc.sw + sw
        if lo is not None:
            acc.lo = lo if acc.lo is None else torch.minimum(acc.lo, lo)
        if hi is not None:
            acc.hi = hi if acc.hi is None else torch.maximum(acc.hi, hi)

    # -- folding and export -----------------------------------------------------------

    def fold(self) -> None:
        """Fold pending ring events into the per-key scalar records."""
        with self._lock:
            self._fold_locked()

    def _fold_locked(self) -> None:
        ring = self._ring
        n = len(ring)
        if not n:
            return
        # Slice then delete: appends racing with us land past n and survive.
        items = ring[:n]
        del ring[:n]
        groups: dict[str, list[float]] = {}
        for item in items:
            if type(item) is dict:
                for k, v in item.items():
                    try:
                        groups[k].append(v)
                    except KeyError:
                        groups[k] = [v]
                continue
            p, kw = cast(tuple[str, dict[str, float]], item)
            for k, v in kw.items():
                try:
                    groups[p + k].append(v)
                except KeyError:
                    groups[p + k] = [v]
        recs = self._scalars
        for key, vals in groups.items():
            r = recs.get(key)
            if r is None:
                recs[key] = [float(sum(vals)), float(len(vals))]
            else:
                r[0] += sum(vals)
                r[1] += len(vals)

    def pending_events(self) -> int:
        """Scalar-recording calls not yet folded (each holds one or more values)."""
        return len(self._ring)

    def _entries(self, key: str | None = None) -> dict[str, Entry]:
        """Full key -> (reduce type, group override, record or tensor accumulator)."""
        self._fold_locked()
        out: dict[str, Entry] = {}
        pre, groups = self._prefix, self._groups
        for k, (s, c) in self._scalars.items():
            if key is None or k == key:
                out[pre + k] = Entry(ReduceType.SCALAR, groups.get(k), [s, c, math.inf, -math.inf])
        for k, (rtype, acc) in self._tensors.items():
            if key is None or k == key:
                out[pre + k] = Entry(rtype, groups.get(k), acc)
        return out

    def _clear(self, key: str | None = None, denominators: bool = True) -> None:
        if key is None:
            self._scalars.clear()
            self._tensors.clear()
            self._groups.clear()
            if denominators:
                self._denoms.clear()
            return
        self._scalars.pop(key, None)
        self._tensors.pop(key, None)
        self._groups.pop(key, None)
        if denominators:
            self._denoms.pop(key, None)

    def export(
        self,
        key: str | None = None,
        reduce_group: Any = None,
        reset: bool = True,
        *,
        key_sync_group: Any = None,
    ) -> dict[str, float]:
        """Reduce and project this tracker's statistics (``key``: one key, scope-relative).

        With a process group, every member must call this; each gets the same dict.
        ``key_sync_group`` (as in the reference): a group containing ``reduce_group`` and
        the per-key override groups (e.g. DP+CP while exporting over DP), in which keys
        are agreed, so a rank that recorded nothing for an override group still joins it.
        """
        with self._lock:
            local = None if key is None else self._scope.get() + key
            records = reduce_entries(self._entries(local), reduce_group, None, key_sync_group)
            result = project_records(records)
            if reset:
                self._clear(local)
            return result

    def take_records(self) -> dict[str, tuple[ReduceType, Record]]:
        """Remove and return every record (host floats, keyed by full key); masks stay."""
        with self._lock:
            records = local_records(self._entries())
            self._clear(denominators=False)
            return records


def project_records(records: dict[str, tuple[ReduceType, Record]]) -> dict[str, float]:
    """Project records to output keys; an output key produced twice is an error."""
    out: dict[str, float] = {}
    owner: dict[str, str] = {}
    for k, (rtype, rec) in records.items():
        for ok in output_keys(k, rtype):
            if ok in owner:
                raise ValueError(
                    f"output key `{ok}` is produced by both `{owner[ok]}` and `{k}` "
                    f"({rtype.name}); rename one of them"
                )
            owner[ok] = k
        out.update(project(k, rtype, rec))
    return out


class _Registry:
    """Process-wide named trackers; the default one has the empty name."""

    def __init__(self) -> None:
        self.default = DistributedStatsTracker()
        self.trackers: dict[str, DistributedStatsTracker] = {"": self.default}
        self.lock = threading.Lock()

    def create(self, name: str) -> DistributedStatsTracker:
        if not isinstance(name, str):
            raise TypeError(f"tracker name must be a str, got {type(name).__name__}")
        with self.lock:
            tracker = self.trackers.get(name)
            if tracker is None:
                stripped = name.strip("/")
                tracker = self.trackers.get(stripped) or DistributedStatsTracker(stripped)
                self.trackers[stripped] = tracker
                self.trackers[name] = tracker
            return tracker

    def unique(self) -> list[DistributedStatsTracker]:
        seen: dict[int, DistributedStatsTracker] = {}
        for t in self.trackers.values():
            seen.setdefault(id(t), t)
        return sorted(seen.values(), key=lambda t: t.name)


REGISTRY = _Registry()
_TRACKERS = REGISTRY.trackers


def get(name: str = "") -> DistributedStatsTracker:
    """The tracker called ``name`` (created on first use); ``""`` is the default."""
    try:
        return _TRACKERS[name]
    except KeyError:
        return REGISTRY.create(name)


class _Locks:
    """Hold every tracker's lock, in name order, for a consistent multi-tracker export."""

    def __init__(self, trackers: list[DistributedStatsTracker]) -> None:
        self._trackers = trackers

    def __enter__(self) -> None:
        for t in self._trackers:
            t._lock.acquire()

    def __exit__(
        self,
        et: type[BaseException] | None,
        ev: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for t in reversed(self._trackers):
            t._lock.release()


def _all_entries(trackers: list[DistributedStatsTracker]) -> tuple[dict[str, Entry], str | None]:
    """Every tracker's entries, and the first key two trackers both produce (an error the
    caller raises on every rank, after the key agreement, so no rank is left waiting)."""
    entries: dict[str, Entry] = {}
    source: dict[str, str] = {}
    error: str | None = None
    for t in trackers:
        for k, e in t._entries().items():
            if k in entries:
                if error is None:
                    error = (
                        f"key `{k}` is recorded by tracker {source[k]!r} and tracker "
                        f"{t.name!r}; rename one of them"
                    )
                continue
            entries[k] = e
            source[k] = t.name
    return entries, error


def export_all(
    reduce_group: Any = None, reset: bool = True, *, key_sync_group: Any = None
) -> dict[str, float]:
    """Export every tracker in one packed reduction (same dict on every rank).

    ``key_sync_group``: as in :meth:`DistributedStatsTracker.export`.
    """
    trackers = REGISTRY.unique()
    with _Locks(trackers):
        entries, error = _all_entries(trackers)
        records = reduce_entries(entries, reduce_group, error, key_sync_group)
        result = project_records(records)
        if reset:
            for t in trackers:
                t._clear()
        return result


def take_records() -> dict[str, tuple[ReduceType, Record]]:
    """Remove and return every tracker's records (for streaming); masks stay.

    A key recorded by two trackers with one reduce type is merged (the controller would
    merge it anyway); with two reduce types it is an error and nothing is removed.
    """
    trackers = REGISTRY.unique()
    with _Locks(trackers):
        out: dict[str, tuple[ReduceType, Record]] = {}
        for t in trackers:
            for k, (rtype, rec) in local_records(t._entries()).items():
                held = out.get(k)
                if held is None:
                    out[k] = (rtype, rec)
                elif held[0] is rtype:
                    merge_into(held[1], rec)
                else:
                    raise ValueError(
                        f"key `{k}` is recorded as {held[0].name} and as {rtype.name} by "
                        "two trackers; rename one of them"
                    )
        for t in trackers:
            t._clear(denominators=False)
        return out


def pending_events() -> int:
    """Scalar events recorded in this process and not yet folded."""
    return sum(len(t._ring) for t in REGISTRY.unique())

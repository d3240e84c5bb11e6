"""Reduce per-key records locally or across a torch.distributed group, packed.

A distributed export costs a constant number of collectives whatever the number of keys:
one MAX of a key-set signature (when the signatures differ, one ``all_gather_object`` of
the key lists follows), one SUM of every ``(sum, weight, nan flag)`` and one MAX of every
``(-min, max)``. Ranks that never saw a key join with identity values. NaN is carried by
the flag, since the MAX collective's treatment of NaN is backend-defined.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from bus import Record, ReduceType

_F64 = torch.float64


@dataclass
class TensorAcc:
    """Running device-side record: ``sw`` = [sum, weight]; ``lo``/``hi`` 0-d (or None)."""

    sw: torch.Tensor
    lo: torch.Tensor | None
    hi: torch.Tensor | None

    def row(self) -> torch.Tensor:
        """``[sum, weight, min, max]`` as one float64 tensor on the accumulator's device."""
        dev = self.sw.device
        lo = self.lo if self.lo is not None else torch.tensor(math.inf, dtype=_F64, device=dev)
        hi = self.hi if self.hi is not None else torch.tensor(-math.inf, dtype=_F64, device=dev)
        return torch.cat((self.sw, lo.reshape(1), hi.reshape(1)))


class Entry(NamedTuple):
    """One key's reduce type, per-key group override, and local data."""

    rtype: ReduceType
    group: Any
    data: Record | TensorAcc


def _local_records(entries: dict[str, Entry]) -> dict[str, tuple[ReduceType, Record]]:
    """Host records for every entry, with one device-to-host copy per device."""
    out: dict[str, tuple[ReduceType, Record]] = {}
    by_device: dict[torch.device, list[tuple[str, ReduceType, TensorAcc]]] = {}
    for k, e in entries.items():
        if isinstance(e.data, TensorAcc):
            by_device.setdefault(e.data.sw.device, []).append((k, e.rtype, e.data))
        else:
            out[k] = (e.rtype, list(e.data))
    for items in by_device.values():
        rows = torch.stack([acc.row() for _, _, acc in items]).cpu().tolist()
        for (k, rtype, _), row in zip(items, rows):
            out[k] = (rtype, row)
    return dict(sorted(out.items()))


def _group_ranks(group: Any) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))


def _comm_device(group: Any) -> torch.device:
    if str(dist.get_backend(group)).lower() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _signature(keys: list[tuple[str, int]]) -> int:
    h = hashlib.blake2b("\n".join(f"{k}\t{t}" for k, t in keys).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") >> 2  # fits int64 with its negation


def _agree_keys(
    local: list[tuple[str, int]], group: Any, device: torch.device
) -> list[tuple[str, int]]:
    """The union of every rank's ``(key, reduce type)`` list, sorted, same on all ranks."""
    sig = _signature(local)
    t = torch.tensor([sig, -sig], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    hi, neg_lo = t.tolist()
    if hi == sig and -neg_lo == sig:
        return local
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, local, group=group)
    union: dict[str, int] = {}
    for rank_keys in gathered:
        for k, t_ in rank_keys:
            if union.setdefault(k, t_) != t_:
                raise ValueError(
                    f"key `{k}` is recorded as {ReduceType(union[k]).name} on one rank and "
                    f"{ReduceType(t_).name} on another"
                )
    return sorted(union.items())


def _reduce_group(entries: dict[str, Entry], group: Any) -> dict[str, tuple[ReduceType, Record]]:
    device = _comm_device(group)
    local_keys = sorted((k, int(e.rtype)) for k, e in entries.items())
    keys = _agree_keys(local_keys, group, device)
    n = len(keys)
    if n == 0:
        return {}
    # Rows [sum, weight, min, max] for locally held keys; identity rows for the rest.
    rows = torch.empty((n, 4), dtype=_F64, device=device)
    rows[:, :2] = 0.0
    rows[:, 2] = math.inf
    rows[:, 3] = -math.inf
    py_idx: list[int] = []
    py_rows: list[Record] = []
    dev_rows: dict[torch.device, tuple[list[int], list[torch.Tensor]]] = {}
    for i, (k, _) in enumerate(keys):
        e = entries.get(k)
        if e is None:
            continue
        if isinstance(e.data, TensorAcc):
            idx, ts = dev_rows.setdefault(e.data.sw.device, ([], []))
            idx.append(i)
            ts.append(e.data.row())
        else:
            py_idx.append(i)
            py_rows.append(e.data)
    if py_rows:
        rows[torch.tensor(py_idx, device=device)] = torch.tensor(py_rows, dtype=_F64).to(device)
    for idx, ts in dev_rows.values():
        rows[torch.tensor(idx, device=device)] = torch.stack(ts).to(device)
    nan = torch.isnan(rows[:, 2]) | torch.isnan(rows[:, 3])
    sums = torch.stack((rows[:, 0], rows[:, 1], nan.to(_F64)), dim=1)
    maxes = torch.stack((-rows[:, 2], rows[:, 3]), dim=1)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
    out_rows = torch.cat((sums, maxes), dim=1).cpu().tolist()
    out: dict[str, tuple[ReduceType, Record]] = {}
    for (k, t), (s, w, flag, neg_lo, hi) in zip(keys, out_rows):
        lo = -neg_lo
        if flag > 0:
            lo = hi = math.nan
        out[k] = (ReduceType(t), [s, w, lo, hi])
    return out


def _distributed(group: Any) -> bool:
    """True when ``group`` is a process group of more than one rank."""
    return (
        group is not None
        and dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size(group) > 1
    )


def reduce_entries(
    entries: dict[str, Entry], default_group: Any
) -> dict[str, tuple[ReduceType, Record]]:
    """Records of every key, reduced over its group (its override, else the default)."""
    local: dict[str, Entry] = {}
    by_group: dict[tuple[int, ...], tuple[Any, dict[str, Entry]]] = {}
    if _distributed(default_group):
        # Every member joins the default group's collectives, even with no keys of its own.
        by_group[_group_ranks(default_group)] = (default_group, {})
    for k, e in entries.items():
        g = e.group if e.group is not None else default_group
        if _distributed(g):
            by_group.setdefault(_group_ranks(g), (g, {}))[1][k] = e
        else:
            local[k] = e
    out = _local_records(local)
    for ranks in sorted(by_group):
        group, group_entries = by_group[ranks]
        out.update(_reduce_group(group_entries, group))
    return dict(sorted(out.items()))

"""Reduce per-key records locally or across a torch.distributed group, packed.

A distributed export costs a constant number of collectives whatever the number of keys.
In the export's group: one MAX of a signature of this rank's ``(key, reduce type, key's
group)`` list plus an error flag; only when the signatures differ or a rank flagged an
error, one ``all_gather_object`` of the lists follows, from which every rank derives the
same key set for every group (ranks that never saw a key join with identity values) or
the same error. Then, per group: one SUM of every ``(sum, weight, nan flag)`` and one MAX
of every ``(-min, max)``. NaN is carried by the flag, since the MAX collective's treatment
of NaN is backend-defined. No rank raises before a collective that the others enter.
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


def local_records(entries: dict[str, Entry]) -> dict[str, tuple[ReduceType, Record]]:
    """Host records for every entry, not reduced (per-key groups ignored), with one
    device-to-host copy per device."""
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


GroupId = tuple[str, tuple[int, ...]]
"""A process group as every rank names it: ``(group_name, global ranks)``. Two groups of
the same ranks are distinct communicators, so the ranks alone do not identify one."""

_HANDLES: dict[GroupId, Any] = {}
"""Process groups this process has reduced over: a rank that recorded nothing for an
override group in this window can still join that group's collectives."""
_HANDLES_WORLD: list[Any] = [None]  # the WORLD group the handles belong to

_Plan = list[tuple[str, int, GroupId | tuple[()]]]
"""``(key, reduce type, the key's group)``; ``()`` for a key reduced locally."""


def _group_id(group: Any) -> GroupId:
    name = getattr(group, "group_name", None)
    if not isinstance(name, str):
        name = dist.distributed_c10d._get_process_group_name(group)
    return (name, _group_ranks(group))


def _remember(group: Any) -> GroupId:
    if _HANDLES_WORLD[0] is not dist.group.WORLD:  # a new init: old handles are dead
        _HANDLES.clear()
        _HANDLES_WORLD[0] = dist.group.WORLD
    gid = _group_id(group)
    _HANDLES[gid] = group
    return gid


def _signature(items: list[Any]) -> int:
    h = hashlib.blake2b(repr(items).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") >> 2  # fits int64 with its negation


def _same_everywhere(sig: int, flag: int, group: Any, device: torch.device) -> tuple[bool, bool]:
    """One MAX all-reduce: (every rank has signature ``sig``, some rank raised ``flag``)."""
    t = torch.tensor([sig, -sig, flag], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    hi, neg_lo, any_flag = t.tolist()
    return hi == sig and -neg_lo == sig, any_flag > 0


def _agree_keys(
    local: list[tuple[str, int]], flag: bool, group: Any, device: torch.device
) -> tuple[list[tuple[str, int]], str | None, bool]:
    """The union of every rank's ``(key, reduce type)`` list, sorted, same on all ranks;
    a conflict (returned, not raised) and whether any rank carries an error flag, both
    known alike to every rank of ``group``."""
    same, any_flag = _same_everywhere(_signature(local), int(flag), group, device)
    if same:
        return local, None, any_flag
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, local, group=group)
    union: dict[str, int] = {}
    for rank_keys in gathered:
        for k, t_ in rank_keys:
            if union.setdefault(k, t_) != t_:
                return (
                    [],
                    f"key `{k}` is recorded as {ReduceType(union[k]).name} on one rank and "
                    f"{ReduceType(t_).name} on another",
                    any_flag,
                )
    return sorted(union.items()), None, any_flag


def _agree_plan(
    plan: _Plan, error: str | None, group: Any, device: torch.device
) -> tuple[dict[GroupId, list[tuple[str, int]]], str | None]:
    """Agree, within ``group``, on the key list of every group inside it.

    ``plan`` holds this rank's keys of the groups inside ``group`` and its local keys.
    Returns ``{group id: sorted [(key, reduce type)]}`` for the groups this rank must
    join (each such group some member recorded a key for), or an error
    message that every rank of ``group`` gets alike: a rank's own error, a reduce-type
    conflict, a key reduced over two groups by one rank, or a member holding no handle
    for a group it must join. Costs one all-reduce, plus one ``all_gather_object`` when
    the ranks' lists differ or a rank has an error.
    """
    me = dist.get_rank()
    mine = sorted(plan)
    same, failed = _same_everywhere(_signature(mine), int(error is not None), group, device)
    if same and not failed:
        joined: dict[GroupId, list[tuple[str, int]]] = {}
        for k, t, gid in mine:
            if gid:
                joined.setdefault(gid, []).append((k, t))
        return joined, None
    gathered: list[Any] = [None] * dist.get_world_size(group)
    handles = sorted(gid for gid in _HANDLES if me in gid[1])
    dist.all_gather_object(gathered, (me, mine, handles, error), group=group)
    errors = [f"rank {r}: {e}" for r, _, _, e in gathered if e is not None]
    keys: dict[GroupId, dict[str, int]] = {}
    local_keys: dict[int, set[str]] = {}
    for r, rank_plan, _, _ in gathered:
        for k, t, gid in rank_plan:
            if not gid:
                local_keys.setdefault(r, set()).add(k)
                continue
            gid = (gid[0], tuple(gid[1]))
            held = keys.setdefault(gid, {}).setdefault(k, t)
            if held != t:
                errors.append(
                    f"key `{k}` is recorded as {ReduceType(held).name} on one rank and "
                    f"{ReduceType(t).name} on another (group of global ranks {list(gid[1])})"
                )
    for r, _, held_handles, _ in gathered:
        held_ids = {(name, tuple(ranks)) for name, ranks in held_handles}
        seen: dict[str, GroupId | tuple[()]] = {k: () for k in local_keys.get(r, ())}
        for gid in sorted(keys):
            if r not in gid[1]:
                continue
            if gid not in held_ids:
                errors.append(
                    f"rank {r} must join the reduce group of global ranks {list(gid[1])} "
                    f"for key `{min(keys[gid])}` but has never recorded a key with that "
                    "group, so it holds no handle for it; record the key (or any key with "
                    "that reduce_group) on every member of the group"
                )
            for k in keys[gid]:
                other = seen.setdefault(k, gid)
                if other != gid:
                    where = "locally" if not other else f"over global ranks {list(other[1])}"
                    errors.append(
                        f"key `{k}` is reduced over global ranks {list(gid[1])} by some ranks "
                        f"but rank {r} reduces it {where}; use one reduce group per key"
                    )
    if errors:
        return {}, "; ".join(dict.fromkeys(errors))
    return {gid: sorted(ks.items()) for gid, ks in keys.items() if me in gid[1]}, None


def _reduce_rows(
    entries: dict[str, Entry],
    keys: list[tuple[str, int]],
    flag: bool,
    group: Any,
    device: torch.device,
) -> tuple[dict[str, tuple[ReduceType, Record]], bool]:
    """Reduce the agreed ``keys`` over ``group``: one SUM and one MAX all-reduce. The SUM
    also carries the error flag; returns the records and whether any rank had it set."""
    n = len(keys)
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
    flag_row = torch.tensor([[float(flag), 0.0, 0.0]], dtype=_F64, device=device)
    sums = torch.cat((sums, flag_row))
    maxes = torch.stack((-rows[:, 2], rows[:, 3]), dim=1)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
    pad = torch.zeros((1, 2), dtype=_F64, device=device)
    out_rows = torch.cat((sums, torch.cat((maxes, pad))), dim=1).cpu().tolist()  # one copy
    any_flag = out_rows[n][0] > 0
    out: dict[str, tuple[ReduceType, Record]] = {}
    for (k, t), (s, w, nan_flag, neg_lo, hi) in zip(keys, out_rows[:n]):
        lo = -neg_lo
        if nan_flag > 0:
            lo = hi = math.nan
        out[k] = (ReduceType(t), [s, w, lo, hi])
    return out, any_flag


def _distributed(group: Any) -> bool:
    """True when ``group`` is a process group of more than one rank."""
    return (
        group is not None
        and dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size(group) > 1
    )


def reduce_entries(
    entries: dict[str, Entry],
    default_group: Any,
    error: str | None = None,
    sync_group: Any = None,
) -> dict[str, tuple[ReduceType, Record]]:
    """Records of every key, reduced over its group (its override, else the default).

    Raises ``ValueError`` for ``error`` (a problem this rank found before reducing, e.g.
    a key recorded by two trackers) and for any disagreement between ranks, after taking
    part in every collective its groups expect, so no rank waits on one that gave up.
    The error travels in those collectives (a flag), so the other ranks raise too, and
    none of them has reduced a window that some rank keeps for a later export.

    Keys are agreed in one step in ``sync_group`` if given, else in the default group:
    the keys of every group inside it (a member that recorded nothing for such a group
    this window joins it with identity values). An override group reaching outside it
    (e.g. DP+CP while exporting over DP with no ``sync_group``) agrees on its keys within
    itself, so each of its members must have recorded at least one key with it.
    """
    errors: list[str] = []
    flag = error is not None
    local: dict[str, Entry] = {}
    by_group: dict[GroupId, tuple[Any, dict[str, Entry]]] = {}
    inner: _Plan = []  # keys agreed in the default group
    for k, e in entries.items():
        g = e.group if e.group is not None else default_group
        if _distributed(g):
            gid = _remember(g)
            by_group.setdefault(gid, (g, {}))[1][k] = e
        else:
            local[k] = e
            inner.append((k, int(e.rtype), ()))
    joined: dict[GroupId, list[tuple[str, int]]] = {}
    outer: list[GroupId] = list(by_group)
    agree_in = sync_group if _distributed(sync_group) else default_group
    if _distributed(agree_in):
        if _distributed(default_group):
            _remember(default_group)
        agree_ranks = set(_remember(agree_in)[1])
        outer = [gid for gid in by_group if not agree_ranks.issuperset(gid[1])]
        for gid, (_, group_entries) in by_group.items():
            if gid not in outer:
                inner += [(k, int(e.rtype), gid) for k, e in group_entries.items()]
        joined, problem = _agree_plan(inner, error, agree_in, _comm_device(agree_in))
        if problem is not None:
            errors.append(problem)
            flag = True  # every rank of the agreement group knows; outer groups learn it
    elif error is not None:
        errors.append(error)
    out = local_records(local)
    # One order on every rank (sorted group ids), so no two ranks wait on each other.
    for gid in sorted(set(joined) | set(outer)):
        group = _HANDLES[gid]
        group_entries = by_group.get(gid, (group, {}))[1]
        device = _comm_device(group)
        if gid in joined:
            keys = joined[gid]
        else:
            local_keys = sorted((k, int(e.rtype)) for k, e in group_entries.items())
            keys, problem, any_flag = _agree_keys(local_keys, flag, group, device)
            flag = flag or any_flag
            if problem is not None:
                errors.append(problem)
                flag = True
                continue  # every member saw the same conflict: all skip the data
            if any_flag:
                continue  # every member knows some rank failed: all skip the data
        records, any_flag = _reduce_rows(group_entries, keys, flag, group, device)
        flag = flag or any_flag
        out.update(records)
    if errors:
        raise ValueError("; ".join(dict.fromkeys(errors)))
    if flag:
        raise ValueError(
            "export failed on another rank (it raised the reason); nothing was exported or reset"
        )
    return dict(sorted(out.items()))

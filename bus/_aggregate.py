"""One mergeable record per key, from which every reduce type is projected.

A record is ``[sum, weight, min, max]`` in float64. Merging is elementwise add / min / max,
so records fold in any order: in the recording ring, on the wire, in the controller and
across ranks. NaN propagates through min and max as it does through the sum.
"""

from __future__ import annotations

import math
from enum import IntEnum

INF = math.inf

Record = list[float]
"""``[sum, weight, min, max]``; weight is the element count (mask sum, or number of scalars)."""


class ReduceType(IntEnum):
    """How a key's record is projected to output values (wire code = int value)."""

    AVG_MIN_MAX = 1
    AVG = 2
    SUM = 3
    MIN = 4
    MAX = 5
    SCALAR = 6


def new_record() -> Record:
    """The identity record: merging it into anything changes nothing."""
    return [0.0, 0.0, INF, -INF]


def nan_min(a: float, b: float) -> float:
    """``min`` that returns NaN when either side is NaN."""
    if a != a or b != b:
        return math.nan
    return a if a <= b else b


def nan_max(a: float, b: float) -> float:
    """``max`` that returns NaN when either side is NaN."""
    if a != a or b != b:
        return math.nan
    return a if a >= b else b


def merge_into(dst: Record, src: Record) -> None:
    """Fold ``src`` into ``dst`` in place."""
    dst[0] += src[0]
    dst[1] += src[1]
    dst[2] = nan_min(dst[2], src[2])
    dst[3] = nan_max(dst[3], src[3])


def project(key: str, rtype: ReduceType, rec: Record) -> dict[str, float]:
    """Output values of one key, following the reference's key names and omissions.

    AVG with zero weight and MIN/MAX with no valid element are omitted; SCALAR with no
    values gives ``0.0`` and a count of 0. Values are never clamped or cleaned: an inf or
    NaN that was recorded is exported.
    """
    s, w, lo, hi = rec
    if rtype is ReduceType.SCALAR:
        return {key: s / w if w > 0 else 0.0, key + "__count": int(w)}
    if rtype is ReduceType.AVG_MIN_MAX:
        if w <= 0:
            return {}
        return {key + "/avg": s / w, key + "/min": lo, key + "/max": hi}
    if rtype is ReduceType.AVG:
        return {key: s / w} if w > 0 else {}
    if rtype is ReduceType.SUM:
        return {key: s}
    if rtype is ReduceType.MIN:
        return {key: lo} if w > 0 else {}
    if rtype is ReduceType.MAX:
        return {key: hi} if w > 0 else {}
    raise ValueError(f"unknown reduce type {rtype!r} for key {key!r}")


def output_keys(key: str, rtype: ReduceType) -> tuple[str, ...]:
    """Every key ``project`` can produce for ``key`` (for collision checks)."""
    if rtype is ReduceType.SCALAR:
        return (key, key + "__count")
    if rtype is ReduceType.AVG_MIN_MAX:
        return (key + "/avg", key + "/min", key + "/max")
    return (key,)


def project_all(records: dict[str, tuple[ReduceType, Record]]) -> dict[str, float]:
    """Project every ``key -> (reduce type, record)`` (callers check key collisions)."""
    out: dict[str, float] = {}
    for k, (rtype, rec) in records.items():
        out.update(project(k, rtype, rec))
    return out

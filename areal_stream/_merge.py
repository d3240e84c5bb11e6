"""Controller-side merge of per-worker SCALAR exports, weighted by ``__count``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

_COUNT = "__count"


def merge_worker_stats(all_raw_stats: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Weighted average of each key across workers, with ``<key>__count`` as the weight.

    As the reference ``RolloutController.export_stats``: a key whose total count is 0 is
    omitted. Unlike it, the summed ``<key>__count`` values are returned too, so a merged
    result can be merged again (the operation is associative), and a value without its
    ``__count`` companion is an error instead of being dropped silently.
    """
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for i, raw in enumerate(all_raw_stats):
        for k, v in raw.items():
            if k.endswith(_COUNT):
                counts[k] = counts.get(k, 0) + v
                continue
            if k + _COUNT not in raw:
                raise ValueError(
                    f"merge_worker_stats: stats[{i}][{k!r}] has no {k + _COUNT!r}; only "
                    "SCALAR exports (value + count) can be merged by count"
                )
            c = raw[k + _COUNT]
            if c:
                sums[k] = sums.get(k, 0.0) + v * c
            else:
                sums.setdefault(k, 0.0)
    out: dict[str, float] = {}
    for k, s in sums.items():
        c = counts.get(k + _COUNT, 0)
        if c > 0:
            out[k] = s / c
            out[k + _COUNT] = c
    return out

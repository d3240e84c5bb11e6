"""What a logging backend is: a ``Backend`` that receives ``StepRecord``s on its own thread.

Values reaching a backend are already normalised by ``StatsLogger``: ``int``, ``float``
(NaN and +-inf included, passed on as they are) or ``areal_stream.Table``. Helpers here turn a
Table into the per-cell scalars SwanLab and Trackio log (see ``expand_table``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Union

from areal_stream._table import Table

Value = Union[int, float, Table]  # noqa: UP007 (a runtime alias on py3.10)

logger = logging.getLogger("areal_stream.stats_logger")


class BackendUnavailable(RuntimeError):
    """The backend's package is not installed; the message says what to install."""


@dataclass(frozen=True)
class StepRecord:
    """One committed step as every backend sees it (``step`` is the step to log at)."""

    step: int
    global_step: int
    epoch: int
    epoch_step: int
    stats: Mapping[str, Value]


class Backend:
    """Base class: ``open`` once, ``log`` per step in step order, ``close`` once - all on the
    backend's own worker thread. ``flush`` makes logged data durable/readable."""

    name: str = "backend"

    def open(self) -> None:
        """Import the library and start the run (may be slow; it runs on the worker)."""

    def log(self, record: StepRecord) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Push buffered data to disk (default: nothing buffered)."""

    def close(self) -> None:
        """Finish the run and release the library's resources."""


def missing_package(backend: str, package: str) -> BackendUnavailable:
    return BackendUnavailable(
        f"the {backend} backend is enabled but the package {package!r} is not installed: "
        f"pip install areal-stream[{backend}]"
    )


class NoteOnce:
    """Log a note the first time each ``kind`` happens (e.g. a skipped Table per key)."""

    def __init__(self, backend: str) -> None:
        self._backend = backend
        self._seen: set[str] = set()

    def __call__(self, kind: str, message: str) -> None:
        if kind not in self._seen:
            self._seen.add(kind)
            logger.info("%s: %s (noted once)", self._backend, message)


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def table_cell_key(
    key: str, table: Table, row_number: int, row: tuple[object, ...], col: str
) -> str:
    """The scalar key of one Table cell, as ``areal_stream.Table``'s docstring defines it."""
    if table.index:
        parent = key.rsplit("/", 1)[0] if "/" in key else ""
        pos = {c: i for i, c in enumerate(table.columns)}
        parts = [f"{name}_{row[pos[name]]}" for name in table.index]
        path = "/".join([*parts, col])
        return f"{parent}/{path}" if parent else path
    return f"{key}/{row_number}/{col}"


def expand_table(key: str, table: Table, note: NoteOnce) -> dict[str, float | int]:
    """One scalar per numeric value cell (non-index columns); other cells are skipped with a
    one-time note naming the key."""
    out: dict[str, float | int] = {}
    value_cols = [(i, c) for i, c in enumerate(table.columns) if c not in table.index]
    skipped = 0
    for n, row in enumerate(table.rows):
        for i, col in value_cols:
            cell = row[i]
            if is_number(cell) or isinstance(cell, bool):
                out[table_cell_key(key, table, n, row, col)] = (
                    int(cell) if isinstance(cell, bool) else cell
                )
            else:
                skipped += 1
    if skipped:
        note(f"table-cells:{key}", f"Table {key!r}: {skipped} non-numeric cell(s) not logged")
    return out


def with_tables_expanded(stats: Mapping[str, Any], note: NoteOnce) -> dict[str, Any]:
    """``stats`` with every Table replaced by its per-cell scalars (SwanLab, Trackio)."""
    data: dict[str, Any] = {}
    for key, value in stats.items():
        if isinstance(value, Table):
            data.update(expand_table(key, value, note))
        else:
            data[key] = value
    return data


def heatmap_pixels(table: Table) -> tuple[list[object], list[object], list[list[int]]]:
    """The heatmap of a Table as uint8 rows: rows = sorted distinct values of the first index
    column, columns = sorted distinct values of the second; pixel = round(255 * v / vmax) with
    vmax the largest finite value (0 when vmax <= 0); a missing, negative or non-finite cell
    is 0. Returns (row labels, column labels, pixel rows)."""
    assert table.heatmap is not None and len(table.index) == 2
    pos = {c: i for i, c in enumerate(table.columns)}
    ri, ci, vi = pos[table.index[0]], pos[table.index[1]], pos[table.heatmap]

    def _sorted(values: set[object]) -> list[object]:
        try:
            return sorted(values)  # type: ignore[type-var]
        except TypeError:
            return sorted(values, key=repr)

    rows = _sorted({r[ri] for r in table.rows})
    cols = _sorted({r[ci] for r in table.rows})
    rpos = {v: i for i, v in enumerate(rows)}
    cpos = {v: i for i, v in enumerate(cols)}
    grid = [[0.0] * len(cols) for _ in rows]
    for r in table.rows:
        v = r[vi]
        if is_number(v) and math.isfinite(float(v)):
            grid[rpos[r[ri]]][cpos[r[ci]]] = float(v)
    vmax = max((v for line in grid for v in line), default=0.0)
    pixels = [
        [0 if vmax <= 0 or v <= 0 else min(255, round(255 * v / vmax)) for v in line]
        for line in grid
    ]
    return rows, cols, pixels

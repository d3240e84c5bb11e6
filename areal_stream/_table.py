"""A small tabular metric value that backends render in their own way."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Table:
    """Rows of values under named columns (e.g. MoE expert loads for one step).

    W&B logs it as a ``wandb.Table``. SwanLab and Trackio get one scalar per row cell:
    with ``index`` columns, the cell of value column ``v`` in a row is logged as
    ``<parent>/<i1>_<row[i1]>/.../<v>`` where ``<parent>`` is the table's key without its
    last path component (``moe_balance/expert_loads`` -> ``moe_balance/layer_0/expert_3/
    tokens``); without ``index`` it is ``<key>/<row number>/<v>``. TensorBoard draws a
    table with two index columns and a ``heatmap`` value column as an image
    (rows = first index, columns = second index); otherwise TensorBoard and the console
    skip tables with a one-time note.
    """

    columns: tuple[str, ...]
    rows: tuple[tuple[Any, ...], ...]
    index: tuple[str, ...] = ()
    heatmap: str | None = None

    def __init__(
        self,
        columns: Sequence[str],
        rows: Sequence[Sequence[Any]],
        index: Sequence[str] = (),
        heatmap: str | None = None,
    ) -> None:
        cols = tuple(str(c) for c in columns)
        if len(set(cols)) != len(cols):
            raise ValueError(f"Table columns must be unique, got {cols}")
        body = tuple(tuple(r) for r in rows)
        for i, r in enumerate(body):
            if len(r) != len(cols):
                raise ValueError(f"Table row {i} has {len(r)} cells, expected {len(cols)}")
        idx = tuple(index)
        for name in (*idx, *([heatmap] if heatmap is not None else [])):
            if name not in cols:
                raise ValueError(f"Table column {name!r} is not one of {cols}")
        if heatmap is not None and len(idx) != 2:
            raise ValueError("a heatmap Table needs exactly two index columns")
        object.__setattr__(self, "columns", cols)
        object.__setattr__(self, "rows", body)
        object.__setattr__(self, "index", idx)
        object.__setattr__(self, "heatmap", heatmap)

    def __len__(self) -> int:
        return len(self.rows)

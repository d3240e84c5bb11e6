"""The JSONL journal: ``<log_dir>/stats.jsonl``, one line per committed step, the record of truth.

Line format (fixed; other tools read it)::

    {"global_step": N, "step": S, "epoch": E, "epoch_step": ES, "stats": {key: value}}

``step`` is the step the backends logged. Values are JSON numbers; NaN and +-inf are written
as the bare tokens ``NaN``, ``Infinity``, ``-Infinity`` (Python's ``json`` reads them back;
strict JSON parsers need an option for it). A ``Table`` value is written as
``{"__table__": {"columns": [...], "rows": [[...]], "index": [...], "heatmap": name|null}}``
so ``python -m areal_stream.replay`` can rebuild it. The journal is written synchronously by
``StatsLogger.commit`` and flushed after every step, before any backend sees the step.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import IO, Any

from areal_stream._backends._base import StepRecord
from areal_stream._table import Table

JOURNAL_NAME = "stats.jsonl"


def _default(obj: object) -> Any:
    if isinstance(obj, Table):
        return {
            "__table__": {
                "columns": list(obj.columns),
                "rows": [list(r) for r in obj.rows],
                "index": list(obj.index),
                "heatmap": obj.heatmap,
            }
        }
    raise TypeError(f"cannot write {type(obj).__name__} to the journal")


def encode_record(record: StepRecord) -> str:
    """One journal line (no trailing newline)."""
    return json.dumps(
        {
            "global_step": record.global_step,
            "step": record.step,
            "epoch": record.epoch,
            "epoch_step": record.epoch_step,
            "stats": record.stats,
        },
        default=_default,
        separators=(",", ":"),
    )


def _decode_value(key: str, value: Any) -> Any:
    if isinstance(value, dict):
        body = value.get("__table__")
        if not isinstance(body, dict) or len(value) != 1:
            raise ValueError(f"stats[{key!r}] is an object but not a __table__")
        return Table(
            body["columns"],
            body["rows"],
            index=body.get("index") or (),
            heatmap=body.get("heatmap"),
        )
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"stats[{key!r}] is not a number: {value!r}")
    return value


def decode_line(line: str) -> StepRecord:
    """Parse one journal line; ``ValueError`` says what is wrong with it."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError("a journal line must be a JSON object")
    fields = {}
    for name in ("global_step", "step", "epoch", "epoch_step"):
        v = obj.get(name)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"field {name!r} must be an integer, got {v!r}")
        fields[name] = v
    stats = obj.get("stats")
    if not isinstance(stats, dict):
        raise ValueError("field 'stats' must be an object")
    return StepRecord(
        stats={k: _decode_value(k, v) for k, v in stats.items()},
        **fields,
    )


def read_journal(path: str | os.PathLike[str]) -> Iterator[StepRecord]:
    """Every record of a journal, in file order; blank lines skipped. A bad line raises
    ``ValueError`` with its line number."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield decode_line(line)
            except (ValueError, TypeError, KeyError) as e:
                raise ValueError(f"{os.fspath(path)}:{n}: {e}") from None


class JournalWriter:
    """Appends records to ``<log_dir>/stats.jsonl`` (appending keeps a resumed run's lines)."""

    def __init__(self, log_dir: str) -> None:
        os.makedirs(log_dir, exist_ok=True)
        self.path = os.path.join(log_dir, JOURNAL_NAME)
        self._f: IO[str] | None = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def write(self, record: StepRecord) -> None:
        if self._f is None:
            raise RuntimeError("the journal is closed")
        self._f.write(encode_record(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

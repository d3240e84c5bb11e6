"""The JSONL journal: ``<log_dir>/stats.jsonl``, one line per committed step, the record of truth.

Line format (fixed; other tools read it)::

    {"global_step": N, "step": S, "epoch": E, "epoch_step": ES, "stats": {key: value}}

``step`` is the step the backends logged. Values are JSON numbers; NaN and +-inf are written
as the bare tokens ``NaN``, ``Infinity``, ``-Infinity`` (Python's ``json`` reads them back;
strict JSON parsers need an option for it). A ``Table`` value is written as
``{"__table__": {"columns": [...], "rows": [[...]], "index": [...], "heatmap": name|null}}``
so ``python -m areal_stream.replay`` can rebuild it. The journal is written synchronously by
``StatsLogger.commit`` and flushed after every step, before any backend sees the step.

A process killed while writing a line leaves a torn last line (no trailing newline). Readers
(``read_journal``) skip such a line and report it; ``JournalWriter`` cuts it off (with a
warning giving its size) before appending, so a resumed run's first record is not glued to it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from typing import IO, Any

from areal_stream._backends._base import StepRecord
from areal_stream._table import Table

JOURNAL_NAME = "stats.jsonl"

logger = logging.getLogger("areal_stream.stats_logger")


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


def read_journal(
    path: str | os.PathLike[str],
    on_torn_tail: Callable[[int, str], None] | None = None,
) -> Iterator[StepRecord]:
    """Every record of a journal, in file order; blank lines skipped. A bad line raises
    ``ValueError`` with its line number, except a torn last line (no trailing newline, does
    not parse: the writer was killed mid-line), which is skipped and reported to
    ``on_torn_tail(line_number, reason)`` (default: a warning on this module's logger)."""
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield decode_line(line)
            except (ValueError, TypeError, KeyError) as e:
                if line.endswith("\n"):
                    raise ValueError(f"{os.fspath(path)}:{n}: {e}") from None
                reason = f"torn last line ({len(line)} chars, no newline) skipped: {e}"
                if on_torn_tail is None:
                    logger.warning("%s:%d: %s", os.fspath(path), n, reason)
                else:
                    on_torn_tail(n, reason)


def _repair_tail(path: str) -> None:
    """Make sure the journal ends with a newline before appending: a torn last line (the
    writer was killed mid-line) is cut off with a warning; a complete record that only lacks
    its newline gets one."""
    try:
        f = open(path, "rb+")  # noqa: SIM115
    except FileNotFoundError:
        return
    with f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        start = size
        while start > 0:  # find the start of the last line, reading backwards
            step = min(65536, start)
            f.seek(start - step)
            cut = f.read(step).rfind(b"\n")
            if cut >= 0:
                start = start - step + cut + 1
                break
            start -= step
        f.seek(start)
        tail = f.read()
        try:
            decode_line(tail.decode("utf-8"))
        except (ValueError, TypeError, KeyError, UnicodeDecodeError):
            f.truncate(start)
            logger.warning(
                "%s: cut off a torn last line of %d bytes (a previous run was killed while "
                "writing it; that step was never fully committed)",
                path,
                len(tail),
            )
            return
        f.seek(size)
        f.write(b"\n")


class JournalWriter:
    """Appends records to ``<log_dir>/stats.jsonl`` (appending keeps a resumed run's lines)."""

    def __init__(self, log_dir: str) -> None:
        os.makedirs(log_dir, exist_ok=True)
        self.path = os.path.join(log_dir, JOURNAL_NAME)
        _repair_tail(self.path)
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

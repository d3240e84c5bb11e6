"""``StatsLogger``: AReaL's commit API, fanning each committed step out to logging backends.

::

    from areal_stream import StatsLogger
    from areal_stream.config import load_config

    logger = StatsLogger(load_config("run.yaml"))
    logger.commit(epoch, epoch_step, global_step, stats)   # stats: dict or list of dicts
    state = logger.state_dict(); logger.load_state_dict(state)
    logger.close()

Behaviour:

- Only rank 0 logs: when ``torch.distributed`` is initialised and this rank is not 0 (at
  construction or at a commit), the logger is a no-op and creates no files.
- ``commit`` drops ``__count`` keys, logs at ``step = max(global_step, last_step + 1)``
  (``last_step`` starts at -1, so global step 0 logs at step 0); a list of dicts takes
  consecutive steps. ``state_dict()`` / ``load_state_dict()`` carry ``last_commit_step``
  (AReaL's key) across a resume so steps stay monotonic.
- The JSONL journal ``<log_dir>/stats.jsonl`` is written and flushed synchronously first: it
  is the record of truth. Then each backend (TensorBoard, W&B, SwanLab, Trackio, console,
  plus ``extra_backends``) gets the step on its own thread through its own bounded queue
  (``queue_size``), so ``commit`` never waits on a backend and is safe to call from an
  asyncio event loop. A backend that raises or hangs is isolated: its error is logged once
  per kind, steps it cannot take are dropped for it alone, and from the next committed step
  on the cumulative counts appear as ``committer/<backend>/errors`` and
  ``committer/<backend>/dropped`` (only for backends that had a problem).
- Values: numbers (``bool`` -> 0/1, numpy scalars and one-element tensors via ``.item()``)
  and ``areal_stream.Table``; NaN and +-inf are logged as they are. Anything else raises
  ``TypeError`` naming the key, before anything of that commit is written.
- ``flush(timeout)`` waits until every backend has taken and flushed what was committed;
  ``close()`` does that with ``close_timeout`` seconds per backend (concurrently), then
  finishes each run (``await aclose()`` from an event loop). Call ``close()``: backend threads
  are daemons, so steps still queued at interpreter exit without it reach only the journal.
- ``statistics()`` gives each backend's counters (logged, errors, dropped, queued, state).
  One ``StatsLogger`` is meant to be driven from one thread (or one event loop).
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from areal_stream._backends import Backend, StepRecord, create_backends
from areal_stream._backends.jsonl import JournalWriter
from areal_stream._fanout import Fanout, WorkerStatistics
from areal_stream._table import Table
from areal_stream.config import StatsLoggerConfig, load_config, validate

__all__ = ["StatsLogger"]

logger = logging.getLogger("areal_stream.stats_logger")

_CELL_TYPES = (str, int, float, bool, type(None))
_PLAIN_CELLS = frozenset(_CELL_TYPES)


def _dist_rank() -> int | None:
    """This process's torch.distributed rank, or None when not initialised (never imports
    torch: if torch.distributed was not imported, no group can exist)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    try:
        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:
        return None
    return None


def _as_config(config: Any) -> StatsLoggerConfig:
    if isinstance(config, StatsLoggerConfig):
        return validate(config)
    if isinstance(config, (str, os.PathLike, Mapping)):
        return load_config(config)
    inner = getattr(config, "stats_logger", None)  # AReaL passes the whole experiment config
    if inner is not None and dataclasses.is_dataclass(inner) and not isinstance(inner, type):
        if isinstance(inner, StatsLoggerConfig):
            return validate(inner)
        return load_config(dataclasses.asdict(inner))
    raise TypeError(
        "StatsLogger expects a StatsLoggerConfig, a mapping or YAML path for load_config, "
        f"or a config with a .stats_logger block; got {type(config).__name__}"
    )


def _size(value: Any) -> int | None:
    """Element count of an array/tensor-like value (``numel()`` or ``.size``), else None."""
    numel = getattr(value, "numel", None)
    if callable(numel):
        n = numel()
    else:
        n = getattr(value, "size", None)
        if callable(n):
            n = n()
    return n if isinstance(n, int) else None


def _scalar(value: Any) -> Any:
    """Python number for numpy scalars / one-element arrays and tensors, else unchanged."""
    item = getattr(value, "item", None)
    if item is None or isinstance(value, (int, float)):
        return value
    if _size(value) not in (None, 1):
        return value
    return item()


def _normalise(key: Any, value: Any) -> Any:
    if not isinstance(key, str) or not key:
        raise TypeError(f"stats keys must be non-empty strings, got {key!r}")
    cls = type(value)
    if cls is float or cls is int:  # the common case, kept cheap
        return value
    value = _scalar(value)
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, Table):
        return _normalise_table(key, value)
    what = type(value).__name__
    n = _size(value)
    if n is not None:
        what += f" with {n} elements (log one number: reduce it, or use a Table)"
    raise TypeError(f"stats[{key!r}] must be a number or an areal_stream.Table, got {what}")


def _normalise_table(key: str, table: Table) -> Table:
    changed = False
    rows = []
    for r, row in enumerate(table.rows):
        out = []
        for c, cell in enumerate(row):
            if type(cell) in _PLAIN_CELLS:
                out.append(cell)
                continue
            cell2 = _scalar(cell)
            if not isinstance(cell2, _CELL_TYPES):
                raise TypeError(
                    f"stats[{key!r}] Table cell (row {r}, column {table.columns[c]!r}) must be "
                    f"a number, string, bool or None, got {type(cell).__name__}"
                )
            changed = changed or cell2 is not cell
            out.append(cell2)
        rows.append(out)
    if not changed:
        return table
    return Table(table.columns, rows, index=table.index, heatmap=table.heatmap)


class StatsLogger:
    """Commits steps to the journal and every enabled backend (rank 0 only).

    ``config``: a ``StatsLoggerConfig``, a mapping or YAML path (``load_config``), or an
    object with a ``.stats_logger`` dataclass (AReaL's experiment config). ``ft_spec``
    (optional, AReaL's ``FinetuneSpec``) adds an "Epoch e/E Step s/S" INFO line per commit.
    ``extra_backends``: more ``Backend`` objects fed like the built-in ones.
    """

    def __init__(
        self,
        config: Any,
        ft_spec: Any = None,
        *,
        extra_backends: Sequence[tuple[str, Backend]] = (),
    ) -> None:
        self.config = _as_config(config)
        self.ft_spec = ft_spec
        self._last_commit_step = -1
        self._closed = False
        rank = _dist_rank()
        self._active = rank in (None, 0)
        self.log_dir = self.config.log_dir()
        self._journal: JournalWriter | None = None
        self._fanout: Fanout | None = None
        if not self._active:
            return
        names = set()
        for name, backend in extra_backends:
            if not isinstance(name, str) or not name or "/" in name:
                raise ValueError(f"extra backend name must be a plain string, got {name!r}")
            if not callable(getattr(backend, "log", None)):
                raise TypeError(f"extra backend {name!r} has no log() method")
            if name in names:  # counters and statistics() are keyed by name
                raise ValueError(f"extra backend name {name!r} is given twice")
            names.add(name)
        backends = create_backends(self.config, self.log_dir)  # objects only: no I/O yet
        clash = names & {n for n, _ in backends}
        if clash:
            raise ValueError(f"extra backend name(s) {sorted(clash)} clash with built-in ones")
        self._journal = JournalWriter(self.log_dir)
        self._fanout = Fanout([*backends, *extra_backends], self.config.queue_size)

    # ---------------------------------------------------------------------------- API

    @property
    def journal_path(self) -> str | None:
        """``<log_dir>/stats.jsonl`` on the logging rank, else ``None``."""
        return self._journal.path if self._journal is not None else None

    @property
    def backends(self) -> list[str]:
        """Names of the backends steps fan out to (the journal not included)."""
        return [] if self._fanout is None else [w.name for w in self._fanout.workers]

    def commit(
        self,
        epoch: int,
        step: int,
        global_step: int,
        data: Mapping[str, Any] | Iterable[Mapping[str, Any]],
    ) -> None:
        """Log ``data`` (a dict, or a list of dicts for consecutive steps) for this step.
        ``step`` is the step within the epoch (AReaL's argument order)."""
        if not self._active:
            return
        rank = _dist_rank()
        if rank not in (None, 0):
            return
        if self._closed:
            raise RuntimeError("StatsLogger.commit() after close()")
        try:
            epoch, step, global_step = (operator.index(v) for v in (epoch, step, global_step))
        except TypeError:
            raise TypeError(
                f"epoch, step and global_step must be integers, got "
                f"{epoch!r}, {step!r}, {global_step!r}"
            ) from None
        if isinstance(data, Mapping):
            items: list[Any] = [data]
        elif isinstance(data, Iterable) and not isinstance(data, (str, bytes)):
            items = list(data)
        else:
            raise TypeError(
                f"commit data must be a dict or a list of dicts, got {type(data).__name__}"
            )
        batches: list[dict[str, Any]] = []
        for i, item in enumerate(items):
            if not isinstance(item, Mapping):
                raise TypeError(
                    f"commit data must be a dict or a list of dicts; item {i} is "
                    f"{type(item).__name__}"
                )
            batches.append(
                {k: _normalise(k, v) for k, v in item.items() if not str(k).endswith("__count")}
            )
        if not batches:
            return
        if self.ft_spec is not None:
            self._log_progress(epoch, step, global_step)
        assert self._journal is not None and self._fanout is not None
        log_step = max(global_step, self._last_commit_step + 1)
        for i, stats in enumerate(batches):
            for name, (errors, dropped) in self._fanout.counters().items():
                if errors or dropped:
                    stats[f"committer/{name}/errors"] = errors
                    stats[f"committer/{name}/dropped"] = dropped
            record = StepRecord(log_step + i, global_step, epoch, step, stats)
            self._journal.write(record)
            self._last_commit_step = log_step + i
            self._fanout.submit(record)

    def state_dict(self) -> dict[str, int]:
        return {"last_commit_step": self._last_commit_step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping) or "last_commit_step" not in state:
            raise ValueError(f"expected a mapping with 'last_commit_step', got {state!r}")
        value = state["last_commit_step"]
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"last_commit_step must be an integer, got {value!r}")
        self._last_commit_step = value

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every backend took and flushed all committed steps; ``False`` if some
        backend did not within ``timeout`` seconds in total (default: ``close_timeout``, so
        a hung backend cannot hang the caller)."""
        if self._fanout is None:
            return True
        return self._fanout.flush(self.config.close_timeout if timeout is None else timeout)

    def statistics(self) -> dict[str, WorkerStatistics]:
        """Per-backend counters: logged, errors, dropped, queued, state."""
        if self._fanout is None:
            return {}
        return {w.name: w.statistics() for w in self._fanout.workers}

    def close(self) -> None:
        """Flush what is queued (``close_timeout`` seconds per backend, concurrently), finish
        every backend, close the journal. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._fanout is not None:
                self._fanout.close(self.config.close_timeout)
        finally:
            if self._journal is not None:
                self._journal.close()

    async def aclose(self) -> None:
        """``close()`` on a worker thread, for callers inside an event loop."""
        import asyncio

        await asyncio.to_thread(self.close)

    def __enter__(self) -> StatsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _log_progress(self, epoch: int, step: int, global_step: int) -> None:
        spec = self.ft_spec
        logger.info(
            "Epoch %d/%s Step %d/%s Train step %d/%s done.",
            epoch + 1,
            getattr(spec, "total_train_epochs", "?"),
            step + 1,
            getattr(spec, "steps_per_epoch", "?"),
            global_step + 1,
            getattr(spec, "total_train_steps", "?"),
        )

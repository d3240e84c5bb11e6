"""Console backend: a compact per-step table on stdout.

::

    step 12  (global_step 12, epoch 0, epoch_step 12)  3 stats
      ppo_actor/loss        0.0123
      rollout/reward        0.5
      timeperf/train_step   1.23

Keys in sorted order, numbers with ``%.6g`` (ints as they are, NaN/inf as ``nan``/``inf``).
``console.max_rows`` > 0 cuts the table there and says how many rows were left out.
Tables are not printed (a one-time note per key says so). The stream is looked up at each
write, so redirected/captured stdout works.
"""

from __future__ import annotations

import sys
from typing import TextIO

from areal_stream._backends._base import Backend, NoteOnce, StepRecord
from areal_stream._table import Table


def _fmt(value: float | int) -> str:
    return str(value) if isinstance(value, int) else f"{value:.6g}"


def format_step(record: StepRecord, max_rows: int = 0) -> str:
    """The console text of one step (no trailing newline)."""
    items = sorted((k, v) for k, v in record.stats.items() if not isinstance(v, Table))
    head = (
        f"step {record.step}  (global_step {record.global_step}, epoch {record.epoch}, "
        f"epoch_step {record.epoch_step})  {len(items)} stats"
    )
    shown = items if max_rows <= 0 else items[:max_rows]
    width = max((len(k) for k, _ in shown), default=0)
    lines = [head, *(f"  {k.ljust(width)}  {_fmt(v)}" for k, v in shown)]
    if len(shown) < len(items):
        lines.append(f"  ... {len(items) - len(shown)} more")
    return "\n".join(lines)


class ConsoleBackend(Backend):
    name = "console"

    def __init__(self, max_rows: int = 0, stream: TextIO | None = None) -> None:
        self.max_rows = max_rows
        self._stream = stream
        self._note = NoteOnce(self.name)

    def log(self, record: StepRecord) -> None:
        for key, value in record.stats.items():
            if isinstance(value, Table):
                self._note(f"table:{key}", f"Table {key!r} is not printed on the console")
        stream = self._stream if self._stream is not None else sys.stdout
        stream.write(format_step(record, self.max_rows) + "\n")

    def flush(self) -> None:
        stream = self._stream if self._stream is not None else sys.stdout
        stream.flush()

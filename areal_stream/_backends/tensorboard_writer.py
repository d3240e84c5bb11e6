"""TensorBoard backend: event files written with ``tensorboard``'s own ``EventFileWriter``
(what ``torch.utils.tensorboard`` uses underneath), so logging does not import torch.

Scalars are stored by TensorBoard as float32 (``simple_value``): compare with
``np.float32(x)``; integers above 2**24 lose precision there (the journal keeps them exact).
NaN and +-inf are stored as they are. One event per step carries all of the step's values.

Tables: a Table with ``heatmap`` set is drawn as an 8-bit grayscale image under the table's
key, rows = first index value, columns = second index value, both in sorted order; each
pixel is ``round(255 * v / vmax)`` where ``vmax`` is the largest finite cell of the heatmap
column (all 0 when ``vmax <= 0``; missing, negative or non-finite cells are 0). Other Tables
are skipped with a one-time note per key.
"""

from __future__ import annotations

import struct
import time
import zlib
from typing import Any

from areal_stream._backends._base import (
    Backend,
    NoteOnce,
    StepRecord,
    heatmap_pixels,
    missing_package,
)
from areal_stream._table import Table


def png_gray8(pixels: list[list[int]]) -> bytes:
    """Encode rows of 0..255 ints as an 8-bit grayscale PNG (filter 0 on every row)."""
    height = len(pixels)
    width = len(pixels[0]) if height else 0

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data))
            + kind
            + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
        )

    raw = b"".join(b"\x00" + bytes(row) for row in pixels)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )


class TensorBoardBackend(Backend):
    name = "tensorboard"

    def __init__(self, path: str, flush_secs: float = 10.0) -> None:
        self.path = path
        self._flush_secs = flush_secs
        self._writer: Any = None
        self._note = NoteOnce(self.name)

    def open(self) -> None:
        try:
            from tensorboard.compat.proto import event_pb2, summary_pb2
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError:
            raise missing_package(self.name, "tensorboard") from None
        self._event_pb2 = event_pb2
        self._summary_pb2 = summary_pb2
        self._writer = EventFileWriter(self.path, flush_secs=self._flush_secs)

    def log(self, record: StepRecord) -> None:
        summary = self._summary_pb2.Summary
        values: list[Any] = []
        for key, value in record.stats.items():
            if isinstance(value, Table):
                if value.heatmap is None or not value.rows:
                    self._note(
                        f"table:{key}",
                        f"Table {key!r} has no heatmap column; TensorBoard skips it",
                    )
                    continue
                _, _, pixels = heatmap_pixels(value)
                image = summary.Image(
                    height=len(pixels),
                    width=len(pixels[0]),
                    colorspace=1,
                    encoded_image_string=png_gray8(pixels),
                )
                values.append(summary.Value(tag=key, image=image))
            else:
                values.append(summary.Value(tag=key, simple_value=float(value)))
        if values:
            event = self._event_pb2.Event(
                wall_time=time.time(), step=record.step, summary=summary(value=values)
            )
            self._writer.add_event(event)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

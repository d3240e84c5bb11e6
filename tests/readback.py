"""Read back what each logging backend wrote, for tests that compare value by value.

``from readback import ...`` (tests/ is on sys.path via conftest). Every reader takes the
directory the backend wrote to and returns plain Python data:

- ``read_jsonl(path)`` -> list of journal dicts (NaN/inf kept as floats).
- ``read_tensorboard_scalars(dir)`` -> ``{tag: {step: float}}`` (values were float32 on disk:
  compare with ``float(np.float32(x))``); ``read_tensorboard_images(dir)`` -> ``{tag: {step:
  uint8 ndarray}}`` (PNG decoded with PIL; grayscale images are 2-D).
- ``read_wandb_history(root)`` -> ``{step: {key: value}}`` merged per step, from the offline
  run file under ``root`` (``<root>/wandb/offline-run-*/run-*.wandb``), after waiting for the
  run's ``exit`` record (``run.finish()`` may return before the file holds everything);
  ``root`` may also be the ``.wandb`` file itself (when a dir holds several runs).
  ``read_wandb_config(root)``, ``read_wandb_run(root)`` (id/project/name),
  ``read_wandb_table(root, history_row, key)`` (the table a history row points to),
  ``read_wandb_artifact_table(root, name)`` (the rows of a ``run_table`` artifact).
- ``read_swanlab_scalars(logdir)`` -> ``{key: {step: float}}`` from
  ``<logdir>/run-*/run-*.swanlab`` (or that file's path) via swanlab's ``DataStoreReader``;
  ``read_swanlab_config(logdir)`` -> the run's ``files/config.yaml`` as a dict.
- ``read_trackio_logs(trackio_dir, project, run)`` -> list of ``{"step": s, **metrics}`` rows
  read with sqlite3 from ``<trackio_dir>/<project>.db`` (no trackio import, so it does not
  depend on ``TRACKIO_DIR`` at import time); trackio's "NaN"/"Infinity" strings are floats.
- ``nan_equal(a, b)``: equality where NaN equals NaN.
"""

from __future__ import annotations

import glob
import io
import json
import math
import os
import sqlite3
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "find_one",
    "leveldb_log_records",
    "nan_equal",
    "read_jsonl",
    "read_swanlab_config",
    "read_swanlab_scalars",
    "read_tensorboard_images",
    "read_tensorboard_scalars",
    "read_trackio_logs",
    "read_wandb_artifact_table",
    "read_wandb_config",
    "read_wandb_history",
    "read_wandb_records",
    "read_wandb_run",
    "read_wandb_table",
]


def nan_equal(a: Any, b: Any) -> bool:
    """``a == b``, with NaN equal to NaN (for floats, also inside lists/dicts)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(nan_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(nan_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


def find_one(pattern: str) -> str:
    """The single path matching a recursive glob (AssertionError when not exactly one)."""
    hits = sorted(glob.glob(pattern, recursive=True))
    assert len(hits) == 1, f"expected one match for {pattern}, found {hits}"
    return hits[0]


# ------------------------------------------------------------------------------- JSONL


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ------------------------------------------------------------------------- TensorBoard


def _accumulator(logdir: str | os.PathLike[str]) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(
        os.fspath(logdir), size_guidance={"scalars": 0, "images": 0, "tensors": 0}
    )
    acc.Reload()
    return acc


def read_tensorboard_scalars(logdir: str | os.PathLike[str]) -> dict[str, dict[int, float]]:
    acc = _accumulator(logdir)
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def read_tensorboard_images(logdir: str | os.PathLike[str]) -> dict[str, dict[int, np.ndarray]]:
    from PIL import Image

    acc = _accumulator(logdir)
    out: dict[str, dict[int, np.ndarray]] = {}
    for tag in acc.Tags()["images"]:
        out[tag] = {
            e.step: np.asarray(Image.open(io.BytesIO(e.encoded_image_string)))
            for e in acc.Images(tag)
        }
    return out


# ---------------------------------------------------------- LevelDB-log framed files


def leveldb_log_records(path: str | os.PathLike[str], ident: bytes) -> Iterator[bytes]:
    """Payloads of a LevelDB-log framed file (W&B ``.wandb``, SwanLab ``.swanlab``): a 7-byte
    header starting with ``ident``, then 32 KiB blocks of ``<crc32:u32><len:u16><type:u8>``
    chunks (FULL=1 FIRST=2 MIDDLE=3 LAST=4; crc over type byte + payload). Stops at the
    first incomplete chunk (a file still being written)."""
    data = Path(path).read_bytes()
    if data[:4] != ident:
        raise ValueError(f"{path}: header {data[:4]!r}, expected {ident!r}")
    block = 32768
    pos = 7
    pending = b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left  # zero padding to the end of the block
            continue
        payload = data[pos + 7 : pos + 7 + length]
        if len(payload) < length:
            break
        if zlib.crc32(bytes([kind]) + payload) & 0xFFFFFFFF != crc:
            raise ValueError(f"{path}: bad chunk checksum at offset {pos}")
        pos += 7 + length
        if kind == 1:
            yield payload
        elif kind == 2:
            pending = payload
        elif kind == 3:
            pending += payload
        elif kind == 4:
            yield pending + payload
            pending = b""


# ---------------------------------------------------------------------------------- W&B


def _wandb_file(root: str | os.PathLike[str]) -> str:
    root = os.fspath(root)
    if root.endswith(".wandb"):
        return root
    return find_one(os.path.join(root, "**", "offline-run-*", "run-*.wandb"))


def read_wandb_records(root: str | os.PathLike[str], wait_exit: float = 15.0) -> list[Any]:
    """Every ``Record`` of the offline run under ``root``, once its ``exit`` record is on disk
    (polls the file up to ``wait_exit`` seconds: wandb-core writes it asynchronously)."""
    from wandb.proto import wandb_internal_pb2 as pb

    path = _wandb_file(root)
    deadline = time.monotonic() + wait_exit
    while True:
        records = []
        for payload in leveldb_log_records(path, b":W&B"):
            rec = pb.Record()  # type: ignore[attr-defined]
            rec.ParseFromString(payload)
            records.append(rec)
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        if time.monotonic() > deadline:
            raise AssertionError(f"{path}: no exit record after {wait_exit}s")
        time.sleep(0.05)


def _item_key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


def read_wandb_history(
    root: str | os.PathLike[str], include_internal: bool = False
) -> dict[int, dict[str, Any]]:
    """``{step: {key: value}}``; values JSON-decoded (``1.0`` reads back as ``1``). Keys
    starting with ``_`` (``_step``, ``_runtime``...) only with ``include_internal``."""
    out: dict[int, dict[str, Any]] = {}
    for rec in read_wandb_records(root):
        if rec.WhichOneof("record_type") != "history":
            continue
        row = out.setdefault(rec.history.step.num, {})
        for item in rec.history.item:
            key = _item_key(item)
            if include_internal or not key.startswith("_"):
                row[key] = json.loads(item.value_json)
    return out


def read_wandb_config(root: str | os.PathLike[str]) -> dict[str, Any]:
    """The run's config (run record plus later config updates), values JSON-decoded."""
    cfg: dict[str, Any] = {}
    for rec in read_wandb_records(root):
        kind = rec.WhichOneof("record_type")
        items = rec.run.config.update if kind == "run" else rec.config.update
        if kind in ("run", "config"):
            for item in items:
                cfg[_item_key(item)] = json.loads(item.value_json)
    return cfg


def read_wandb_run(root: str | os.PathLike[str]) -> dict[str, str]:
    for rec in read_wandb_records(root):
        if rec.WhichOneof("record_type") == "run":
            r = rec.run
            return {
                "id": r.run_id,
                "project": r.project,
                "name": r.display_name,
                "group": r.run_group,
            }
    raise AssertionError("no run record")


def read_wandb_table(
    root: str | os.PathLike[str], row: dict[str, Any], key: str, wait: float = 15.0
) -> dict[str, Any]:
    """The table logged under ``key`` in history ``row`` (one value of
    ``read_wandb_history``): ``{"columns": [...], "data": [[...]]}`` from the run's
    ``files/media/table/*.table.json`` (polls ``wait`` seconds for the file)."""
    prefix_values = {k[len(key) + 1 :]: v for k, v in row.items() if k.startswith(key + "/")}
    assert prefix_values.get("_type") == "table-file", prefix_values
    run_dir = os.path.dirname(_wandb_file(root))
    path = os.path.join(run_dir, "files", prefix_values["path"])
    deadline = time.monotonic() + wait
    while not os.path.exists(path):  # written by wandb, possibly after log() returned
        if time.monotonic() > deadline:
            raise AssertionError(f"table file {path} not written after {wait}s")
        time.sleep(0.05)
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_wandb_artifact_table(root: str | os.PathLike[str], name: str) -> dict[str, Any]:
    """The table JSON of the ``run_table`` artifact ``name`` (``run-<id>-<key>``) of the
    offline run under ``root``, from the staged file its manifest points to."""
    for rec in read_wandb_records(root):
        if rec.WhichOneof("record_type") == "artifact" and rec.artifact.name == name:
            (entry,) = rec.artifact.manifest.contents
            with open(entry.local_path, encoding="utf-8") as f:
                return json.load(f)
    raise AssertionError(f"no artifact named {name!r}")


# ------------------------------------------------------------------------------ SwanLab


def read_swanlab_scalars(logdir: str | os.PathLike[str]) -> dict[str, dict[int, float]]:
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    path = os.fspath(logdir)
    if not path.endswith(".swanlab"):
        path = find_one(os.path.join(path, "run-*", "run-*.swanlab"))
    reader = DataStoreReader()
    reader.open(path)
    out: dict[str, dict[int, float]] = {}
    try:
        for payload in reader:
            rec = Record()
            rec.ParseFromString(payload)
            if rec.WhichOneof("record_type") == "scalar":
                out.setdefault(rec.scalar.key, {})[rec.scalar.step] = rec.scalar.value.number
    finally:
        reader.close()
    return out


def read_swanlab_config(logdir: str | os.PathLike[str]) -> dict[str, Any]:
    import yaml

    path = find_one(os.path.join(os.fspath(logdir), "run-*", "files", "config.yaml"))
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    assert isinstance(data, dict)
    return data


# ------------------------------------------------------------------------------ Trackio

_SPECIAL = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def read_trackio_logs(
    trackio_dir: str | os.PathLike[str], project: str, run: str
) -> list[dict[str, Any]]:
    """Rows of ``metrics`` for one run, in insertion order: ``{"step": s, **metrics}``."""
    path = os.path.join(os.fspath(trackio_dir), f"{project}.db")
    assert os.path.exists(path), f"no trackio database at {path}"
    con = sqlite3.connect(path)
    try:
        rows = con.execute(
            "SELECT step, metrics FROM metrics WHERE run_name = ? ORDER BY id", (run,)
        ).fetchall()
    finally:
        con.close()
    out = []
    for step, metrics in rows:
        values = json.loads(metrics)
        values = {k: _SPECIAL.get(v, v) if isinstance(v, str) else v for k, v in values.items()}
        out.append({"step": step, **values})
    return out

"""The wire codec: versioned msgpack frames, validated against a fixed schema.

Every frame is one msgpack map ``{"v": 1, "t": <kind>, ...}``. Decoding never executes or
unpickles anything: msgpack ext types are refused, every container and string is bounded,
and each message is checked field by field before it reaches the controller. Any problem
raises :class:`DecodeError` with a short ``reason`` the controller counts by.

Producer frames (worker / trainer -> controller, one ZMQ PUSH stream per producer):

- ``hello``  first frame of an incarnation (``hb``: the producer's heartbeat interval)
- ``batch``  folded records ``{key: [rtype, sum, weight, min, max]}``, an event count and
  an optional ``mark`` (the step whose seal this batch answers: everything the producer
  recorded before the mark is in this batch or an earlier one)
- ``hb``     heartbeat, ``bye`` clean close
- ``train``  one training step's exported stats (numbers and tagged tables)

Controller frames (control PUB): ``seal`` (step), ``committed`` (step), ``welcome`` (answer
to a hello, with the controller's frame limits), ``byeack``.

A table travels as the tagged map ``{"__table__": 1, "columns", "rows", "index",
"heatmap"}``; :func:`decode` returns it as :class:`TableData` so ``bus`` never needs the
user-facing ``Table`` class.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from bus._aggregate import Record, ReduceType

VERSION = 1
DEFAULT_MAX_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_KEYS = 100_000
MAX_KEY_LEN = 1024
MAX_ID_LEN = 256
MAX_TABLE_CELLS = 1_000_000
MAX_WEIGHT = 2.0**53
"""A record's weight counts elements; past 2**53 a float64 count is no longer exact (and a
weight near the float limit would overflow to inf when two records merge)."""

_RTYPES = frozenset(int(r) for r in ReduceType)
_NUM = (int, float)


class DecodeError(ValueError):
    """A frame that is not a valid message; ``reason`` names the category for counters."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class TableData:
    """A table value in transit (rebuilt as ``areal_stream.Table`` by the receiver)."""

    columns: tuple[str, ...]
    rows: tuple[tuple[Any, ...], ...]
    index: tuple[str, ...] = ()
    heatmap: str | None = None


StatValue = float | int | bool | TableData


@dataclass(frozen=True)
class Header:
    """Who sent a producer frame: id, incarnation and the frame's sequence number."""

    src: str
    inc: str
    seq: int
    role: str = "rollout"


@dataclass(frozen=True)
class Hello:
    head: Header
    heartbeat: float


@dataclass(frozen=True)
class Batch:
    head: Header
    records: dict[str, tuple[int, Record]]
    events: int
    mark: int | None = None


@dataclass(frozen=True)
class Heartbeat:
    head: Header


@dataclass(frozen=True)
class Bye:
    head: Header


@dataclass(frozen=True)
class Train:
    head: Header
    step: int
    epoch: int
    epoch_step: int
    stats: dict[str, StatValue] = field(default_factory=dict)


@dataclass(frozen=True)
class Seal:
    step: int


@dataclass(frozen=True)
class Committed:
    step: int


@dataclass(frozen=True)
class ByeAck:
    src: str
    inc: str


@dataclass(frozen=True)
class Welcome:
    """The controller has registered this producer (answer to ``hello``). ``max_bytes`` and
    ``max_keys`` are its limits per frame, so producers split their batches to fit (a larger
    frame would be dropped by libzmq, one with more keys refused by the decoder)."""

    src: str
    inc: str
    max_bytes: int | None = None
    max_keys: int | None = None


Message = Hello | Batch | Heartbeat | Bye | Train | Seal | Committed | ByeAck | Welcome


# ----------------------------------------------------------------------------- encoding


def _pack(obj: dict[str, Any]) -> bytes:
    out: bytes = msgpack.packb(obj, use_bin_type=True)
    return out


def _head(h: Header, kind: str) -> dict[str, Any]:
    return {"v": VERSION, "t": kind, "src": h.src, "inc": h.inc, "seq": h.seq, "role": h.role}


def encode_hello(head: Header, heartbeat: float) -> bytes:
    d = _head(head, "hello")
    d["hb"] = float(heartbeat)
    return _pack(d)


def encode_batch(
    head: Header,
    records: dict[str, tuple[int, Record]],
    events: int,
    mark: int | None = None,
) -> bytes:
    """A batch of folded records; ``records`` maps key -> (reduce type, record)."""
    d = _head(head, "batch")
    d["r"] = {k: [int(rt), *rec] for k, (rt, rec) in records.items()}
    d["n"] = int(events)
    if mark is not None:
        d["mark"] = int(mark)
    return _pack(d)


def encode_heartbeat(head: Header) -> bytes:
    return _pack(_head(head, "hb"))


def encode_bye(head: Header) -> bytes:
    return _pack(_head(head, "bye"))


def _encode_value(key: str, v: Any) -> Any:
    if isinstance(v, bool):
        return v
    if isinstance(v, _NUM):
        return v
    cols = getattr(v, "columns", None)
    rows = getattr(v, "rows", None)
    if cols is not None and rows is not None:
        return {
            "__table__": 1,
            "columns": [str(c) for c in cols],
            "rows": [list(r) for r in rows],
            "index": [str(c) for c in getattr(v, "index", ())],
            "heatmap": getattr(v, "heatmap", None),
        }
    try:
        return float(v)  # numpy / 0-d tensor scalars
    except (TypeError, ValueError):
        raise TypeError(
            f"train stat {key!r} must be a number or a Table, got {type(v).__name__}"
        ) from None


def encode_train(
    head: Header, step: int, epoch: int, epoch_step: int, stats: dict[str, Any]
) -> bytes:
    """One training step's stats: numbers, or table-like objects (columns/rows/index/heatmap)."""
    d = _head(head, "train")
    d["step"] = int(step)
    d["epoch"] = int(epoch)
    d["estep"] = int(epoch_step)
    d["stats"] = {str(k): _encode_value(str(k), v) for k, v in stats.items()}
    return _pack(d)


def encode_seal(step: int) -> bytes:
    return _pack({"v": VERSION, "t": "seal", "step": int(step)})


def encode_committed(step: int) -> bytes:
    return _pack({"v": VERSION, "t": "committed", "step": int(step)})


def encode_byeack(src: str, inc: str) -> bytes:
    return _pack({"v": VERSION, "t": "byeack", "src": src, "inc": inc})


def encode_welcome(
    src: str, inc: str, max_bytes: int | None = None, max_keys: int | None = None
) -> bytes:
    d: dict[str, Any] = {"v": VERSION, "t": "welcome", "src": src, "inc": inc}
    if max_bytes is not None:
        d["mb"] = int(max_bytes)
    if max_keys is not None:
        d["mk"] = int(max_keys)
    return _pack(d)


# ----------------------------------------------------------------------------- decoding


def _refuse_ext(code: int, data: bytes) -> Any:
    raise DecodeError("schema", f"msgpack ext type {code} is not accepted")


def _int(d: dict[str, Any], k: str, lo: int = -(2**62), hi: int = 2**62) -> int:
    v = d.get(k)
    if type(v) is not int:
        raise DecodeError("schema", f"field {k!r} must be an int, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise DecodeError("schema", f"field {k!r}={v} out of range")
    return v


def _str(d: dict[str, Any], k: str, max_len: int = MAX_ID_LEN) -> str:
    v = d.get(k)
    if type(v) is not str or not v or len(v) > max_len:
        raise DecodeError("schema", f"field {k!r} must be a non-empty str <= {max_len} chars")
    return v


def _float(v: Any, what: str) -> float:
    if type(v) is float:
        return v
    if type(v) is int:
        return float(v)
    raise DecodeError("schema", f"{what} must be a number, got {type(v).__name__}")


def _decode_header(d: dict[str, Any], role_of_kind: str | None = None) -> Header:
    """The sender's header; ``role_of_kind`` is the only role this message kind may carry
    (a train report from a "rollout" producer would be waited on for marks it never sends)."""
    role = d.get("role", "rollout")
    if role not in ("rollout", "train"):
        raise DecodeError("schema", f"unknown role {role!r:.40}")
    if role_of_kind is not None and role != role_of_kind:
        raise DecodeError("schema", f"a {d.get('t')!r} frame must come from role {role_of_kind!r}")
    return Header(src=_str(d, "src"), inc=_str(d, "inc"), seq=_int(d, "seq", 0), role=role)


def _decode_records(raw: Any, max_keys: int) -> dict[str, tuple[int, Record]]:
    if type(raw) is not dict:
        raise DecodeError("schema", "field 'r' must be a map")
    if len(raw) > max_keys:
        raise DecodeError("too_many_keys", f"{len(raw)} keys > limit {max_keys}")
    out: dict[str, tuple[int, Record]] = {}
    for k, v in raw.items():
        if type(k) is not str or not k or len(k) > MAX_KEY_LEN:
            raise DecodeError("schema", f"record key {k!r:.60} is not a valid str")
        if type(v) is not list or len(v) != 5:
            raise DecodeError("schema", f"record {k!r} must be [rtype, sum, weight, min, max]")
        rt = v[0]
        if type(rt) is not int or rt not in _RTYPES:
            raise DecodeError("schema", f"record {k!r} has unknown reduce type {rt!r}")
        rec = [_float(x, f"record {k!r}") for x in v[1:]]
        w = rec[1]
        if not 0.0 <= w <= MAX_WEIGHT:  # also refuses NaN and inf
            raise DecodeError("schema", f"record {k!r} has invalid weight {w!r}")
        out[k] = (rt, rec)
    return out


def _decode_table(key: str, d: dict[Any, Any]) -> TableData:
    if set(d) != {"__table__", "columns", "rows", "index", "heatmap"} or d["__table__"] != 1:
        raise DecodeError("schema", f"stat {key!r}: malformed table")
    cols, rows, index, heat = d["columns"], d["rows"], d["index"], d["heatmap"]
    if type(cols) is not list or not all(type(c) is str for c in cols):
        raise DecodeError("schema", f"stat {key!r}: table columns must be strs")
    if len(set(cols)) != len(cols):
        raise DecodeError("schema", f"stat {key!r}: table columns must be unique")
    if type(index) is not list or not all(type(c) is str and c in cols for c in index):
        raise DecodeError("schema", f"stat {key!r}: table index must name columns")
    if heat is not None and (type(heat) is not str or heat not in cols or len(index) != 2):
        raise DecodeError(
            "schema", f"stat {key!r}: table heatmap must name a column, with two index columns"
        )
    if type(rows) is not list or len(rows) * max(len(cols), 1) > MAX_TABLE_CELLS:
        raise DecodeError("schema", f"stat {key!r}: table rows must be a bounded list")
    out_rows = []
    for r in rows:
        if type(r) is not list or len(r) != len(cols):
            raise DecodeError("schema", f"stat {key!r}: table row has wrong length")
        for c in r:
            if c is not None and type(c) not in (int, float, str, bool):
                raise DecodeError("schema", f"stat {key!r}: table cell of type {type(c)}")
        out_rows.append(tuple(r))
    return TableData(tuple(cols), tuple(out_rows), tuple(index), heat)


def _decode_stats(raw: Any, max_keys: int) -> dict[str, StatValue]:
    if type(raw) is not dict:
        raise DecodeError("schema", "field 'stats' must be a map")
    if len(raw) > max_keys:
        raise DecodeError("too_many_keys", f"{len(raw)} stats > limit {max_keys}")
    out: dict[str, StatValue] = {}
    for k, v in raw.items():
        if type(k) is not str or not k or len(k) > MAX_KEY_LEN:
            raise DecodeError("schema", f"stat key {k!r:.60} is not a valid str")
        if type(v) in (int, float, bool):
            out[k] = v
        elif type(v) is dict:
            out[k] = _decode_table(k, v)
        else:
            raise DecodeError("schema", f"stat {k!r} has type {type(v).__name__}")
    return out


def decode(
    frame: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES, max_keys: int = DEFAULT_MAX_KEYS
) -> Message:
    """Parse and validate one frame; raises :class:`DecodeError` on anything unexpected."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise TypeError(f"decode() takes bytes, got {type(frame).__name__}")
    n = len(frame)
    if n > max_bytes:
        raise DecodeError("too_large", f"{n} bytes > limit {max_bytes}")
    try:
        obj = msgpack.unpackb(
            frame,
            raw=False,
            use_list=True,
            strict_map_key=True,
            ext_hook=_refuse_ext,
            max_str_len=max(MAX_KEY_LEN, 64 * 1024),
            max_bin_len=0,
            max_array_len=max(MAX_TABLE_CELLS, 16),
            max_map_len=max_keys + 16,
            max_ext_len=0,
        )
    except DecodeError:
        raise
    except ValueError as e:  # includes msgpack's size-limit errors, ExtraData, bad utf-8
        if "exceeds max" in str(e) and "map" in str(e):
            raise DecodeError("too_many_keys", str(e)[:200]) from None
        raise DecodeError("garbage", f"{type(e).__name__}: {str(e)[:200]}") from None
    except Exception as e:  # msgpack raises assorted types for malformed input
        raise DecodeError("garbage", f"{type(e).__name__}: {str(e)[:200]}") from None
    if type(obj) is not dict:
        raise DecodeError("schema", f"frame is a {type(obj).__name__}, not a map")
    v = obj.get("v")
    if v != VERSION or type(v) is not int:
        raise DecodeError("version", f"unsupported version {v!r:.40}")
    t = obj.get("t")
    if t == "batch":
        mark = obj.get("mark")
        return Batch(
            head=_decode_header(obj, "rollout"),
            records=_decode_records(obj.get("r"), max_keys),
            events=_int(obj, "n", 0),
            mark=None if mark is None else _int(obj, "mark"),
        )
    if t == "hb":
        return Heartbeat(_decode_header(obj))
    if t == "hello":
        hb = _float(obj.get("hb"), "field 'hb'")
        if not 0.0 < hb < 3600.0:
            raise DecodeError("schema", f"heartbeat interval {hb} out of range")
        return Hello(_decode_header(obj), hb)
    if t == "bye":
        return Bye(_decode_header(obj))
    if t == "train":
        return Train(
            head=_decode_header(obj, "train"),
            step=_int(obj, "step"),
            epoch=_int(obj, "epoch"),
            epoch_step=_int(obj, "estep"),
            stats=_decode_stats(obj.get("stats"), max_keys),
        )
    if t == "seal":
        return Seal(_int(obj, "step"))
    if t == "committed":
        return Committed(_int(obj, "step"))
    if t == "byeack":
        return ByeAck(_str(obj, "src"), _str(obj, "inc"))
    if t == "welcome":
        mb = None if obj.get("mb") is None else _int(obj, "mb", 1)
        mk = None if obj.get("mk") is None else _int(obj, "mk", 1)
        return Welcome(_str(obj, "src"), _str(obj, "inc"), mb, mk)
    raise DecodeError("schema", f"unknown message type {t!r:.40}")

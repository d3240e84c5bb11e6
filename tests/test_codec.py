"""The wire codec: round trips, and every kind of bad frame rejected with a reason."""

from __future__ import annotations

import math
import pickle

import msgpack
import pytest

from areal_stream import Table
from bus import ReduceType
from bus._codec import (
    Batch,
    Bye,
    ByeAck,
    Committed,
    DecodeError,
    Header,
    Heartbeat,
    Hello,
    Seal,
    TableData,
    Train,
    Welcome,
    decode,
    encode_batch,
    encode_bye,
    encode_byeack,
    encode_committed,
    encode_heartbeat,
    encode_hello,
    encode_seal,
    encode_train,
    encode_welcome,
)

H = Header("w-1", "inc-a", 7)


def _reason(frame: bytes, **kw: int) -> str:
    with pytest.raises(DecodeError) as ei:
        decode(frame, **kw)
    return ei.value.reason


def test_batch_round_trip_keeps_every_reduce_type_and_nonfinite_values() -> None:
    recs = {
        "r/reward": (int(ReduceType.SCALAR), [3.5, 2.0, math.inf, -math.inf]),
        "adv": (int(ReduceType.AVG_MIN_MAX), [1.0, 4.0, -2.0, math.nan]),
        "n": (int(ReduceType.SUM), [math.inf, 1.0, 0.0, 0.0]),
    }
    msg = decode(encode_batch(H, recs, events=7, mark=12))
    assert isinstance(msg, Batch)
    assert msg.head == H and msg.events == 7 and msg.mark == 12
    assert msg.records["r/reward"] == (6, [3.5, 2.0, math.inf, -math.inf])
    assert math.isnan(msg.records["adv"][1][3])
    assert msg.records["n"][1][0] == math.inf
    assert decode(encode_batch(H, {}, 0)).mark is None  # type: ignore[union-attr]


def test_control_and_lifecycle_frames_round_trip() -> None:
    assert decode(encode_hello(H, 0.25)) == Hello(H, 0.25)
    assert decode(encode_heartbeat(H)) == Heartbeat(H)
    assert decode(encode_bye(H)) == Bye(H)
    assert decode(encode_seal(5)) == Seal(5)
    assert decode(encode_committed(9)) == Committed(9)
    assert decode(encode_byeack("w", "i")) == ByeAck("w", "i")
    assert decode(encode_welcome("w", "i")) == Welcome("w", "i", None)
    assert decode(encode_welcome("w", "i", 65536, 100)) == Welcome("w", "i", 65536, 100)


def test_train_round_trip_with_table_value() -> None:
    t = Table(
        ["layer", "expert", "tokens"],
        [[0, 0, 5], [0, 1, 7]],
        index=["layer", "expert"],
        heatmap="tokens",
    )
    th = Header("trainer", "x", 1, "train")
    msg = decode(
        encode_train(th, 4, epoch=1, epoch_step=2, stats={"loss": 0.5, "n": 3, "moe/loads": t})
    )
    assert isinstance(msg, Train)
    assert (msg.step, msg.epoch, msg.epoch_step) == (4, 1, 2)
    assert msg.stats["loss"] == 0.5 and msg.stats["n"] == 3
    assert msg.stats["moe/loads"] == TableData(
        ("layer", "expert", "tokens"), ((0, 0, 5), (0, 1, 7)), ("layer", "expert"), "tokens"
    )


def test_encode_train_rejects_non_numeric_values() -> None:
    with pytest.raises(TypeError, match="'bad'"):
        encode_train(H, 1, 0, 1, {"bad": "text"})


def test_garbage_and_truncated_frames() -> None:
    frame = encode_batch(H, {"k": (6, [1.0, 1.0, 1.0, 1.0])}, 1)
    assert _reason(b"\xc1\xff\x00garbage") == "garbage"
    assert _reason(frame[: len(frame) // 2]) == "garbage"
    assert _reason(frame + b"\x00") == "garbage"  # trailing bytes
    assert _reason(b"") == "garbage"


def test_pickles_and_ext_types_are_never_loaded() -> None:
    class Boom:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (print, ("executed!",))

    assert _reason(pickle.dumps(Boom())) in ("garbage", "schema")
    ext = msgpack.packb({"v": 1, "t": "hb", "x": msgpack.ExtType(1, b"abc")})
    assert _reason(ext) in ("garbage", "schema")
    binf = msgpack.packb({"v": 1, "t": "hb", "src": b"bytes"}, use_bin_type=True)
    assert _reason(binf) in ("garbage", "schema")


def test_wrong_types_and_versions() -> None:
    def pk(d: object) -> bytes:
        return msgpack.packb(d)

    base = {"v": 1, "t": "batch", "src": "w", "inc": "i", "seq": 1, "n": 1, "r": {}}
    assert isinstance(decode(pk(base)), Batch)
    assert _reason(pk([1, 2, 3])) == "schema"
    assert _reason(pk({**base, "v": 2})) == "version"
    assert _reason(pk({**base, "v": "1"})) == "version"
    assert _reason(pk({**base, "t": "exec"})) == "schema"
    assert _reason(pk({**base, "seq": "1"})) == "schema"
    assert _reason(pk({**base, "seq": -1})) == "schema"
    assert _reason(pk({**base, "src": ""})) == "schema"
    assert _reason(pk({**base, "role": "admin"})) == "schema"
    assert _reason(pk({**base, "r": []})) == "schema"
    assert _reason(pk({**base, "r": {"k": [6, 1.0, 1.0, 1.0]}})) == "schema"
    assert _reason(pk({**base, "r": {"k": [99, 1.0, 1.0, 1.0, 1.0]}})) == "schema"
    assert _reason(pk({**base, "r": {"k": [6, "1", 1.0, 1.0, 1.0]}})) == "schema"
    assert _reason(pk({**base, "r": {"k": [6, 1.0, -1.0, 1.0, 1.0]}})) == "schema"
    assert _reason(pk({**base, "r": {1: [6, 1.0, 1.0, 1.0, 1.0]}})) in ("schema", "garbage")
    train = {
        "v": 1,
        "t": "train",
        "src": "t",
        "inc": "i",
        "seq": 1,
        "step": 1,
        "epoch": 0,
        "estep": 1,
        "stats": {"x": [1, 2]},
    }
    assert _reason(pk(train)) == "schema"
    train["stats"] = {
        "x": {"__table__": 1, "columns": ["a"], "rows": [[1, 2]], "index": [], "heatmap": None}
    }
    assert _reason(pk(train)) == "schema"
    with pytest.raises(TypeError):
        decode("not bytes")  # type: ignore[arg-type]


def test_size_and_key_count_limits() -> None:
    recs = {f"k{i}": (6, [1.0, 1.0, 1.0, 1.0]) for i in range(50)}
    frame = encode_batch(H, recs, 50)
    assert _reason(frame, max_bytes=100) == "too_large"
    assert _reason(frame, max_keys=10) == "too_many_keys"
    assert isinstance(decode(frame, max_keys=50), Batch)
    # a map header claiming 2**31 entries in a tiny frame is refused before allocation
    absurd = b"\xdf\x7f\xff\xff\xff"
    assert _reason(absurd) in ("too_many_keys", "garbage")


def _train_frame(stats: dict[str, object], role: str = "train") -> bytes:
    return msgpack.packb(
        {"v": 1, "t": "train", "src": "t", "inc": "i", "seq": 1, "role": role,
         "step": 1, "epoch": 0, "estep": 1, "stats": stats}
    )  # fmt: skip


def test_tables_the_receiver_cannot_build_are_refused_by_the_decoder() -> None:
    """Regression: these decoded fine and then made ``Table()`` raise in the controller's
    committer task, which stopped every later commit."""
    tbl = {"__table__": 1, "columns": ["a", "b"], "rows": [[1, 2]], "index": [], "heatmap": None}
    assert isinstance(decode(_train_frame({"x": tbl})), Train)
    assert _reason(_train_frame({"x": {**tbl, "columns": ["a", "a"]}})) == "schema"
    assert _reason(_train_frame({"x": {**tbl, "index": ["a"], "heatmap": "b"}})) == "schema"
    ok = {**tbl, "columns": ["a", "b", "c"], "rows": [[1, 2, 3]], "index": ["a", "b"]}
    assert isinstance(decode(_train_frame({"x": {**ok, "heatmap": "c"}})), Train)


def test_record_weights_are_bounded_and_roles_match_the_message() -> None:
    """Regression: a weight near the float limit overflowed to inf when two frames merged,
    and projecting the SCALAR count (``int(inf)``) crashed the committer."""
    base = {"v": 1, "t": "batch", "src": "w", "inc": "i", "seq": 1, "n": 1}
    ok = msgpack.packb({**base, "r": {"k": [6, 1.0, 2.0**53, 1.0, 1.0]}})
    assert isinstance(decode(ok), Batch)
    assert _reason(msgpack.packb({**base, "r": {"k": [6, 1.0, 1e308, 1.0, 1.0]}})) == "schema"
    assert _reason(msgpack.packb({**base, "role": "train", "r": {}})) == "schema"
    assert _reason(_train_frame({"loss": 1.0}, role="rollout")) == "schema"


def test_fuzzed_frames_raise_only_decode_error() -> None:
    """A seeded fuzz: random bytes, mutated valid frames and valid msgpack of wrong shape
    never raise anything but DecodeError, and what decodes can be windowed and assembled."""
    import random

    from areal_stream.controller import assemble
    from bus._window import WindowBook

    rng = random.Random(20261130)
    th = Header("t", "i", 1, "train")
    table = Table(["a", "b"], [[1, 2.5]], index=["a"])
    valid = [
        encode_batch(H, {"k": (6, [1.0, 1.0, 1.0, 1.0]), "a": (1, [2.0, 2.0, 0.0, 2.0])}, 3, 2),
        encode_hello(H, 0.5),
        encode_heartbeat(H),
        encode_bye(H),
        encode_train(th, 3, 0, 3, {"loss": 0.5, "x": 1.0, "x__count": 3, "tb": table}),
    ]
    atoms: list[object] = [None, True, 0, -1, 2**63 - 1, -(2**63), 2**64 - 1, 1.5, math.nan,
                           math.inf, 1e308, "", "x", "__table__", b"\x00", 6, [], {}]  # fmt: skip

    def mutate(o: object, depth: int = 0) -> object:
        if isinstance(o, dict) and o:
            k = rng.choice(list(o))
            o[k] = rng.choice(atoms) if depth > 2 or rng.random() < 0.5 else mutate(o[k], depth + 1)
        elif isinstance(o, list) and o:
            i = rng.randrange(len(o))
            o[i] = rng.choice(atoms) if depth > 2 or rng.random() < 0.5 else mutate(o[i], depth + 1)
        return o

    book = WindowBook(seal_timeout=0.01)
    decoded = 0
    for i in range(3000):
        r = rng.random()
        if r < 0.2:
            frame = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 48)))
        elif r < 0.5:
            buf = bytearray(rng.choice(valid))
            buf[rng.randrange(len(buf))] = rng.getrandbits(8)
            frame = bytes(buf[: rng.randint(len(buf) // 2, len(buf))])
        else:
            frame = msgpack.packb(mutate(msgpack.unpackb(rng.choice(valid))))
        try:
            msg = decode(frame, max_keys=64)
        except DecodeError:
            continue
        decoded += 1
        if isinstance(msg, (Hello, Heartbeat, Bye, Batch, Train)):
            book.handle(msg, i * 0.02)
            for sealed in book.tick(i * 0.02):
                assemble(sealed)
    assert decoded > 100

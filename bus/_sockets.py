"""ZeroMQ helpers: loopback-only binds by default, port 0 -> a resolved address, bounded frames.

Sockets made here never linger on close unless asked to (a producer that must deliver its
last frames closes with an explicit linger), and receiving sockets carry ``MAXMSGSIZE`` so
libzmq drops an oversized frame (and the offending connection) before it is buffered.
"""

from __future__ import annotations

import ipaddress
import socket as _socket
from typing import Any, TypeVar

import zmq

from bus._codec import DEFAULT_MAX_BYTES

S = TypeVar("S", bound=zmq.Socket)

_LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "[::1]"}


def parse_tcp(addr: str) -> tuple[str, int]:
    """``tcp://host:port`` -> (host, port); raises ValueError naming what was wrong."""
    if not isinstance(addr, str):
        raise TypeError(f"endpoint must be a str, got {type(addr).__name__}")
    if not addr.startswith("tcp://"):
        raise ValueError(f"endpoint {addr!r} must look like tcp://HOST:PORT")
    rest = addr[len("tcp://") :]
    host, sep, port_s = rest.rpartition(":")
    if not sep or not host:
        raise ValueError(f"endpoint {addr!r} must look like tcp://HOST:PORT")
    if port_s == "*":
        return host, 0
    try:
        port = int(port_s)
    except ValueError:
        raise ValueError(f"endpoint {addr!r}: port {port_s!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"endpoint {addr!r}: port {port} out of range")
    return host, port


def is_loopback(host: str) -> bool:
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind_endpoint(addr: str, *, allow_remote: bool = False) -> str:
    """Validate a bind address; non-loopback hosts need ``allow_remote`` (no auth here)."""
    if addr.startswith(("ipc://", "inproc://")):
        return addr
    host, port = parse_tcp(addr)
    if not allow_remote and not is_loopback(host):
        raise ValueError(
            f"refusing to bind {addr!r}: only loopback addresses are allowed unless "
            "allow_remote=True (--allow-remote); the bus has no authentication or encryption, "
            "so only do that on a trusted network"
        )
    host = "127.0.0.1" if host == "localhost" else host
    return f"tcp://{host}:{'*' if port == 0 else port}"


def configure(sock: zmq.Socket, *, max_bytes: int | None = DEFAULT_MAX_BYTES) -> None:
    """linger=0 and (for receivers) a frame size limit enforced by libzmq."""
    sock.setsockopt(zmq.LINGER, 0)
    if max_bytes is not None:
        sock.setsockopt(zmq.MAXMSGSIZE, int(max_bytes))


def bind(sock: Any, addr: str, *, allow_remote: bool = False) -> str:
    """Bind ``sock`` and return the resolved endpoint (port 0 -> the port libzmq picked)."""
    ep = check_bind_endpoint(addr, allow_remote=allow_remote)
    try:
        sock.bind(ep)
    except zmq.ZMQError as e:
        raise ValueError(f"cannot bind {addr!r}: {e}") from None
    last = sock.getsockopt(zmq.LAST_ENDPOINT)
    resolved: str = last.decode() if isinstance(last, bytes) else str(last)
    return resolved


def free_tcp_port() -> int:
    """A currently free loopback port (for command lines that need a number up front)."""
    with _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port

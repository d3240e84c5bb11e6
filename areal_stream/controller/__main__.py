"""Command line: run the controller until SIGINT/SIGTERM, then commit what it holds."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from areal_stream.controller._service import ControllerOptions, ControllerService, make_sink
from bus._codec import DEFAULT_MAX_BYTES, DEFAULT_MAX_KEYS


def _positive(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m areal_stream.controller",
        description="Collect rollout and training metrics over ZeroMQ and commit each step.",
    )
    p.add_argument("--config", required=True, help="YAML with the stats_logger: block")
    p.add_argument("--bind", default="tcp://127.0.0.1:5555", help="data address (port 0 = any)")
    p.add_argument("--control", default="tcp://127.0.0.1:5556", help="control address")
    p.add_argument("--ready-file", help="write {data, control} JSON here once listening")
    p.add_argument("--seal-timeout", type=_positive, default=10.0, help="seconds (default 10)")
    p.add_argument(
        "--commit-every",
        type=_positive,
        help="rollout-only runs: close a window every S seconds (stops once a trainer registers)",
    )
    p.add_argument(
        "--gone-after",
        type=_positive,
        default=1.0,
        help="minimum silence (s) before a worker is declared gone (default 1; "
        "at least 4 of the worker's heartbeat intervals)",
    )
    p.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_BYTES)
    p.add_argument("--max-keys", type=int, default=DEFAULT_MAX_KEYS)
    p.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow binding non-loopback addresses (no authentication or encryption: "
        "use on trusted networks only)",
    )
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


async def _main(args: argparse.Namespace) -> int:
    sink = make_sink(args.config)
    opts = ControllerOptions(
        data=args.bind,
        control=args.control,
        seal_timeout=args.seal_timeout,
        commit_every=args.commit_every,
        max_bytes=args.max_message_bytes,
        max_keys=args.max_keys,
        allow_remote=args.allow_remote,
        gone_min=args.gone_after,
        ready_file=args.ready_file,
    )
    try:
        service = ControllerService(sink, opts)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, service.stop)
        await service.start()
    except BaseException:
        sink.close()
        raise
    await service.serve()
    logging.getLogger("areal_stream.controller").info(
        "controller stopped: %s", service.statistics()
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return asyncio.run(_main(args))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

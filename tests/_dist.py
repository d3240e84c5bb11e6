"""Run a function on N real torch.distributed (gloo) ranks in spawned processes.

``run_ranks(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` in each rank
after ``init_process_group("gloo")`` over a file store, and returns the list of the
ranks' return values (picklable). A rank that raises fails the call with its traceback;
a hang fails after ``timeout`` seconds and every rank process is killed.
``fn`` must be a module-level function of an importable module. Spawning costs seconds:
put several scenarios in one ``fn`` rather than one spawn per assertion.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import traceback
from collections.abc import Callable
from typing import Any


def _entry(
    fn: Callable[..., Any], rank: int, world: int, store: str, q: Any, args: tuple[Any, ...]
) -> None:
    import torch.distributed as dist

    try:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        try:
            q.put((rank, True, fn(rank, world, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        q.put((rank, False, traceback.format_exc()))
    # Deliver the result, then leave without running C++ static destructors: torch's gloo
    # threads sometimes abort an exiting interpreter ("terminate called without an active
    # exception"), which would turn a finished rank into a crash.
    q.close()
    q.join_thread()
    os._exit(0)


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 90.0
) -> list[Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world_size, store, q, args), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        errors: list[str] = []
        try:
            for _ in range(world_size):
                try:
                    rank, ok, value = q.get(timeout=timeout)
                except queue.Empty:
                    raise TimeoutError(
                        f"{world_size - len(results) - len(errors)} rank(s) did not finish "
                        f"within {timeout}s"
                    ) from None
                if ok:
                    results[rank] = value
                else:
                    errors.append(f"rank {rank}:\n{value}")
                    break
        finally:
            for p in procs:
                p.join(timeout=5 if not errors else 0.5)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
            q.close()
        if errors:
            raise AssertionError("a rank failed\n" + "\n".join(errors))
        return [results[r] for r in range(world_size)]

"""Scopes and timings: context managers that are also decorators (sync, async, generators).

A scope is a ``ContextVar`` per tracker holding the key prefix (``"a/b/"``), so each asyncio
task sees its own stack.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, TypeVar, cast

if TYPE_CHECKING:
    from areal_stream._tracker import DistributedStatsTracker

F = TypeVar("F", bound=Callable[..., Any])


class Scope:
    """``with tracker.scope("a"):`` pushes ``a/`` for the current task; also a decorator."""

    __slots__ = ("_seg", "_var")

    def __init__(self, var: ContextVar[str], name: str) -> None:
        if not isinstance(name, str):
            raise TypeError(f"scope name must be a str, got {type(name).__name__}")
        name = name.strip("/")
        if not name:
            raise ValueError("scope name must be a non-empty string")
        self._var = var
        self._seg = name + "/"

    def __enter__(self) -> Scope:
        self._var.set(self._var.get() + self._seg)
        return self

    def __exit__(self, *exc: object) -> None:
        # Restore the parent by dropping our segment: no token, so one instance can be
        # entered by many tasks at once (each task has its own value).
        cur = self._var.get()
        if not cur.endswith(self._seg):
            raise RuntimeError(f"scope {self._seg[:-1]!r} exited out of order (now {cur!r})")
        self._var.set(cur[: -len(self._seg)])

    async def __aenter__(self) -> Scope:
        return self.__enter__()

    async def __aexit__(self, *exc: object) -> None:
        self.__exit__(*exc)

    def __call__(self, fn: F) -> F:
        if inspect.isasyncgenfunction(fn):

            @functools.wraps(fn)
            async def agwrapper(*args: Any, **kwargs: Any) -> Any:
                agen = fn(*args, **kwargs)
                own = self._seg
                step, arg = agen.asend, None
                while True:
                    base = self._enter_own(own)
                    try:
                        item = await step(arg)
                    except StopAsyncIteration:
                        return
                    finally:
                        own = self._leave_own(base, own)
                    try:
                        arg = yield item
                        step = agen.asend
                    except GeneratorExit:
                        base = self._enter_own(own)
                        try:
                            await agen.aclose()
                        finally:
                            self._leave_own(base, own)
                        raise
                    except BaseException as exc:
                        step, arg = agen.athrow, exc

            return cast(F, agwrapper)
        if inspect.isgeneratorfunction(fn):

            @functools.wraps(fn)
            def gwrapper(*args: Any, **kwargs: Any) -> Any:
                return (yield from self._steps(fn(*args, **kwargs)))

            return cast(F, gwrapper)
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def awrapper(*args: Any, **kwargs: Any) -> Any:
                with self:
                    return await fn(*args, **kwargs)

            return cast(F, awrapper)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self:
                result = fn(*args, **kwargs)
            # A callable that hides what it returns (an object with ``async def
            # __call__``, a decorator without ``wraps``): scope the body it runs later.
            if inspect.iscoroutine(result):
                return self._awaited(result)
            if inspect.isgenerator(result):
                return self._steps(result)
            return result

        return cast(F, wrapper)

    async def _awaited(self, coro: Any) -> Any:
        with self:
            return await coro

    # A generator's body runs in its consumer's context, a step at a time. The body keeps
    # its own scope suffix (this scope plus whatever scopes it is inside at a ``yield``):
    # it is put on top of the consumer's scope for each step (send/throw/close) and taken
    # off before each value is handed out, so the consumer never sees it. (Async
    # generators: the same loop, inline in ``agwrapper``.)

    def _enter_own(self, own: str) -> str:
        base = self._var.get()
        self._var.set(base + own)
        return base

    def _leave_own(self, base: str, own: str) -> str:
        cur = self._var.get()
        self._var.set(base)
        return cur[len(base) :] if cur.startswith(base) else own

    def _steps(self, gen: Any) -> Any:
        own = self._seg
        step, arg = gen.send, None
        while True:
            base = self._enter_own(own)
            try:
                item = step(arg)
            except StopIteration as stop:
                return stop.value
            finally:
                own = self._leave_own(base, own)
            try:
                arg = yield item
                step = gen.send
            except GeneratorExit:
                base = self._enter_own(own)
                try:
                    gen.close()
                finally:
                    self._leave_own(base, own)
                raise
            except BaseException as exc:
                step, arg = gen.throw, exc


class Timing:
    """Records the wall time of a block as SCALAR ``timeperf/<name>``; also a decorator."""

    __slots__ = ("_key", "_starts", "_tracker")

    def __init__(self, tracker: DistributedStatsTracker, name: str) -> None:
        if not isinstance(name, str) or not name.strip("/"):
            raise ValueError("record_timing needs a non-empty name")
        self._tracker = tracker
        self._key = "timeperf/" + name.strip("/")
        self._starts: list[float] = []

    def __enter__(self) -> Timing:
        self._starts.append(time.perf_counter())
        return self

    def __exit__(self, *exc: object) -> None:
        elapsed = time.perf_counter() - self._starts.pop()
        # Fixed under "timeperf/", outside any scope, as in the reference.
        self._tracker._record_unscoped({self._key: elapsed})

    def __call__(self, fn: F) -> F:
        tracker, name = self._tracker, self._key[len("timeperf/") :]
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def awrapper(*args: Any, **kwargs: Any) -> Any:
                with Timing(tracker, name):
                    return await fn(*args, **kwargs)

            return cast(F, awrapper)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with Timing(tracker, name):
                return fn(*args, **kwargs)

        return cast(F, wrapper)

"""Per-task workflow context (eval or training), as in AReaL's ``workflow_context``.

Held in a ``ContextVar``: each asyncio task sees the context it (or its parent) set.
"""

from __future__ import annotations

import builtins
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class WorkflowContext:
    """What a running workflow knows about itself."""

    is_eval: bool = False
    task_id: int | None = None
    sample_idx: int | None = None
    group_size: int = 1
    extra: Any = None


_current: ContextVar[WorkflowContext] = ContextVar("areal_stream_workflow_context")
_DEFAULT = WorkflowContext()


def set(ctx: WorkflowContext) -> Token[WorkflowContext]:
    """Make ``ctx`` the current task's context; returns a token for :func:`reset`."""
    if not isinstance(ctx, WorkflowContext):
        raise TypeError(f"workflow_context.set expects a WorkflowContext, got {type(ctx)!r}")
    return _current.set(ctx)


def reset(token: Token[WorkflowContext]) -> None:
    """Restore the context that was current before the matching :func:`set`."""
    _current.reset(token)


def get() -> WorkflowContext:
    """The current task's context (a default, non-eval one if none was set)."""
    return _current.get(_DEFAULT)


@contextmanager
def using(ctx: WorkflowContext) -> Iterator[WorkflowContext]:
    """Run a block under ``ctx`` and restore the previous context afterwards."""
    token = set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)


def stat_scope() -> builtins.str:
    """Tracker name for the current workflow: ``"eval-rollout"`` or ``"rollout"``."""
    return "eval-rollout" if get().is_eval else "rollout"

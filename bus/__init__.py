"""The message-bus layer: mergeable aggregates, the wire codec, ZMQ sockets, windows.

Imports nothing else of this project, so ``workers`` and ``areal_stream`` can build on it.
"""

from bus._aggregate import (
    INF,
    Record,
    ReduceType,
    merge_into,
    new_record,
    output_keys,
    project,
    project_all,
)

__all__ = [
    "INF",
    "Record",
    "ReduceType",
    "merge_into",
    "new_record",
    "output_keys",
    "project",
    "project_all",
]

"""Error types raised at the recording boundary."""

from __future__ import annotations


class StatsInputError(TypeError, ValueError):
    """A recorded value has the wrong type or dtype.

    Subclasses both TypeError (what it is) and ValueError (what the reference raised), so
    code written against either keeps working.
    """

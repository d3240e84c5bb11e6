"""The metrics controller: ``python -m areal_stream.controller --config run.yaml ...``.

Rollout workers (``RolloutStream``) and training rank 0 (``TrainStream``) push to its data
address; it announces seals and commit notices on its control address, merges each
global step's train report with the rollout window sealed for it, and commits the step.
"""

from areal_stream.controller._process import ControllerProcess, child_env
from areal_stream.controller._service import (
    ControllerOptions,
    ControllerService,
    Sink,
    assemble,
    combine,
    make_sink,
)

__all__ = [
    "ControllerOptions",
    "ControllerProcess",
    "ControllerService",
    "Sink",
    "assemble",
    "child_env",
    "combine",
    "make_sink",
]

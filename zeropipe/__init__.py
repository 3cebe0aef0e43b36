"""zeropipe: pipeline-parallel training where the backward pass is scheduled."""

from zeropipe.errors import PipelineError, ScheduleError, ZeropipeError
from zeropipe.ir import Action, Kind, Schedule

__all__ = [
    "Action",
    "Kind",
    "PipelineError",
    "Schedule",
    "ScheduleError",
    "ZeropipeError",
]

__version__ = "0.1.0"

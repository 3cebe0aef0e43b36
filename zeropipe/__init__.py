"""zeropipe: pipeline-parallel training where the backward pass is scheduled.

The schedule half (IR, dependencies, validator, generators, simulator) is
importable without torch; the runtime names (``Pipeline``, ``launch``,
``profile``, the autograd tools) are loaded on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from zeropipe.costs import CostModel, StageCost
from zeropipe.errors import PipelineError, ScheduleError, ZeropipeError
from zeropipe.ir import Action, Kind, Schedule
from zeropipe.lower import lower
from zeropipe.schedules import GENERATORS, generate
from zeropipe.simulate import Timeline, simulate
from zeropipe.validate import validate

__all__ = [
    "GENERATORS",
    "Action",
    "CostModel",
    "Kind",
    "Pipeline",
    "PipelineError",
    "Schedule",
    "ScheduleError",
    "StageCost",
    "Timeline",
    "ZeropipeError",
    "generate",
    "init_from_env",
    "is_recomputing",
    "launch",
    "lower",
    "profile",
    "simulate",
    "validate",
]

__version__ = "0.1.0"

# name -> module that defines it; imported on first access (these need torch).
_LAZY = {
    "Pipeline": "zeropipe.runtime.pipeline",
    "launch": "zeropipe.runtime.launch",
    "init_from_env": "zeropipe.runtime.launch",
    "is_recomputing": "zeropipe.runtime.memory",
    "profile": "zeropipe.profiling",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'zeropipe' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value

"""zeropipe: pipeline-parallel training where the backward pass is scheduled.

The schedule half (IR, dependencies, validator, generators, simulator,
``build_schedule``) is importable without torch; the names that need torch
(``Pipeline``, ``RuntimeOptions``, ``launch``, ``profile``, ``auto_plan``,
``split``, ``causal_lm_loss``, ``save_checkpoint``, ``load_checkpoint``)
are loaded on first use.  docs/architecture.md describes the layers.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from zeropipe.core.costs import CostModel, StageCost
from zeropipe.core.errors import PipelineError, ScheduleError, ZeropipeError
from zeropipe.core.ir import Action, Kind, Schedule
from zeropipe.core.passes.build import build_schedule
from zeropipe.core.passes.lower import lower
from zeropipe.core.schedules import GENERATORS, generate
from zeropipe.core.simulate import Timeline, simulate
from zeropipe.core.validate import validate

__all__ = [
    "GENERATORS",
    "Action",
    "CostModel",
    "DeferredBatchNorm",
    "Kind",
    "Microbatches",
    "Pipeline",
    "PipelineError",
    "Plan",
    "RuntimeOptions",
    "Schedule",
    "ScheduleError",
    "StageCost",
    "Timeline",
    "ZeropipeError",
    "auto_plan",
    "build_schedule",
    "causal_lm_loss",
    "deferred_batch_norm",
    "generate",
    "init_from_env",
    "is_recomputing",
    "launch",
    "load_checkpoint",
    "lower",
    "parallelize",
    "profile",
    "save_checkpoint",
    "simulate",
    "split",
    "validate",
]

__version__ = "0.1.0"

# name -> module that defines it; imported on first access (these need torch).
_LAZY = {
    "Pipeline": "zeropipe.runtime.pipeline",
    "Microbatches": "zeropipe.runtime.step.stage",
    "RuntimeOptions": "zeropipe.runtime.options",
    "Plan": "zeropipe.planning.plan",
    "auto_plan": "zeropipe.planning.plan",
    "launch": "zeropipe.runtime.launch",
    "init_from_env": "zeropipe.runtime.launch",
    "is_recomputing": "zeropipe.runtime.memory.manager",
    "profile": "zeropipe.planning.plan",
    "split": "zeropipe.adapters.split",
    "parallelize": "zeropipe.adapters.tp",
    "causal_lm_loss": "zeropipe.adapters.loss",
    "save_checkpoint": "zeropipe.runtime.checkpoint.dcp",
    "load_checkpoint": "zeropipe.runtime.checkpoint.dcp",
    "DeferredBatchNorm": "zeropipe.runtime.step.batch_norm",
    "deferred_batch_norm": "zeropipe.runtime.step.batch_norm",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'zeropipe' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value

"""Typed errors that zeropipe raises for bad input and failed runs.

Every error names what is wrong and how to fix it; schedule errors also carry
the rank x step grid with the failing step marked, so a user sees *where* in
the schedule the rule broke, not just that it broke.
"""

from __future__ import annotations

__all__ = ["PipelineError", "ScheduleError", "ZeropipeError"]


class ZeropipeError(Exception):
    """Base class of every error zeropipe raises on purpose."""


class ScheduleError(ZeropipeError, ValueError):
    """A schedule (or a request for one) breaks a rule.

    ``rule`` is a short machine-readable name of the broken rule (``"missing"``,
    ``"duplicate"``, ``"order"``, ``"placement"``, ``"deadlock"``, ``"memory"``,
    ``"unsupported"``, ``"costs"`` for an impossible cost figure, ...); ``actions`` are
    the culprits in canonical text form.
    """

    def __init__(
        self,
        message: str,
        *,
        rule: str = "invalid",
        actions: tuple[str, ...] = (),
        grid: str = "",
    ) -> None:
        self.rule = rule
        self.actions = actions
        self.grid = grid
        full = message if not grid else f"{message}\n{grid}"
        super().__init__(full)


class PipelineError(ZeropipeError, RuntimeError):
    """Running a pipeline failed: bad stages, a boundary mismatch, a failed rank."""

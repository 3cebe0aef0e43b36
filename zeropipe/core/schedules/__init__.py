"""Schedule generators: pure functions of (ranks, microbatches, chunks); no torch import.

Each generator is registered under its CLI name and returns a compute-only
:class:`~zeropipe.core.ir.Schedule` (lower it with :func:`zeropipe.core.passes.lower.lower`).
``generate("1f1b", ranks=4, microbatches=8)`` is the one entry point; a
combination a generator cannot produce raises ``ScheduleError(rule="unsupported")``
saying which values would work.
"""

from __future__ import annotations

# Importing the generator modules registers them with the registry.
from zeropipe.core.schedules import (  # noqa: F401
    auto,
    basic,
    dualpipe,
    interleaved,
    looped_bfs,
    zbv,
    zero_bubble,
)
from zeropipe.core.schedules.registry import GENERATORS, Generator, generate, register

__all__ = ["GENERATORS", "Generator", "generate", "register"]
